"""Peer faults with real daemons, real NIXL and real worker processes: a D daemon or
D worker killed mid-stream, a silent (stopped) peer, and a peer that comes back under
the same name.

What P promises, and what these tests check:

* Every P request gets exactly one final event (SendDone or SendFailed), and never
  before NIXL settled its WRITE: P's blocks are reusable once the event arrives, so an
  event while the WRITE may still read them would let the worker overwrite bytes in
  flight. The check compares the worker's arrival time of each final event with the
  ``write_settled`` time in P's log.
* A WRITE whose target died settles (NIXL reports an error) within a bound we measure;
  a WRITE whose target is stopped stays in flight, its blocks leased, until the
  target resumes or dies. NIXL cannot recall a posted WRITE (releasing a UCX put
  does not cancel it), so P never frees blocks on a timer.
* A dead or silent peer is forgotten within ``peer_timeout_s``: its agents unloaded,
  its registrations dropped or failed; a new incarnation is handshaken afresh and no
  WRITE goes to the old one.

Figures are printed (run with ``-s``) for docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from kvworker import pattern

pytestmark = pytest.mark.nixl

LAYERS = 4
BLOCK_LEN = 128 * 1024
PUSH_BLOCKS = 4  # 4 blocks x 8 regions x 128 KiB = 4 MiB per push
P_BLOCKS = 64
D_BLOCKS = 64
STREAM = 120
STREAM_D_BLOCKS = 56  # the stream cycles through D blocks 0..55; 56..63 are for held requests
HERE = Path(__file__).parent


# ---------------------------------------------------------------------------- helpers


def _config(base_dir: Path, name: str, **fields: float) -> tuple[str, str]:
    path = base_dir / f"{name}.toml"
    path.write_text("".join(f"{k} = {v!r}\n" for k, v in fields.items()))
    return "--config", str(path)


def _restart(spawn, old, *extra):
    """A new daemon process under the old one's engine id (and runtime dir)."""
    (old.runtime_dir / "ready.json").unlink(missing_ok=True)
    return spawn.daemon(old.engine_id, *extra)


def _workers(spawn, P, D, d_seed=2):
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN, seed=1)
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=d_seed)
    assert pw.hello["ok"] and dw.hello["ok"], (pw.hello, dw.hello)
    return pw, dw


def _blocks(i: int, total: int) -> list[list[int]]:
    return [[(PUSH_BLOCKS * i + k) % total for k in range(PUSH_BLOCKS)]]


def _push(P, pw, dw, rid, p_blocks, d_blocks, timeout=20.0):
    dw.call("recv", request_id=rid, block_ids=[d_blocks], remote_engine_id=P.engine_id,
            remote_host="127.0.0.1", remote_port=P.side_port)
    pw.call("ready", request_id=rid, block_ids=[p_blocks])
    return dw.wait(rid, timeout), pw.wait(rid, timeout)


def _check_exact(dw, mapping: dict[int, int], seed_p=1):
    """D's blocks in ``mapping`` hold exactly P's (seed_p) bytes of the mapped block."""
    digests = dw.digests()
    for region in range(2 * LAYERS):
        for d_block, p_block in mapping.items():
            want = hashlib.sha1(pattern(seed_p, region, p_block, BLOCK_LEN)).hexdigest()
            assert digests[region][d_block] == want, (region, d_block, p_block)


def _start_stream(P, pw, dw, prefix: str, n: int = STREAM, interval: float = 0.01):
    """P's blocks for ``n`` pushes are staged at once; D registers them one by one
    (paced, from a thread) so WRITEs keep flowing while the test strikes."""
    ids = [f"{prefix}{i}" for i in range(n)]
    pw.call("ready_many", requests=[[rid, _blocks(i, P_BLOCKS)] for i, rid in enumerate(ids)])

    def register() -> None:
        try:
            dw.call("recv_many", requests=[[rid, _blocks(i, STREAM_D_BLOCKS)] for i, rid in enumerate(ids)],
                    remote_engine_id=P.engine_id, remote_host="127.0.0.1", remote_port=P.side_port,
                    interval=interval)
        except RuntimeError:
            pass  # the D side died under it: that is the test

    thread = threading.Thread(target=register, daemon=True)
    thread.start()
    return ids, thread


