"""Faults with real vLLM: an abort storm, 40 daemon restarts under load, D's vLLM killed
while P pushes. Each test ends with the leak check: daemon tables and gauges at 0, NIXL
handles at their steady state, vLLM's KV cache empty, file descriptors back near their
baseline.

One stack serves the module (see conftest), with a shorter lease and watchdog than the
outputs tests so that whatever only those backstops can reclaim (the prefills a killed D
will never claim) is cleaned up in seconds. The figures are printed (``-s``) as
``FIGURE`` lines.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import pytest
from helpers import (
    PD,
    PDOptions,
    Req,
    completion,
    generate,
    get_json,
    http_get,
    kv_usage,
    metric,
    open_post,
    scrape,
    tables,
    text_with_tokens,
    wait_for,
    wait_kv_usage,
    wait_tables_zero,
)
from load import Load, group_fd_kinds, kind

from pushsvc.launch import connector_config
from pushsvc.proxy.app import BACKEND_KEEPALIVE_S

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LEASE_S = 15.0  # P: staged blocks nobody claimed are freed after this
WATCHDOG_S = 10.0  # D: a registration with no push fails after this
HANG_S = 60.0  # every request through the proxy is answered within this, fault or not
READY_GOAL_S = 5.0  # the goal for a restarted daemon to be ready, its worker re-registered (a figure)
READY_BOUND_S = 30.0  # asserted: on a host shared with busy vLLM servers start-up is CPU-starved
WRITE_SETTLE_S = 10.0  # P settles its WRITEs within this once D's vLLM is gone
CLEANUP_S = LEASE_S + WATCHDOG_S + 20  # tables, gauges and KV blocks back to 0 within this
# Descriptors a process may hold more after a run than before, idle both times: vLLM's
# HTTP and ZMQ pools vary a little; a daemon's count is exact once idle, but peer links close
# a moment after the last request. A worker's KV memory alone is 8 descriptors.
DAEMON_FD_MARGIN = 2
VLLM_FD_MARGIN = 6
RESTARTS_PER_SIDE = 20
SUCCESSES_AFTER_RESTART = 2  # load requests answered in full before the next restart
CONCURRENCY = 4


@pytest.fixture(scope="module")
def pd_options() -> PDOptions:
    return PDOptions(flags={"prefill": ("--lease-s", str(LEASE_S)), "decode": ("--watchdog-s", str(WATCHDOG_S))},
                     with_refs=False)


def figure(name: str, **values: Any) -> None:
    print(f"FIGURE {name} {json.dumps(values, sort_keys=True)}")


def _rid(tag: str) -> str:
    return f"rel-{tag}-{uuid.uuid4().hex[:8]}"


def _load_requests(pd: PD, tokenizer: Any) -> list[Req]:
    """Prompts of 1 to 8 KV blocks, streamed or not, 16 tokens out."""
    reqs = []
    for i, n in enumerate((40, 130, 300, 520, 900)):
        text = text_with_tokens(tokenizer, n, seed=7000 + n)
        reqs.append(completion(f"load-{n}", pd.model, text, stream=bool(i % 2)))
    return reqs


def _info(url: str) -> dict[str, Any]:
    return get_json(url + "/v1/info")


def _inflight_writes(url: str) -> float:
    return metric(scrape(url), "pushsvc_inflight_writes") or 0.0


def _transfers(url: str, result: str = "done") -> float:
    return metric(scrape(url), "pushsvc_transfers_total", result=result) or 0.0


def _counters(pd: PD) -> dict[str, float]:
    """How requests ended on the daemons: P's pushes by result, what each side reclaimed
    on its own (P's lease, D's watchdog), failures by kind."""
    out: dict[str, float] = {}
    for side, url in pd.daemon_urls().items():
        samples = scrape(url)
        for s in samples:
            if s.name == "pushsvc_transfers_total":
                out[f"{side}.transfers.{s.labels['result']}"] = s.value
            elif s.name == "pushsvc_failures_total":
                out[f"{side}.failures.{s.labels['kind']}"] = s.value
            elif s.name in ("pushsvc_leases_expired_total", "pushsvc_watchdog_expired_total"):
                out[f"{side}.{s.name[len('pushsvc_'):-len('_total')]}"] = s.value
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}


def _daemon_ready(url: str) -> bool:
    """/readyz 200 with a worker connected and its KV memory registered."""
    try:
        status, text = http_get(url + "/readyz", timeout=2)
    except OSError:
        return False
    if status != 200:
        return False
    doc = json.loads(text)
    return doc.get("agents", 0) >= 1 and doc.get("agents_registered") == doc.get("agents")


def _steady(pd: PD) -> dict[str, Any]:
    """Everything the leak check compares, for the whole stack."""
    out: dict[str, Any] = {}
    for side, url in pd.daemon_urls().items():
        info = _info(url)
        out[f"{side}_daemon"] = {"tables": info["tables"], "nixl_handles": info["nixl_handles"],
                                 "open_fds": info["open_fds"], "inflight_writes": _inflight_writes(url)}
    for side, proc in (("prefill", pd.prefill), ("decode", pd.decode)):
        kinds = group_fd_kinds(proc.popen.pid)  # one pass over /proc: the count is their sum
        out[f"{side}_vllm"] = {"kv_usage": kv_usage(proc.url), "fds": sum(kinds.values()), "fd_kinds": dict(kinds)}
    return out


def _wait_idle(pd: PD, timeout: float = CLEANUP_S) -> dict[str, Any]:
    """Wait until nothing is held anywhere, then return the stack's state (see ``_steady``)."""
    wait_tables_zero(pd.daemon_urls(), timeout)
    for side, url in pd.daemon_urls().items():
        wait_for(f"{side} daemon's WRITEs in flight", lambda u=url: _inflight_writes(u), lambda n: n == 0, timeout)
        wait_for(f"{side} daemon's NIXL xfer handles", lambda u=url: _info(u)["nixl_handles"]["xfers"],
                 lambda n: n == 0, timeout)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, {"prefill": 0.0, "decode": 0.0}, timeout)
    # vLLM closes a finished request's sockets and the daemons their peer links a moment
    # later; the proxy keeps idle connections to each backend for its keep-alive timeout
    # (measured in CI: after a storm through 8 clients, 7 TCP connections more in P's vLLM
    # two seconds after the last request, every other kind of descriptor back to baseline).
    time.sleep(BACKEND_KEEPALIVE_S + 2.0)
    return _steady(pd)


