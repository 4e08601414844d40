"""Two real daemons, two real worker processes, real NIXL (UCX over loopback)."""

from __future__ import annotations

import time

import psutil
import pytest

from kvworker import pattern
from procs import tables_empty

pytestmark = pytest.mark.nixl

LAYERS = 3
P_BLOCKS = 24
D_BLOCKS = 40
BLOCK_LEN = 2048


def _pair(spawn, p_extra=(), d_extra=(), **d_opts):
    P = spawn.daemon("prefill", *p_extra)
    D = spawn.daemon("decode", *d_extra)
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN, seed=1)
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=d_opts.get("block_len", BLOCK_LEN), seed=2)
    assert pw.hello["ok"] and dw.hello["ok"], (pw.hello, dw.hello)
    return P, D, pw, dw


def _recv(dw, P, request_id, blocks):
    dw.call("recv", request_id=request_id, block_ids=[blocks], remote_engine_id=P.engine_id,
            remote_host="127.0.0.1", remote_port=P.side_port)


def _expected_d(mapping: dict[int, int], seed_p=1, seed_d=2, block_len=BLOCK_LEN):
    """Digests D must hold: P's block where mapped, D's own pattern everywhere else."""
    import hashlib

    out = []
    for r in range(2 * LAYERS):
        row = []
        for b in range(D_BLOCKS):
            data = pattern(seed_p, r, mapping[b], block_len) if b in mapping else pattern(seed_d, r, b, block_len)
            row.append(hashlib.sha1(data).hexdigest())
        out.append(row)
    return out



@pytest.mark.parametrize("order", ["registration_first", "blocks_first"])
def test_push_lands_exact_bytes(spawn, order):
    P, D, pw, dw = _pair(spawn)
    p_blocks, d_blocks = [3, 7, 8, 20, 1], [30, 2, 17, 5, 39]
    # The proxy gives both legs one id; each engine appends its own random suffix.
    rid_p, rid_d = "cmpl-7f3a-0-1a2b3c4d", "cmpl-7f3a-0-deadbeef"
    if order == "registration_first":
        _recv(dw, P, rid_d, d_blocks)
        time.sleep(0.3)
        pw.call("ready", request_id=rid_p, block_ids=[p_blocks])
    else:
        pw.call("ready", request_id=rid_p, block_ids=[p_blocks])
        time.sleep(0.3)
        _recv(dw, P, rid_d, d_blocks)
    assert dw.wait(rid_d) == {"type": "RecvDone", "request_id": rid_d}
    assert pw.wait(rid_p) == {"type": "SendDone", "request_id": rid_p}
    assert dw.digests() == _expected_d(dict(zip(d_blocks, p_blocks)))
    assert tables_empty(P, D)
    assert P.metric("pushsvc_transfers_total", result="done") == 1
    assert P.metric("pushsvc_transfer_bytes_total") == len(p_blocks) * 2 * LAYERS * BLOCK_LEN
    assert _spun(P) == _spun(D) == 0  # busy polling is off by default
    _check_timelines(P, D, rid_p, rid_d)


def _cpu_seconds(daemon) -> float:
    """The CPU time the daemon's process has used so far (user and system)."""
    times = psutil.Process(daemon.proc.pid).cpu_times()
    return times.user + times.system


def _spun(daemon) -> float:
    return daemon.metric("pushsvc_progress_spin_seconds_total")


def test_busy_polling_spins_while_a_request_waits_and_stops_once_it_is_done(spawn):
    """With ``poll_spin_s`` both daemons poll back to back from D's registration until the
    push is done (a core each), and go back to sleeping once nothing is tracked."""
    # Without the yield before each pass, so that on a loaded host the spinning loop takes its
    # share of a CPU and the CPU check below means it spun (with it, the loop gives its turn away).
    spin = ("--poll-spin-s", "30", "--poll-hot-yield", "off")
    P, D, pw, dw = _pair(spawn, spin, spin)
    p_blocks, d_blocks = [4, 9, 10], [11, 3, 35]
    rid = "cmpl-spin-0-1a2b3c4d"
    _recv(dw, P, rid, d_blocks)
    deadline = time.monotonic() + 20
    while not P.live_info()["tables"]["p_registrations"]:  # the registration reached P (its RegSent woke P)
        assert time.monotonic() < deadline, "D's registration never reached P"
        time.sleep(0.01)
    spun, cpu = (_spun(P), _spun(D)), _cpu_seconds(D)
    time.sleep(0.5)
    assert _spun(P) - spun[0] > 0.25 and _spun(D) - spun[1] > 0.25  # both spun while it waited ...
    assert _cpu_seconds(D) - cpu > 0.1  # ... and that was CPU, not a sleep counted as spinning
    pw.call("ready", request_id=rid, block_ids=[p_blocks])
    assert dw.wait(rid) == {"type": "RecvDone", "request_id": rid}
    assert pw.wait(rid) == {"type": "SendDone", "request_id": rid}
    assert dw.digests() == _expected_d(dict(zip(d_blocks, p_blocks)))
    assert tables_empty(P, D)
    spun, cpu = (_spun(P), _spun(D)), _cpu_seconds(D)
    time.sleep(0.5)
    assert (_spun(P), _spun(D)) == spun  # nothing tracked: no more spinning, though within poll_spin_s
    assert _cpu_seconds(D) - cpu < 0.1