def _wait_until(pred, timeout: float, what: str, period: float = 0.01) -> float:
    """Seconds until ``pred()`` held; fails the test after ``timeout``."""
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"not within {timeout}s: {what}"
        time.sleep(period)
    return time.monotonic() - t0


def _strike(P, proc, sig: int, min_done: int = 15, catch_s: float = 2.0, latest_done: int = STREAM * 2 // 3) -> float:
    """Send ``sig`` to ``proc`` once the stream runs, preferably while a WRITE is in
    flight (polled for up to ``catch_s``, and only while fewer than ``latest_done`` pushes
    are done, so the stream is still running when the signal lands; a loaded host may not
    catch a WRITE in flight, which the ``held`` requests of the tests make up for).
    Returns the wall-clock time of the signal."""
    _wait_until(lambda: P.metric("pushsvc_transfers_total", result="done") >= min_done, 30, "stream running",
                period=0.002)
    deadline = time.monotonic() + catch_s
    while (time.monotonic() < deadline and P.metric("pushsvc_inflight_writes") < 1
           and P.metric("pushsvc_transfers_total", result="done") < latest_done):
        pass
    t = time.time()
    proc.send_signal(sig)
    return t


def _register_held(P, dw, n: int = 3, prefix: str = "held", blocks: int = 1) -> list[str]:
    """D registrations P holds without blocks yet (``blocks`` each, from D block 63 down):
    P gets its blocks for them only when the test says so."""
    ids = [f"{prefix}{i}" for i in range(n)]
    before = P.live_info()["tables"]["p_registrations"]
    for i, rid in enumerate(ids):
        dw.call("recv", request_id=rid, block_ids=[_held_blocks(i, blocks)], remote_engine_id=P.engine_id,
                remote_host="127.0.0.1", remote_port=P.side_port)
    _wait_until(lambda: P.live_info()["tables"]["p_registrations"] == before + n, 10, "P holds D's registrations")
    return ids


def _held_blocks(i: int, blocks: int) -> list[int]:
    assert D_BLOCKS - (i + 1) * blocks >= STREAM_D_BLOCKS
    return list(range(D_BLOCKS - (i + 1) * blocks, D_BLOCKS - i * blocks))


def _log_events(daemon) -> list[dict]:
    events = []
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def _ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


def _writes(P) -> dict[str, dict]:
    """rid -> {posted, settled, state[, slices]} from P's debug log (the last WRITE of each
    id; ``slices``: "posted/all" for a WRITE posted in slices)."""
    out: dict[str, dict] = {}
    for e in _log_events(P):
        if e.get("event") == "write_posted":
            out[e["request_id"]] = {"posted": _ts(e)}
        elif e.get("event") == "write_settled" and e["request_id"] in out:
            out[e["request_id"]].update(settled=_ts(e), state=e["state"])
            if "slices" in e:
                out[e["request_id"]]["slices"] = e["slices"]
    return out


def _check_final_events(P, collected: dict, ids: list[str]) -> dict[str, dict]:
    """Exactly one final event per P request, and none before its WRITE settled."""
    writes = _writes(P)
    for rid in ids:
        events = collected["events"][rid]
        assert len(events) == 1, (rid, events)
        event, arrived = events[0], collected["at"][rid][0]
        assert event["type"] in ("SendDone", "SendFailed"), event
        w = writes.get(rid)
        if event["type"] == "SendDone":
            assert w is not None and w.get("state") == "DONE", (rid, w)
        if w is not None:
            # A WRITE was posted for it: the worker may reuse the blocks only after
            # NIXL settled the handle.
            assert "settled" in w, f"{rid}: final event {event} but its WRITE never settled"
            assert arrived >= w["settled"], f"{rid}: final event {arrived - w['settled']:.6f}s before the WRITE settled"
            if w["state"] != "DONE":
                assert event["type"] == "SendFailed", (rid, event)
    return writes


def _p_clean(P, remote_agents: int) -> bool:
    info = P.live_info()
    h = info["nixl_handles"]
    return (not any(info["tables"].values()) and h["xfers"] == 0 and h["remote_agents"] == remote_agents
            and h["dlists"] == 1 + remote_agents and P.metric("pushsvc_inflight_writes") == 0)


def _figure(name: str, **values) -> None:
    print(f"\nFIGURE {name}: " + json.dumps(values))


# ---------------------------------------------------------------------------- peer death


@pytest.mark.slow
@pytest.mark.parametrize("how, ucx_mode, slice_mib", [("running", "peer", 0), ("stopped_then_killed", "peer", 0),
                                                      ("running", "none", 0), ("stopped_then_killed", "peer", 1)])
def test_kill_d_daemon_mid_stream(spawn, base_dir, how, ucx_mode, slice_mib):
    """kill -9 D's daemon during a stream of 120 pushes of 4 MiB each. ``stopped_then_killed``
    first stops D, then lets P WRITE registrations it held: those WRITEs cannot finish, so
    the kill certainly meets WRITEs in flight. With ``ucx_error_handling_mode = "none"`` a
    WRITE into a stopped D settles (docs/architecture.md, "UCX transports"), so only the
    running case applies there. With ``slice_mib`` P posts each push in 1 MiB slices, the
    next once the one before settled, and the two held registrations take 4 MiB each: the
    kill meets them part-way, and the slices after the one in flight are never posted.

    "Cannot finish": on one host UCX puts the bytes by cma, which the kernel copies into a
    stopped process too, but settling a WRITE needs the target: probed directly, WRITEs of
    2 and 8 MiB into a stopped process, with and without a notification, posted 0, 2 or 200
    ms after the stop, were all still in progress after 0.5-1 s. Yet here, on a loaded
    host, the first slice of a held WRITE posted a few ms after the stop was seen to
    settle into the stopped D, and the second then stayed in flight (with two busy loops
    beside it, 5 runs of 8 on 2026-12-06 when the held WRITEs had two slices); why is not
    established. So a held WRITE has four slices, and the test asks that the kill met it
    part-way, not at which slice."""
    mode = ("--ucx-error-handling-mode", ucx_mode)
    slicing = ("--post-slice-mib", str(slice_mib)) if slice_mib else ()
    P = spawn.daemon("prefill", "--log-level", "debug", "--lease-s", "4", *mode, *slicing)
    D = spawn.daemon("decode", *mode)
    pw, dw = _workers(spawn, P, D)
    assert [e["type"] for e in _push(P, pw, dw, "warm", [0], [0])] == ["RecvDone", "SendDone"]

    per_held, n_held = (4, 2) if slice_mib else (1, 3)
    held = _register_held(P, dw, n=n_held, blocks=per_held)
    ids, thread = _start_stream(P, pw, dw, "s")
    if how == "running":
        t_kill = _strike(P, D.proc, signal.SIGKILL)
    else:
        _strike(P, D.proc, signal.SIGSTOP, catch_s=0)
        # P's blocks for the held registrations: these WRITEs meet a target that makes
        # no progress, so they are certainly in flight when the kill lands.
        pw.call("ready_many", requests=[[rid, [[30 + per_held * i + k for k in range(per_held)]]]
                                        for i, rid in enumerate(held)])
        _wait_until(lambda: P.metric("pushsvc_inflight_writes") >= len(held), 10, "WRITEs to the stopped D")
        stuck = P.metric("pushsvc_inflight_writes")
        time.sleep(1.0)
        # A stopped target keeps WRITEs in flight: P must not have let them go.
        assert P.metric("pushsvc_inflight_writes") >= stuck
        t_kill = time.time()
        D.proc.send_signal(signal.SIGKILL)
        ids = [*ids, *held]
    D.proc.wait()
    # Settling: no WRITE handle left, nothing in flight.
    _wait_until(lambda: P.live_info()["nixl_handles"]["xfers"] == 0 and P.metric("pushsvc_inflight_writes") == 0,
                30, "P's WRITEs settled", period=0.002)
    zero_s = time.time() - t_kill
    thread.join(30)
    # Staged requests D never registered end at their lease (4 s): every id ends.
    collected = pw.call("collect", request_ids=ids, timeout=40, linger=0.5)
    writes = _check_final_events(P, collected, ids)
    posted = [rid for rid in ids if rid in writes]
    in_flight_at_kill = [rid for rid in posted if writes[rid]["posted"] < t_kill < writes[rid].get("settled", 1e18)]
    last_settle = max((writes[rid]["settled"] for rid in in_flight_at_kill), default=t_kill)
    types = [collected["events"][rid][0]["type"] for rid in ids]
    assert "SendDone" in types and "SendFailed" in types, "the kill did not land mid-stream"
    if how == "stopped_then_killed":
        assert set(held) <= set(in_flight_at_kill), (held, in_flight_at_kill)
    if slice_mib:  # every push went in slices: the held ones stopped part-way
        done = [rid for rid in ids if writes.get(rid, {}).get("state") == "DONE"]
        assert done and all(writes[rid]["slices"] == "4/4" for rid in done), [writes[r] for r in done]
        # part-way: a slice was in flight at the kill, and none was posted after it failed
        assert all(writes[rid]["slices"] in ("1/4", "2/4", "3/4") for rid in held), [writes[r] for r in held]
        assert all(collected["events"][rid][0]["type"] == "SendFailed" for rid in held)
    # P forgets D: tables, leases, WRITE handles and D's agent (its prepped list too).
    _wait_until(lambda: _p_clean(P, remote_agents=0), 30, "P back to zero")
    assert not P.live_info()["peers"]
    _figure(f"kill_d_daemon[{how}, {ucx_mode}{', slices of %d MiB' % slice_mib if slice_mib else ''}]", pushes=len(ids), done=types.count("SendDone"),
            failed=types.count("SendFailed"), writes_in_flight_at_kill=len(in_flight_at_kill),
            kill_to_last_settle_s=round(last_settle - t_kill, 4),
            kill_to_zero_xfers_polled_s=round(zero_s, 3),
            failure_kinds=sorted({collected["events"][r][0].get("reason", "").split(":")[0] for r in ids
                                  if collected["events"][r][0]["type"] == "SendFailed"}))

    # D comes back (new port, fresh worker): pushes work, bytes exact.
    D2 = _restart(spawn, D, *mode)
    dw2 = spawn.worker(D2, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=3)
    for i, (p_blk, d_blk) in enumerate([(5, 9), (6, 10), (7, 11)]):
        events = _push(P, pw, dw2, f"again{i}", [p_blk], [d_blk])
        assert [e["type"] for e in events] == ["RecvDone", "SendDone"], events
    _check_exact(dw2, {9: 5, 10: 6, 11: 7})
    _wait_until(lambda: _p_clean(P, remote_agents=1), 10, "P clean after the new pushes")


@pytest.mark.slow
def test_kill_d_worker_mid_stream(spawn):
    """kill -9 the D worker (the stand-in for D's vLLM) mid-stream: D's daemon keeps
    the memory mapped, withdraws the worker's registrations, P answers, all returns to
    zero, and a new D worker registers and receives."""
    P = spawn.daemon("prefill", "--log-level", "debug", "--lease-s", "4")
    D = spawn.daemon("decode", "--log-level", "debug")
    pw, dw = _workers(spawn, P, D)
    assert [e["type"] for e in _push(P, pw, dw, "warm", [0], [0])] == ["RecvDone", "SendDone"]
    held = _register_held(P, dw)  # D must withdraw these when its worker dies
    ids, thread = _start_stream(P, pw, dw, "w")
    t_kill = _strike(P, dw.proc, signal.SIGKILL)
    dw.proc.wait()
    thread.join(30)
    collected = pw.call("collect", request_ids=ids, timeout=40, linger=0.5)
    writes = _check_final_events(P, collected, ids)
    # D withdrew what the worker had registered; P acknowledged every withdrawal.
    withdrawn = [e for e in _log_events(D) if e.get("event") == "recv_cancelled" and e.get("waiting_for_p")]
    acked = [e for e in _log_events(P) if e.get("event") == "push_cancelled"]
    assert set(held) <= {e["request_id"] for e in withdrawn}, withdrawn
    assert {e["remote_request_id"] for e in acked} >= {e["request_id"] for e in withdrawn}
    _wait_until(lambda: not any(D.live_info()["tables"].values()), 30, "D's tables empty")
    _wait_until(lambda: _p_clean(P, remote_agents=1), 30, "P back to zero")
    # The dead worker's rank retired, and once nothing of it was in flight its agent and
    # mapping were released: nothing is kept for a worker that is gone.
    _wait_until(lambda: not D.live_info()["agents"] and not D.live_info()["retiring_agents"], 10, "rank released")
    assert D.live_info()["nixl_handles"]["registrations"] == 0
    types = [collected["events"][rid][0]["type"] for rid in ids]
    _figure("kill_d_worker", pushes=len(ids), done=types.count("SendDone"), failed=types.count("SendFailed"),
            withdrawn=len(withdrawn), kill_to_last_final_s=round(max(max(a) for a in collected["at"].values()) - t_kill, 3),
            writes_posted=len(writes))

    dw2 = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=4)
    events = _push(P, pw, dw2, "after", [12, 13], [20, 21])
    assert [e["type"] for e in events] == ["RecvDone", "SendDone"], events
    _check_exact(dw2, {20: 12, 21: 13})
    # The old rank retired: its agent and memory are gone, the new one is all that is left.
    _wait_until(lambda: D.live_info()["nixl_handles"]["registrations"] == 1, 10, "old rank retired")
    assert not any(D.live_info()["tables"].values())