def _assert_no_leak(before: dict[str, Any], after: dict[str, Any]) -> None:
    for side in ("prefill", "decode"):
        d0, d1 = before[f"{side}_daemon"], after[f"{side}_daemon"]
        assert not any(d1["tables"].values()), f"{side} daemon tables: {d1['tables']}"
        assert d1["inflight_writes"] == 0, f"{side} daemon WRITEs in flight: {d1['inflight_writes']}"
        assert d1["nixl_handles"]["xfers"] == 0, f"{side} daemon NIXL: {d1['nixl_handles']}"
        for k in ("registrations", "dlists", "remote_agents"):
            assert d1["nixl_handles"][k] <= d0["nixl_handles"][k], (
                f"{side} daemon NIXL {k}: {d0['nixl_handles']} -> {d1['nixl_handles']}")
        assert d1["open_fds"] <= d0["open_fds"] + DAEMON_FD_MARGIN, (
            f"{side} daemon fds {d0['open_fds']} -> {d1['open_fds']}")
        v0, v1 = before[f"{side}_vllm"], after[f"{side}_vllm"]
        assert v1["kv_usage"] == 0, f"{side} vLLM KV usage {v1['kv_usage']}"
        assert v1["fds"] <= v0["fds"] + VLLM_FD_MARGIN, (
            f"{side} vLLM fds {v0['fds']} -> {v1['fds']}: by kind {v0.get('fd_kinds')} -> {v1.get('fd_kinds')}")


def _warm(pd: PD, reqs: list[Req]) -> dict[str, Any]:
    """Every request once, then the idle state: the baseline of the leak check."""
    for req in reqs:
        out = generate(pd.proxy.url, req)
        assert out.ok, f"{req.name}: {out}\n{pd.logs()}"
    return _wait_idle(pd)


# ------------------------------------------------------------------------- abort storm

STORM_REQUESTS = 300