def _check_timelines(P, D, rid_p, rid_d):
    """Each daemon kept and logged the request's path; P's names D's request, and on the
    host's one monotonic clock D's registration comes before its completion, and P's
    WRITE settles before D sees the completion."""
    import json
    from datetime import datetime

    [p_line] = json.loads(P.get(f"/v1/requests?request_id={rid_d}")[1])["timelines"]
    [d_line] = json.loads(D.get(f"/v1/requests?request_id={rid_d}")[1])["timelines"]
    assert p_line["request_id"] == rid_p and p_line["peer_request_id"] == rid_d and p_line["outcome"] == "send_done"
    assert list(p_line["events_ms"]) == ["send_ready", "matched", "write_planned", "write_posted", "write_settled", "send_done"]
    assert d_line["request_id"] == rid_d and d_line["outcome"] == "recv_done"
    # write_announced: P's WriteStarted, sent while a WRITE is still in progress at its post.
    assert [e for e in d_line["events_ms"] if e != "write_announced"] == [
        "registered", "push_reg_sent", "completion", "recv_done"]
    assert list(d_line["events_ms"].values()) == sorted(d_line["events_ms"].values())

    def at(line, event):
        return datetime.fromisoformat(line["start"]).timestamp() + line["events_ms"][event] / 1e3

    assert at(d_line, "registered") <= at(d_line, "completion")
    assert at(p_line, "write_posted") <= at(d_line, "completion") + 0.002  # wall offsets differ by microseconds
    for daemon, side, rid in ((P, "send", rid_p), (D, "recv", rid_d)):
        logged = [json.loads(line) for line in daemon.log().splitlines() if '"request_timeline"' in line]
        assert [(e["request_id"], e["side"]) for e in logged] == [(rid, side)]
        assert daemon.metric("pushsvc_phase_seconds_count", side=side, phase="total") == 1


def test_a_host_write_larger_than_a_slice_goes_in_slices_and_lands_exactly(spawn):
    """P posts a host-memory WRITE a slice per loop pass (``post_slice_mib``); over real
    NIXL the completion, which rides the last slice, reaches D once every slice landed."""
    block_len = 64 << 10
    P = spawn.daemon("prefill", "--post-slice-mib", "1", "--verify")
    D = spawn.daemon("decode", "--verify")
    pw = spawn.worker(P, "producer", layers=LAYERS, blocks=P_BLOCKS, block_len=block_len, seed=1)
    dw = spawn.worker(D, "consumer", layers=LAYERS, blocks=D_BLOCKS, block_len=block_len, seed=2)
    p_blocks, d_blocks = list(range(16)), list(range(39, 23, -1))
    _recv(dw, P, "sliced-1", d_blocks)
    time.sleep(0.3)
    pw.call("ready", request_id="sliced-1", block_ids=[p_blocks])
    assert dw.wait("sliced-1") == {"type": "RecvDone", "request_id": "sliced-1"}
    assert pw.wait("sliced-1") == {"type": "SendDone", "request_id": "sliced-1"}
    assert dw.digests() == _expected_d(dict(zip(d_blocks, p_blocks)), block_len=block_len)
    assert P.metric("pushsvc_write_parts_total") == 6  # 16 blocks x 6 regions x 64 KiB: six slices of 1 MiB
    assert D.metric("pushsvc_verify_total", result="identical") == 1
    assert tables_empty(P, D)