# ---------------------------------------------------------------------------- liveness


FAST = {"heartbeat_interval_s": 0.2, "peer_timeout_s": 1.0}


def _first_event(daemon, name: str, after: float, **fields) -> float | None:
    for e in _log_events(daemon):
        if e.get("event") == name and _ts(e) >= after and all(e.get(k) == v for k, v in fields.items()):
            return _ts(e)
    return None


@pytest.mark.slow
def test_silent_d_is_detected_and_recovers(spawn, base_dir):
    """SIGSTOP D's daemon: P declares it silent within peer_timeout_s (+ one read), drops
    D's registrations, keeps WRITEs into D in flight (never frees their blocks); after
    SIGCONT both sides re-handshake and new pushes work."""
    P = spawn.daemon("prefill", "--log-level", "debug", *_config(base_dir, "p", **FAST))
    D = spawn.daemon("decode", *_config(base_dir, "d", **FAST))
    pw, dw = _workers(spawn, P, D)
    assert [e["type"] for e in _push(P, pw, dw, "warm", [0], [0])] == ["RecvDone", "SendDone"]
    # Registrations P holds without blocks yet. Three get P's blocks once D is stopped
    # (their WRITEs meet a target that makes no progress); three are still unmatched
    # when D is declared silent, and are dropped.
    waiting = [f"waiting{i}" for i in range(6)]
    for i, rid in enumerate(waiting):
        dw.call("recv", request_id=rid, block_ids=[[56 + i]], remote_engine_id=P.engine_id,
                remote_host="127.0.0.1", remote_port=P.side_port)
    _wait_until(lambda: P.live_info()["tables"]["p_registrations"] == 6, 10, "P holds D's registrations")
    ids, thread = _start_stream(P, pw, dw, "q", n=14, interval=0.01)  # D blocks 0..55
    t_stop = _strike(P, D.proc, signal.SIGSTOP, min_done=5, catch_s=0)
    try:
        pw.call("ready_many", requests=[[rid, [[20 + i]]] for i, rid in enumerate(waiting[:3])])
        detect_s = _wait_until(lambda: not P.live_info()["peers"], 15, "P forgets the silent D")
        t_down = _first_event(P, "peer_down", t_stop, peer="decode")
        assert t_down is not None
        assert P.live_info()["tables"]["p_registrations"] == 0
        assert P.metric("pushsvc_failures_total", kind="peer_lost") >= 3
        # WRITEs into the stopped D have not settled: their blocks stay leased, also
        # after D was declared silent.
        stuck = P.metric("pushsvc_inflight_writes")
        assert stuck >= 3 and P.live_info()["nixl_handles"]["xfers"] == stuck
        held = [e for e in _log_events(P) if e.get("event") == "writes_held" and e.get("peer") == "decode"]
        assert held and held[-1]["writes"] == stuck, held
        time.sleep(1.0)
        assert P.metric("pushsvc_inflight_writes") == stuck
        assert all(e["event"] is None for e in [pw.call("wait", request_id=r, timeout=0) for r in waiting[:3]])
        handshakes = P.metric("pushsvc_handshakes_total")
    finally:
        t_cont = time.time()
        D.proc.send_signal(signal.SIGCONT)
    thread.join(30)
    collected = pw.call("collect", request_ids=[*ids, *waiting[:3]], timeout=30, linger=0.3)
    _check_final_events(P, collected, [*ids, *waiting[:3]])
    events = dw.call("collect", request_ids=[*ids, *waiting], timeout=30, linger=0.3)
    assert all(len(v) == 1 for v in events["events"].values()), events
    assert all(events["events"][rid][0]["type"] == "RecvFailed" for rid in waiting[3:])
    # Both recover: a new handshake, new pushes with exact bytes.
    rehandshake_s = None
    t0 = time.time()
    for i, (p_blk, d_blk) in enumerate([(30, 50), (31, 51)]):
        ev = _push(P, pw, dw, f"back{i}", [p_blk], [d_blk])
        assert [e["type"] for e in ev] == ["RecvDone", "SendDone"], ev
        rehandshake_s = rehandshake_s or time.time() - t0
    assert P.metric("pushsvc_handshakes_total") > handshakes
    assert [p["daemon_id"] for p in P.live_info()["peers"]] == [D.info["daemon_id"]]
    _check_exact(dw, {50: 30, 51: 31})
    _wait_until(lambda: _p_clean(P, remote_agents=1), 10, "P clean")
    _wait_until(lambda: not any(D.live_info()["tables"].values()), 10, "D clean")
    _figure("silent_d", heartbeat_interval_s=FAST["heartbeat_interval_s"], peer_timeout_s=FAST["peer_timeout_s"],
            stop_to_peer_down_s=round(t_down - t_stop, 3), stop_to_forgotten_polled_s=round(detect_s, 3),
            writes_held_while_stopped=int(stuck), stopped_for_s=round(t_cont - t_stop, 3),
            held_writes_p_events=[collected["events"][r][0]["type"] for r in waiting[:3]],
            held_writes_d_events=[events["events"][r][0]["type"] for r in waiting[:3]],
            first_push_after_resume_s=round(rehandshake_s, 3))


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False], ids=["test_config", "default_config"])
def test_silent_p_fails_d_registrations(spawn, base_dir, fast):
    """SIGSTOP P's daemon: D's registrations waiting on P fail within the bound (not at
    the two-minute watchdog); after SIGCONT new pushes work."""
    extra = _config(base_dir, "fast", **FAST) if fast else ()
    timeout = FAST["peer_timeout_s"] if fast else 5.0
    P = spawn.daemon("prefill", *extra)
    D = spawn.daemon("decode", *extra)
    pw, dw = _workers(spawn, P, D)
    assert [e["type"] for e in _push(P, pw, dw, "warm", [0], [0])] == ["RecvDone", "SendDone"]
    for i in range(3):
        dw.call("recv", request_id=f"orphan{i}", block_ids=[[10 + i]], remote_engine_id=P.engine_id,
                remote_host="127.0.0.1", remote_port=P.side_port)
    _wait_until(lambda: D.live_info()["tables"]["d_pending"] == 3, 10, "D registered")
    _wait_until(lambda: P.live_info()["tables"]["p_registrations"] == 3, 10, "P got the registrations")
    t_stop = time.time()
    P.proc.send_signal(signal.SIGSTOP)
    try:
        got = dw.call("collect", request_ids=[f"orphan{i}" for i in range(3)], timeout=timeout + 10, linger=0.2)
        t_failed = max(max(a) for a in got["at"].values())
        for i in range(3):
            (event,) = got["events"][f"orphan{i}"]
            assert event["type"] == "RecvFailed" and "peer_lost" in event["reason"], event
        assert not any(D.live_info()["tables"].values())
    finally:
        P.proc.send_signal(signal.SIGCONT)
    # P resumes, sees the session gone and drops D's registrations (no WRITE for them).
    _wait_until(lambda: P.live_info()["tables"]["p_registrations"] == 0, 15, "P dropped D's registrations")
    ev = _push(P, pw, dw, "back", [3], [33])
    assert [e["type"] for e in ev] == ["RecvDone", "SendDone"], ev
    _check_exact(dw, {33: 3})
    assert P.metric("pushsvc_transfers_total", result="done") == 2
    _figure(f"silent_p[{'test' if fast else 'default'}]", peer_timeout_s=timeout,
            stop_to_recv_failed_s=round(t_failed - t_stop, 3))