def _storm_one(pd: PD, req: Req, rid: str, mode: str, rng: random.Random) -> str:
    """One storm request: answered in full, or left by the client at some point."""
    if mode == "complete":
        return kind(generate(pd.proxy.url, req, request_id=rid, timeout=HANG_S))
    sock = open_post(pd.proxy.url, req, rid)
    try:
        if mode == "before-first-token":
            time.sleep(rng.uniform(0.0, 0.4))  # P's prefill, the push or D's queue
            return mode
        # mid-stream: read a few SSE events, then leave
        want, got = rng.randint(1, 8), b""
        sock.settimeout(HANG_S)
        while got.count(b"data:") < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        return mode if got.count(b"data:") >= want else "ended-before-drop"
    except OSError as exc:
        return f"drop-failed-{type(exc).__name__}"
    finally:
        sock.close()


def test_abort_storm(pd: PD, tokenizer: Any) -> None:
    """300 requests through the proxy, about two thirds left by their client before the
    first token or mid-stream, one in ten reusing an id still in flight: afterwards every
    table and gauge is 0 and both vLLMs hold no KV block; the stack still serves."""
    rng = random.Random(1234)
    reqs = _load_requests(pd, tokenizer)
    baseline = _warm(pd, reqs)
    long_stream = [completion(f"storm-{r.name}", pd.model, r.body["prompt"], stream=True, max_tokens=200)
                   for r in reqs]
    plan: list[tuple[Req, str, str]] = []
    ids: list[str] = []
    for i in range(STORM_REQUESTS):
        mode = rng.choice(("complete", "before-first-token", "mid-stream"))
        req = rng.choice(long_stream if mode == "mid-stream" else reqs)
        rid = rng.choice(ids[-8:]) if ids and rng.random() < 0.1 else _rid(f"storm{i}")
        ids.append(rid)
        plan.append((req, rid, mode))
    counted = _counters(pd)
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: _storm_one(pd, p[0], p[1], p[2], random.Random(p[1])), plan))
    storm_s = time.monotonic() - started
    outcomes = Counter(results)
    dup_ids = sum(1 for n in Counter(ids).values() if n > 1)
    print(f"storm of {STORM_REQUESTS} in {storm_s:.1f}s: {dict(outcomes)}; {dup_ids} ids used more than once")
    assert outcomes["unclean"] == 0, f"requests with no clean answer: {outcomes}\n{pd.logs()}"
    assert outcomes["before-first-token"] + outcomes["mid-stream"] >= STORM_REQUESTS // 2, outcomes

    cleanup_started = time.monotonic()
    after = _wait_idle(pd)
    figure("abort_storm", requests=STORM_REQUESTS, seconds=round(storm_s, 1), outcomes=dict(outcomes),
           reused_ids=dup_ids, cleanup_s=round(time.monotonic() - cleanup_started, 1),
           daemon_counters=_delta(counted, _counters(pd)), before=baseline, after=after)
    _assert_no_leak(baseline, after)
    for side in ("prefill", "decode"):
        assert pd.prefill.alive() and pd.decode.alive(), f"{side} vLLM died in the storm\n{pd.logs()}"
    for req in reqs:
        out = generate(pd.proxy.url, req)
        assert out.ok, f"after the storm, {req.name}: {out}\n{pd.logs()}"


# ------------------------------------------------------------------- daemon restarts


@dataclass(frozen=True)
class Restart:
    """Seconds from the signal to: the old daemon gone, the new one's ready file, the new
    one ready with its worker re-registered (/readyz)."""

    side: str
    sig: str
    exited_s: float
    started_s: float
    ready_s: float


def _restart(pd: PD, side: str, sig: signal.Signals) -> Restart:
    """Stop ``side``'s daemon with ``sig`` and start it again."""
    old = getattr(pd, f"{side}_daemon")
    signalled = time.monotonic()
    os.killpg(old.popen.pid, sig)
    old.popen.wait(30)
    exited = time.monotonic()
    pd.stack.stop(old)  # already gone: only forgets it
    new = pd.restart_daemon(side)
    started = time.monotonic()
    wait_for(f"the restarted {side} daemon, ready with its worker", lambda: _daemon_ready(new.url), bool, 60,
             interval=0.02)
    return Restart(side, sig.name, exited - signalled, started - signalled, time.monotonic() - signalled)