def test_prefix_hit_writes_only_the_tail(spawn):
    P, D, pw, dw = _pair(spawn)
    p_blocks, d_blocks = [4, 5, 6, 9], [11, 12]  # D already had the first two blocks cached
    _recv(dw, P, "req-prefix", d_blocks)
    pw.call("ready", request_id="req-prefix", block_ids=[p_blocks])
    assert dw.wait("req-prefix")["type"] == "RecvDone"
    assert pw.wait("req-prefix")["type"] == "SendDone"
    assert dw.digests() == _expected_d({11: 6, 12: 9})


def test_many_concurrent_pushes(spawn):
    P, D, pw, dw = _pair(spawn)
    mapping = {}
    for i in range(12):
        p_ids, d_ids = [i, 12 + i], [2 * i, 2 * i + 1]
        mapping.update(zip(d_ids, p_ids))
        _recv(dw, P, f"r{i}", d_ids)
        pw.call("ready", request_id=f"r{i}", block_ids=[p_ids])
    for i in range(12):
        assert dw.wait(f"r{i}")["type"] == "RecvDone"
        assert pw.wait(f"r{i}")["type"] == "SendDone"
    assert dw.digests() == _expected_d(mapping)
    assert tables_empty(P, D)


def test_p_lease_expiry_frees_state(spawn):
    P, D, pw, dw = _pair(spawn, p_extra=("--lease-s", "0.5"))
    pw.call("ready", request_id="orphan", block_ids=[[1, 2, 3]])
    event = pw.wait("orphan", timeout=10)
    assert event["type"] == "SendFailed" and "lease" in event["reason"]
    assert tables_empty(P)
    assert P.metric("pushsvc_leases_expired_total") == 1


def test_d_watchdog_fails_request(spawn):
    P, D, pw, dw = _pair(spawn, d_extra=("--watchdog-s", "0.5"))
    _recv(dw, P, "never-prefilled", [1, 2])
    event = dw.wait("never-prefilled", timeout=10)
    assert event["type"] == "RecvFailed"
    assert "watchdog" in event["reason"] and event["block_ids"] == [1, 2]
    assert tables_empty(D)
    assert D.metric("pushsvc_watchdog_expired_total") == 1


def test_p_side_failure_reaches_d_before_watchdog(spawn):
    # D's pages are twice P's: P's pre-WRITE check of D's layout fails. D's watchdog
    # is a minute away; the failure must come from P over the side channel.
    P, D, pw, dw = _pair(spawn, d_extra=("--watchdog-s", "60"), block_len=2 * BLOCK_LEN)
    _recv(dw, P, "mismatch", [1])
    pw.call("ready", request_id="mismatch", block_ids=[[2]])
    t0 = time.monotonic()
    event = dw.wait("mismatch", timeout=20)
    assert event is not None and time.monotonic() - t0 < 20
    assert event["type"] == "RecvFailed" and "layout" in event["reason"]
    p_event = pw.wait("mismatch")
    assert p_event["type"] == "SendFailed"
    assert P.metric("pushsvc_failures_total", kind="layout_mismatch") == 1
    assert tables_empty(P, D)


def test_handshake_failure_fails_registration(spawn):
    P, D, pw, dw = _pair(spawn, d_extra=("--watchdog-s", "60"))
    dw.call("recv", request_id="nowhere", block_ids=[[1]], remote_engine_id="ghost",
            remote_host="127.0.0.1", remote_port=1)
    event = dw.wait("nowhere", timeout=20)
    assert event["type"] == "RecvFailed" and "handshake" in event["reason"]
    assert tables_empty(D)


def test_duplicate_and_evicted_registrations(spawn):
    P, D, pw, dw = _pair(spawn)
    _recv(dw, P, "dup", [1])
    _recv(dw, P, "dup", [1])
    _recv(dw, P, "gone", [2])
    dw.call("evict", request_ids=["gone"])
    pw.call("ready", request_id="dup", block_ids=[[5]])
    assert dw.wait("dup")["type"] == "RecvDone"
    assert dw.wait("dup", timeout=0.5) is None  # exactly one completion
    assert D.metric("pushsvc_duplicates_total", kind="registration") == 1
    assert tables_empty(D)