# ---------------------------------------------------------------------------- same name


@pytest.mark.slow
def test_peer_returns_under_the_same_name(spawn):
    """D restarts with the same engine id and side-channel port: P drops the old
    incarnation, handshakes the new one, and nothing goes to the old agent, not even
    for a PUSH_REG sent under its name after it died."""
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    pw, dw = _workers(spawn, P, D)
    assert [e["type"] for e in _push(P, pw, dw, "warm", [1], [2])] == ["RecvDone", "SendDone"]
    old_id, port = D.info["daemon_id"], D.side_port
    (old_peer,) = P.live_info()["peers"]
    assert old_peer["daemon_id"] == old_id
    (old_agent,) = old_peer["agents"]

    D.proc.send_signal(signal.SIGKILL)
    D.proc.wait()
    dw.close()
    t_kill = time.time()
    D2 = _restart(spawn, D, "--side-channel-port", str(port))
    t_ready = time.time()
    assert D2.side_port == port and D2.info["daemon_id"] != old_id
    dw2 = spawn.worker(D2, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN, seed=5)
    before = dw2.digests()
    t0 = time.time()
    ev = _push(P, pw, dw2, "new0", [4, 5], [6, 7])
    first_push_s = time.time() - t0
    assert [e["type"] for e in ev] == ["RecvDone", "SendDone"], ev
    _check_exact(dw2, {6: 4, 7: 5})
    (peer,) = P.live_info()["peers"]
    assert peer["daemon_id"] == D2.info["daemon_id"] and peer["port"] == port
    assert old_agent not in peer["agents"] and len(peer["agents"]) == 1
    assert P.live_info()["nixl_handles"]["remote_agents"] == 1

    # A PUSH_REG under the old agent's name, arriving after the new D is up, for
    # blocks P then finishes: refused on arrival, counted, no WRITE anywhere, and P's
    # blocks stay staged for a real registration.
    done = P.metric("pushsvc_transfers_total", result="done")
    out = subprocess.run([sys.executable, str(HERE / "late_push_reg.py"), "127.0.0.1", str(P.side_port),
                          P.engine_id, old_agent, "late-req", "6", "7"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    departed = {"source": "notification", "reason": "push_reg_departed_agent"}
    _wait_until(lambda: P.metric("pushsvc_malformed_inputs_total", **departed) == 1, 10, "P refused the late PUSH_REG")
    pw.call("ready", request_id="late-req", block_ids=[[8, 9]])
    assert pw.call("wait", request_id="late-req", timeout=0.5)["event"] is None  # staged, not failed
    assert P.live_info()["tables"]["p_staged"] == 1 and P.live_info()["tables"]["p_registrations"] == 0
    pw.call("evict", request_ids=["late-req"])
    event = pw.wait("late-req")
    assert event["type"] == "SendFailed" and "cancelled" in event["reason"], event
    assert P.metric("pushsvc_transfers_total", result="done") == done
    after = dw2.digests()
    changed = [(r, b) for r in range(2 * LAYERS) for b in range(D_BLOCKS) if before[r][b] != after[r][b]]
    assert {b for _, b in changed} == {6, 7}  # only the real push's blocks changed
    _wait_until(lambda: _p_clean(P, remote_agents=1), 10, "P clean")
    _figure("same_name_return", kill_to_ready_s=round(t_ready - t_kill, 3),
            first_push_with_handshake_s=round(first_push_s, 3))