def test_daemon_restarts_under_load(pd: PD, tokenizer: Any) -> None:
    """Both daemons restarted 20 times each, alternating, while four clients keep requests
    flowing (kill -9 mostly, SIGTERM every fifth time): no request hangs, each gets a clean
    answer (in full, or an error status or event); the daemon is ready again, its worker
    re-registered (the goal, 5 s, is printed; asserted is 30 s, as start-up competes with
    vLLM for the CPU here); new requests, the test's and the clients', succeed after every
    restart; afterwards nothing has leaked."""
    reqs = _load_requests(pd, tokenizer)
    baseline = _warm(pd, reqs)
    probe = reqs[2]
    first = generate(pd.proxy.url, probe)
    assert first.ok, str(first)

    restarts: list[Restart] = []
    first_failures: list[str] = []  # restarts after which the first request failed
    started = time.monotonic()
    with Load(pd.proxy.url, reqs, CONCURRENCY, timeout_s=HANG_S + 30) as load:
        for i in range(RESTARTS_PER_SIDE):
            for side in ("prefill", "decode"):
                sig = signal.SIGTERM if i % 5 == 4 else signal.SIGKILL
                restarts.append(_restart(pd, side, sig))
                assert pd.prefill.alive() and pd.decode.alive(), f"a vLLM server died\n{pd.logs()}"
                # A new request succeeds (the proxy asks P's daemon for its side-channel
                # port per request, so a restarted P's new port is used at once). Known
                # gap, counted and printed: a restarted P's event loop has been seen busy
                # for ~6 s right after D's handshake on this loaded host, D took it for
                # silent (5 s) and failed the requests waiting on it; the next one succeeds.
                ready_at = time.monotonic()
                out = generate(pd.proxy.url, probe, timeout=HANG_S)
                if not out.ok:
                    first_failures.append(f"{side} #{i} {sig.name}: {out}")
                    out = generate(pd.proxy.url, probe, timeout=HANG_S)
                assert out.ok, f"after restart {i} of {side} ({sig.name}): {out}\n{pd.logs()}"
                assert out.tokens[0] == first.tokens[0], f"first token {out.tokens} != {first.tokens}"
                # ... and so do the clients' requests sent since the daemon was ready.
                wait_for(f"load requests answered in full after restart {i} of {side}",
                         lambda t=ready_at: load.outcomes(since=t)["ok"], lambda n: n >= SUCCESSES_AFTER_RESTART,
                         HANG_S)
        sent = load.stop()
    run_s = time.monotonic() - started

    outcomes = Counter(kind(s.outcome) for s in sent)
    slowest = max(s.outcome.elapsed_s for s in sent)
    ready_s = {side: [r.ready_s for r in restarts if r.side == side] for side in ("prefill", "decode")}
    summary = {side: {"median_s": round(statistics.median(v), 2), "max_s": round(max(v), 2),
                      f"under_{READY_GOAL_S:.0f}s": sum(1 for x in v if x < READY_GOAL_S)}
               for side, v in ready_s.items()}
    phases = {side: {phase: round(statistics.median(getattr(r, phase) for r in restarts if r.side == side), 2)
                     for phase in ("exited_s", "started_s", "ready_s")} for side in ("prefill", "decode")}
    print(f"{len(sent)} load requests in {run_s:.0f}s: {dict(outcomes)}, slowest answer {slowest:.1f}s")
    print(f"restart to ready: {summary}; medians by phase {phases}")
    print(f"first request after a restart failed {len(first_failures)} times: {first_failures}")
    for r in restarts:
        print(f"  {asdict(r)}")
    assert slowest < HANG_S, f"a request took {slowest:.1f}s"
    assert outcomes["unclean"] == 0, f"requests with no clean answer: {outcomes}"

    after = _wait_idle(pd)
    figure("daemon_restarts", restarts_per_side=RESTARTS_PER_SIDE, ready=summary, phase_medians=phases,
           ready_all={k: [round(x, 2) for x in v] for k, v in ready_s.items()}, load_outcomes=dict(outcomes),
           load_requests=len(sent), slowest_answer_s=round(slowest, 1), run_s=round(run_s),
           first_request_failed=len(first_failures), before=baseline, after=after)
    for side, times in ready_s.items():
        assert max(times) < READY_BOUND_S, f"{side} daemon ready in {times}"
    _assert_no_leak(baseline, after)


# --------------------------------------------------------------------- D's vLLM killed