def test_foreign_agent_notifications_are_counted_and_ignored(spawn):
    import json
    import subprocess
    import sys
    from pathlib import Path

    P, D, pw, dw = _pair(spawn)
    _recv(dw, P, "before", [3])  # D and P know each other now
    pw.call("ready", request_id="before", block_ids=[[4]])
    assert dw.wait("before")["type"] == "RecvDone"
    script = Path(__file__).parent / "intruder.py"
    out = subprocess.run([sys.executable, str(script), "127.0.0.1", str(P.side_port), P.engine_id],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    sent = json.loads(out.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    while P.metric("pushsvc_malformed_inputs_total", source="notification") < sent["malformed"]:
        assert time.monotonic() < deadline, P.get("/metrics")[1]
        time.sleep(0.05)
    assert P.metric("pushsvc_malformed_inputs_total", source="notification", reason="push_reg") == 5
    assert P.metric("pushsvc_malformed_inputs_total", source="notification", reason="completion") == 2
    # The well-formed PUSH_REG from an agent P never heard of waits, unverified, for an
    # announcement that never comes: P's blocks for that id are not written, and P's
    # request is not failed for it either (a real D's announcement may be on its way).
    assert P.metric("pushsvc_notifications_total", kind="push_reg_unverified") == 1
    pw.call("ready", request_id="victim-req", block_ids=[[0, 1]])
    assert pw.call("wait", request_id="victim-req", timeout=1.0)["event"] is None
    assert P.metric("pushsvc_transfers_total", result="done") == 1
    pw.call("evict", request_ids=["victim-req"])
    assert pw.wait("victim-req")["reason"] == "cancelled"
    # The daemon serves real requests as before.
    _recv(dw, P, "after", [3])
    pw.call("ready", request_id="after", block_ids=[[4]])
    assert dw.wait("after")["type"] == "RecvDone"
    assert P.get("/healthz")[0] == 200


def test_tensor_parallel_ranks_each_get_their_own_agent(spawn):
    P = spawn.daemon("prefill")
    D = spawn.daemon("decode")
    pws = [spawn.worker(P, "producer", rank=r, tp_size=2, layers=LAYERS, blocks=P_BLOCKS, block_len=BLOCK_LEN,
                        seed=10 + r) for r in range(2)]
    dws = [spawn.worker(D, "consumer", rank=r, tp_size=2, layers=LAYERS, blocks=D_BLOCKS, block_len=BLOCK_LEN,
                        seed=20 + r) for r in range(2)]
    agents = {a["rank"]: a["agent"] for a in P.live_info()["agents"]}
    assert sorted(agents) == [0, 1] and agents[0] != agents[1]
    # Every rank of D registers the same request; rank r of P pushes its own shard.
    for r in range(2):
        dws[r].call("recv", request_id="tp", block_ids=[[5, 6]], remote_engine_id=P.engine_id,
                    remote_host="127.0.0.1", remote_port=P.side_port, remote_tp_size=2)
        pws[r].call("ready", request_id="tp", block_ids=[[1, 2]])
    import hashlib

    for r in range(2):
        assert dws[r].wait("tp")["type"] == "RecvDone"
        assert pws[r].wait("tp")["type"] == "SendDone"
        digests = dws[r].digests()
        for region in range(2 * LAYERS):
            for d_block, p_block in ((5, 1), (6, 2)):
                want = hashlib.sha1(pattern(10 + r, region, p_block, BLOCK_LEN)).hexdigest()
                assert digests[region][d_block] == want
    assert P.metric("pushsvc_transfers_total", result="done") == 2
    assert tables_empty(P, D)


def test_verify_mode_with_real_nixl(spawn):
    P, D, pw, dw = _pair(spawn, p_extra=("--verify",), d_extra=("--verify",))
    mapping = {}
    for i in range(4):
        p_ids, d_ids = [2 * i, 2 * i + 1], [10 + i, 30 - i]
        mapping.update(zip(d_ids, p_ids))
        _recv(dw, P, f"v{i}", d_ids)
        pw.call("ready", request_id=f"v{i}", block_ids=[p_ids])
    for i in range(4):
        assert dw.wait(f"v{i}")["type"] == "RecvDone"
    assert dw.digests() == _expected_d(mapping)
    assert D.metric("pushsvc_verify_total", result="identical") == 4
    assert D.metric("pushsvc_verify_total", result="mismatch") == 0
    assert D.metric("pushsvc_verify_blocks_total", result="identical") == 4 * 2 * 2 * LAYERS
    assert tables_empty(P, D)