PUSHES_BEFORE_KILL = 100


def test_d_vllm_killed_mid_stream(pd: PD, tokenizer: Any) -> None:
    """kill -9 of D's vLLM after at least 100 pushes, with pushes still flowing: P settles
    every WRITE within 10 s, frees every lease, gives back its KV blocks and keeps
    serving; D's vLLM started again serves P/D requests."""
    reqs = _load_requests(pd, tokenizer)
    baseline = _warm(pd, reqs)
    purl = pd.prefill_daemon.url
    counted = _counters(pd)
    done_before = _transfers(purl)
    with Load(pd.proxy.url, reqs, CONCURRENCY, timeout_s=HANG_S + 30) as load:
        wait_for("P daemon's completed pushes", lambda: _transfers(purl) - done_before,
                 lambda n: n >= PUSHES_BEFORE_KILL, 600, interval=0.5)
        # Kill at a moment P is writing, when one is seen within a few seconds.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _inflight_writes(purl) == 0 and tables(purl)["p_writing"] == 0:
            time.sleep(0.005)
        writing = _inflight_writes(purl), tables(purl)["p_writing"]
        killed_at = time.monotonic()
        os.killpg(pd.decode.popen.pid, signal.SIGKILL)
        pushes = _transfers(purl) - done_before
        pd.decode.popen.wait(30)
        settled = wait_for("P daemon's WRITEs and NIXL xfer handles",
                           lambda: (_inflight_writes(purl), _info(purl)["nixl_handles"]["xfers"]),
                           lambda v: v == (0, 0), WRITE_SETTLE_S, interval=0.02)
        settle_s = time.monotonic() - killed_at
        time.sleep(3.0)  # requests keep coming while D's vLLM is gone
        sent = load.stop()
    assert settled == (0, 0)
    after_kill = [s for s in sent if s.started > killed_at]
    outcomes = Counter(kind(s.outcome) for s in sent)
    slowest = max(s.outcome.elapsed_s for s in sent)
    assert slowest < HANG_S, f"a request took {slowest:.1f}s"
    assert outcomes["unclean"] == 0, f"requests with no clean answer: {outcomes}"

    # P frees every lease (the prefills D will never claim: by the lease) and its blocks.
    lease_started = time.monotonic()
    wait_tables_zero({"prefill": purl}, LEASE_S + 15)
    wait_for("P daemon's WRITEs in flight", lambda: _inflight_writes(purl), lambda n: n == 0, 1)
    wait_kv_usage({"prefill": pd.prefill.url}, {"prefill": 0.0}, LEASE_S + 15)
    leases_s = time.monotonic() - lease_started
    # P's vLLM keeps serving on its own.
    plain = generate(pd.prefill.url, reqs[0])
    assert plain.ok, f"P's vLLM alone: {plain}\n{pd.logs()}"

    # D's vLLM again, on the same port (the proxy knows it by its URL).
    old = pd.decode
    pd.stack.stop(old)
    old.log.rename(old.log.with_suffix(".killed.log"))
    port = int(old.url.rsplit(":", 1)[1])
    restarted = time.monotonic()
    pd.decode = pd.stack.vllm("vllm-d", pd.model, port=port,
                              kv_transfer_config=connector_config("kv_consumer", pd.decode_daemon), cpus="1")
    d_up_s = time.monotonic() - restarted
    for req in reqs:
        out = generate(pd.proxy.url, req, timeout=HANG_S)
        assert out.ok, f"after D's vLLM restart, {req.name}: {out}\n{pd.logs()}"
    after = _wait_idle(pd)
    counters = _delta(counted, _counters(pd))
    baseline_d = {**baseline, "decode_vllm": {**baseline["decode_vllm"], "fds": after["decode_vllm"]["fds"]}}
    figure("d_vllm_killed", pushes_before_kill=pushes, writing_at_kill=list(writing), write_settle_s=round(settle_s, 3),
           leases_freed_s=round(leases_s, 1), load_outcomes=dict(outcomes), after_kill=len(after_kill),
           slowest_answer_s=round(slowest, 1), d_vllm_restart_s=round(d_up_s, 1), daemon_counters=counters,
           before=baseline, after=after)
    _assert_no_leak(baseline_d, after)  # D's vLLM is a new process: its fds have no baseline
