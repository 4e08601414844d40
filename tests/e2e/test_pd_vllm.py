"""End to end: vLLM P and D with the pushsvc connector, their daemons and the proxy.

One deployment serves the whole module (see conftest). The tests run in file order: the
last two restart the daemons and kill P.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from helpers import (
    LEASE_S,
    PD,
    PREFILL_LEG_PARAMS,
    WATCHDOG_S,
    Outcome,
    Req,
    assert_pushes_identical,
    completion,
    generate,
    generate_all,
    kv_usage,
    metric,
    open_post,
    paused,
    prefix_cache_hits,
    remote_prefill_params,
    scrape,
    stream_and_drop,
    tables,
    text_with_tokens,
    verify_results,
    wait_for,
    wait_kv_usage,
    wait_tables_zero,
)
from outputs import assert_like_colocated, assert_same_as_colocated
from pushsvc.client import DaemonClient
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import PREAMBLE, encode_preamble, frame

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BLOCK = 128  # vLLM CPU's KV block size (tokens)
SETTLE_S = 15.0  # for cleanup that follows a finished request (P's push, the last engine steps)


def _rid(tag: str) -> str:
    return f"e2e-{tag}-{uuid.uuid4().hex[:8]}"


def _transfers_done(pd: PD) -> float:
    return _transfers(pd, "done")


def _transfers(pd: PD, result: str) -> float:
    return metric(scrape(pd.prefill_daemon.url), "pushsvc_transfers_total", result=result) or 0.0


def _leases_expired(pd: PD) -> float:
    return metric(scrape(pd.prefill_daemon.url), "pushsvc_leases_expired_total") or 0.0


def _watchdog_expired(pd: PD) -> float:
    return metric(scrape(pd.decode_daemon.url), "pushsvc_watchdog_expired_total") or 0.0


def _drop_when_registered(pd: PD, to_d: Req) -> None:
    """Send ``to_d`` straight to D and leave once D's daemon holds its registration."""
    sock = open_post(pd.decode.url, to_d, _rid(to_d.name))
    try:
        wait_for("decode daemon's tables", lambda: tables(pd.decode_daemon.url), lambda t: t["d_pending"] > 0, 10,
                 interval=0.05)
    finally:
        sock.close()


def _proxy_client_gone(pd: PD) -> float:
    return metric(scrape(pd.proxy.url), "pushsvc_proxy_requests_total", status="499") or 0.0


def _assert_same_as_colocated(pd: PD, name: str, got: Outcome) -> None:
    assert_same_as_colocated(got, pd.refs[name], name, pd.logs)


def _verified(pd: PD) -> dict[str, float]:
    return (verify_results(pd.decode_daemon.url) or {}) if pd.verify else {}


def _assert_verified(pd: PD, before: dict[str, float], pushes: int) -> None:
    """In verify mode, D's daemon found the last ``pushes`` pushes byte-identical to P's blocks."""
    if pd.verify:
        assert_pushes_identical(pd.decode_daemon.url, before, pushes, SETTLE_S)


def _idle_kv(pd: PD) -> dict[str, float]:
    return {"prefill": kv_usage(pd.prefill.url), "decode": kv_usage(pd.decode.url)}


def test_outputs_match_colocated(pd: PD) -> None:
    """Greedy outputs through the proxy equal a colocated vLLM's, for prompts of 5 to 1500
    tokens (each side of the 128-token block), completions and chat, streamed or not."""
    reqs = pd.requests.outputs
    assert len(reqs) >= 24
    verified_before = _verified(pd)
    done_before = _transfers_done(pd)

    got = generate_all(pd.proxy.url, reqs, concurrency=8)

    assert_like_colocated(got, pd.refs, reqs, "the proxy", pd.logs)

    # Every request's KV went P -> D through the daemons, and nothing is left behind.
    wait_for("P daemon's completed pushes", lambda: _transfers_done(pd) - done_before,
             lambda n: n >= len(reqs), SETTLE_S)
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, {"prefill": 0.0, "decode": 0.0}, SETTLE_S)
    _assert_verified(pd, verified_before, len(reqs))


def test_prefix_cache_hit_on_d(pd: PD) -> None:
    """D's prefix cache serves the repeated and the shared prefix; only the rest is pushed."""
    hits_before = prefix_cache_hits(pd.decode.url)
    done_before = _transfers_done(pd)
    verified_before = _verified(pd)
    for req in pd.requests.prefix:  # in order: the 2nd and 3rd find the 1st's blocks cached on D
        _assert_same_as_colocated(pd, req.name, generate(pd.proxy.url, req))

    # Full blocks only; D always recomputes at least the prompt's last token.
    expected = BLOCK * ((pd.requests.long_prompt_tokens - 1) // BLOCK) + BLOCK * (
        pd.requests.shared_prefix_tokens // BLOCK)
    hits = wait_for("D's prefix cache hits (tokens)", lambda: prefix_cache_hits(pd.decode.url) - hits_before,
                    lambda n: n >= expected, SETTLE_S)
    assert hits >= expected
    # The requests with a prefix hit still had their tails pushed from P.
    wait_for("P daemon's completed pushes", lambda: _transfers_done(pd) - done_before,
             lambda n: n >= len(pd.requests.prefix), SETTLE_S)
    _assert_verified(pd, verified_before, len(pd.requests.prefix))
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, {"prefill": 0.0, "decode": 0.0}, SETTLE_S)


def _refused(pd: PD, reason: str) -> float:
    return metric(scrape(pd.decode.url), "vllm:pushsvc_connector_refused_requests_total", reason=reason) or 0.0


def test_params_d_cannot_use_fall_back_to_a_local_prefill(pd: PD) -> None:
    """D prefills locally, promptly, and counts it on its /metrics, when a direct request
    carries only ``do_remote_prefill`` (this raised inside vLLM's scheduler and killed D's
    engine) or an id longer than the worker protocol carries (this waited for the backstop)."""
    reasons = ("bad_kv_transfer_params", "request_id_too_long")
    before = {reason: _refused(pd, reason) for reason in reasons}
    req = pd.req("later-30")
    bare = generate(pd.decode.url, req.with_body(kv_transfer_params={"do_remote_prefill": True}))
    _assert_same_as_colocated(pd, req.name, bare)
    long_id = generate(pd.decode.url, req.with_body(kv_transfer_params=remote_prefill_params(pd.prefill_daemon.info)),
                       request_id=_rid("long") + "-" + "x" * 300)
    _assert_same_as_colocated(pd, req.name, long_id)
    assert long_id.elapsed_s < WATCHDOG_S, str(long_id)
    wait_for("D's refused-request counters", lambda: {r: _refused(pd, r) - before[r] for r in reasons},
             lambda got: got == {r: 1.0 for r in reasons}, SETTLE_S)
    # D is still up and serves P/D requests; nothing was registered anywhere.
    _assert_same_as_colocated(pd, "later-300", generate(pd.proxy.url, pd.req("later-300")))
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)


def test_both_legs_carry_ps_transfer_id(pd: PD) -> None:
    """P keeps the transfer_id it is given, or mints one, and returns it; D, sent P's
    params as a router forwards them, receives the push under it."""
    done_before = _transfers_done(pd)
    for name, given in (("later-300", {"transfer_id": f"xchg-{uuid.uuid4().hex[:12]}"}), ("later-30", {})):
        rid = _rid(f"xchg-{name}")
        req = pd.req(name)
        p_out = generate(pd.prefill.url, req.with_body(max_tokens=1, kv_transfer_params={**PREFILL_LEG_PARAMS,
                                                                                          **given}),
                         request_id=rid)
        assert p_out.ok, str(p_out)
        returned = p_out.body["kv_transfer_params"]
        if given:
            assert returned["transfer_id"] == given["transfer_id"]
        else:
            assert len(returned["transfer_id"]) == 32, returned
        assert returned["remote_port"] == pd.prefill_daemon.info["side_channel_port"]
        _assert_same_as_colocated(pd, name, generate(pd.decode.url, req.with_body(kv_transfer_params=returned),
                                                     request_id=rid))
    wait_for("P daemon's completed pushes", lambda: _transfers_done(pd) - done_before, lambda n: n >= 2, SETTLE_S)
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)


def test_client_disconnect_mid_stream_and_abort_before_scheduling(pd: PD, tokenizer: Any) -> None:
    """Clients that leave at three points: nothing leaks, and P's blocks held for a D request
    that was never scheduled go at once (D's empty registration), not at P's lease."""
    idle = _idle_kv(pd)
    leases_before = _leases_expired(pd)
    released_before = _transfers(pd, "released")

    # 1. The client of a long stream leaves after the first chunk: D aborts a running request.
    stream = completion("drop-stream", pd.model, text_with_tokens(tokenizer, 600, seed=5002), stream=True,
                        max_tokens=2000)
    first = stream_and_drop(pd.proxy.url, stream, _rid("drop-stream"))
    assert first.startswith(b"HTTP/1.1 200") and b"data:" in first, first[:500]

    # 2. D aborts a request waiting for its KV: sent straight to D, so P never computes it;
    #    dropped once D's daemon holds the registration.
    to_d = completion("drop-d", pd.model, text_with_tokens(tokenizer, 1000, seed=5001)).with_body(
        kv_transfer_params=remote_prefill_params(pd.prefill_daemon.info))
    _drop_when_registered(pd, to_d)

    # 3. D aborts a request it never scheduled: with D's scheduler frozen, P computes the
    #    prompt and keeps its blocks for D, the client leaves, D drops the queued request.
    dropped = completion("drop-queued", pd.model, text_with_tokens(tokenizer, 1200, seed=5003))
    gone_before = _proxy_client_gone(pd)
    done_before = _transfers_done(pd)
    with paused(pd.decode.url):
        sock = open_post(pd.proxy.url, dropped, _rid("drop-queued"))
        try:
            wait_for("prefill daemon's tables", lambda: tables(pd.prefill_daemon.url), lambda t: t["p_staged"] > 0,
                     30, interval=0.05)
            staged_at = time.monotonic()
        finally:
            sock.close()
        # The proxy sees the client leave and closes D's leg; D's API server then aborts
        # the queued request (give it a moment: after the resume it would be too late).
        wait_for("proxy's count of clients that left", lambda: _proxy_client_gone(pd) - gone_before,
                 lambda n: n >= 1, 10, interval=0.05)
        time.sleep(1.0)
    wait_for("prefill daemon's staged blocks", lambda: tables(pd.prefill_daemon.url)["p_staged"],
             lambda n: n == 0, LEASE_S + 15)
    assert time.monotonic() - staged_at < LEASE_S, "P kept the blocks until its lease"
    assert _transfers(pd, "released") - released_before == 1, "P's blocks were not released by D"
    assert _transfers_done(pd) == done_before, "P wrote KV for a request D never scheduled"

    # Within P's lease everything is released: the daemons' tables and vLLM's blocks.
    wait_tables_zero(pd.daemon_urls(), LEASE_S + 15)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, idle, LEASE_S + 15)
    assert _leases_expired(pd) == leases_before
    # ... and the stack still serves, with colocated outputs.
    _assert_same_as_colocated(pd, "later-30", generate(pd.proxy.url, pd.req("later-30")))


def test_client_gone_leaves_no_stale_registration(pd: PD, tokenizer: Any) -> None:
    """A D request dropped while it waits for KV is withdrawn on both daemons at once;
    nothing is left for the watchdog."""
    expired_before = _watchdog_expired(pd)
    to_d = completion("gone-d", pd.model, text_with_tokens(tokenizer, 500, seed=6002)).with_body(
        kv_transfer_params=remote_prefill_params(pd.prefill_daemon.info))
    _drop_when_registered(pd, to_d)
    try:
        wait_tables_zero(pd.daemon_urls(), WATCHDOG_S / 2)
        time.sleep(1.0)
        wait_tables_zero(pd.daemon_urls(), 1)  # nothing registered after the withdrawal either
    finally:
        wait_tables_zero(pd.daemon_urls(), WATCHDOG_S + 15)  # whatever happened, leave a clean stack
    assert _watchdog_expired(pd) == expired_before, "the watchdog had to clean up after a client left"


def test_d_rejection_releases_p_at_once(pd: PD, tokenizer: Any) -> None:
    """D's serving layer refuses a request P already computed (min_tokens > max_tokens: the
    proxy drops min_tokens from P's leg only): P's blocks are released at once, not at the lease.
    The legs go one after the other, as a front that forwards P's returned kv_transfer_params
    to D does: D's leg carries the match key P minted."""
    idle = _idle_kv(pd)
    rid = _rid("rejected")
    req = completion("rejected", pd.model, text_with_tokens(tokenizer, 500, seed=6003))
    p_out = generate(pd.prefill.url, req.with_body(max_tokens=1, kv_transfer_params=dict(PREFILL_LEG_PARAMS)),
                     request_id=rid)
    assert p_out.ok, str(p_out)
    returned = p_out.body["kv_transfer_params"]
    assert returned["transfer_id"], returned  # P minted the exchange's key
    wait_for("prefill daemon's tables", lambda: tables(pd.prefill_daemon.url), lambda t: t["p_staged"] > 0, 10,
             interval=0.05)
    d_leg = req.with_body(min_tokens=100, kv_transfer_params={
        **remote_prefill_params(pd.prefill_daemon.info), "transfer_id": returned["transfer_id"]})
    d_out = generate(pd.decode.url, d_leg, request_id=rid)
    assert d_out.status == 400, str(d_out)
    try:
        wait_for("prefill daemon's staged blocks", lambda: tables(pd.prefill_daemon.url)["p_staged"],
                 lambda n: n == 0, LEASE_S / 3)
    finally:  # whatever happened, leave a clean stack
        wait_tables_zero(pd.daemon_urls(), LEASE_S + WATCHDOG_S)
        wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, idle, LEASE_S + 15)


def test_worker_gone_before_welcome_does_not_hold_its_rank(pd: PD) -> None:
    """A worker that leaves between its hello and the daemon's welcome (its connect timed out
    while the daemon was busy, e.g. importing NIXL for its first agent after a restart) can
    connect again: the daemon does not keep its rank bound to the dead connection."""
    daemon = pd.stack.daemon("scratch")  # a daemon of its own: the test takes rank 0
    # A generous timeout: the daemon imports NIXL for its first agent, which takes seconds.
    client = DaemonClient(daemon.info["socket_path"], engine_id="", rank=0, tp_size=1, role="producer",
                          timeout_s=60)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(daemon.info["socket_path"])
            sock.sendall(encode_preamble(wp.MAGIC, wp.MAJOR, wp.MINOR))
            got = b""
            while len(got) < PREAMBLE.size:  # admitted: the daemon's preamble came back
                got += sock.recv(PREAMBLE.size - len(got))
            os.kill(daemon.popen.pid, signal.SIGSTOP)  # the daemon is busy ...
            try:
                hello = wp.Hello(engine_id="", rank=0, tp_size=1, role="producer", pid=os.getpid())
                sock.sendall(frame(wp.encode(hello)))
            finally:
                sock.close()  # ... and the worker gives up before it answers
                os.kill(daemon.popen.pid, signal.SIGCONT)
        time.sleep(0.5)
        client.connect()  # the worker's next attempt
    finally:
        client.close()
        pd.stack.stop(daemon)


def test_daemon_restart_while_vllm_runs(pd: PD) -> None:
    """Daemons killed mid-transfer: the request fails at once; restarted, they serve again."""
    idle = _idle_kv(pd)
    # In flight on D: a request waiting for KV (from a P that never computes it).
    to_d = pd.req("later-900").with_body(kv_transfer_params=remote_prefill_params(pd.prefill_daemon.info))
    # Held on P: a prefill whose decoder never registers (P keeps its blocks under the lease).
    to_p = pd.req("later-300").with_body(max_tokens=1, kv_transfer_params=dict(PREFILL_LEG_PARAMS))
    with ThreadPoolExecutor(2) as pool:
        d_future = pool.submit(generate, pd.decode.url, to_d, timeout=WATCHDOG_S + 30)
        wait_for("decode daemon's tables", lambda: tables(pd.decode_daemon.url), lambda t: any(t.values()), 10,
                 interval=0.05)
        p_out = generate(pd.prefill.url, to_p)
        assert p_out.ok, str(p_out)
        wait_for("prefill daemon's tables", lambda: tables(pd.prefill_daemon.url), lambda t: any(t.values()), 10,
                 interval=0.05)

        killed_at = time.monotonic()
        for daemon in (pd.decode_daemon, pd.prefill_daemon):
            os.killpg(daemon.popen.pid, signal.SIGKILL)
            daemon.popen.wait(10)
        d_out = d_future.result()

    # The in-flight request fails cleanly, well before D's watchdog would have fired.
    assert 500 <= d_out.status < 600 and d_out.error, str(d_out)
    assert d_out.elapsed_s < WATCHDOG_S + 5, str(d_out)
    assert time.monotonic() - killed_at < WATCHDOG_S, f"D answered {time.monotonic() - killed_at:.1f}s after the kill"
    # Both servers give back the blocks the daemons were moving.
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, idle, SETTLE_S)

    # Same runtime dirs, so the same socket paths; the connectors reconnect at most once a second.
    pd.restart_daemon("prefill")
    pd.restart_daemon("decode")
    time.sleep(2.5)

    # P's daemon has a new side-channel port: the proxy may use the old one once.
    done_before = _transfers_done(pd)
    names = ("later-30", "later-300", "later-900", "later-30")
    outcomes = [generate(pd.proxy.url, pd.req(name)) for name in names]
    failures = [i for i, o in enumerate(outcomes) if not o.ok]
    assert failures in ([], [0]), f"after the restart: {[str(o) for o in outcomes]}\n{pd.logs()}"
    for name, out in zip(names, outcomes):
        if out.ok:
            _assert_same_as_colocated(pd, name, out)
    successes = len(names) - len(failures)
    wait_for("the new P daemon's completed pushes", lambda: _transfers_done(pd) - done_before,
             lambda n: n >= successes, SETTLE_S)
    # A failed first request leaves P's blocks to the new lease.
    wait_tables_zero(pd.daemon_urls(), LEASE_S + 10)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, idle, LEASE_S + 10)


def test_p_killed_d_fails_at_watchdog(pd: PD) -> None:
    """P gone: D fails a request that waits for P's KV by its watchdog, and keeps serving."""
    idle_d = kv_usage(pd.decode.url)
    os.killpg(pd.prefill.popen.pid, signal.SIGKILL)
    pd.prefill.popen.wait(30)

    # Straight to D, KV promised by P's daemon: nobody pushes it. D fails it by the watchdog.
    to_d = pd.req("later-300").with_body(kv_transfer_params=remote_prefill_params(pd.prefill_daemon.info))
    out = generate(pd.decode.url, to_d, timeout=WATCHDOG_S + 40)
    assert 500 <= out.status < 600 and out.error, str(out)
    assert out.elapsed_s < WATCHDOG_S + 10, str(out)

    # Through the proxy: P is gone, so the client hears so at once.
    via_proxy = generate(pd.proxy.url, pd.req("later-30"), timeout=WATCHDOG_S + 40)
    assert 500 <= via_proxy.status < 600 and via_proxy.error, str(via_proxy)
    assert via_proxy.elapsed_s < WATCHDOG_S + 10, str(via_proxy)

    # D keeps serving on its own.
    plain = pd.req("later-900")
    _assert_same_as_colocated(pd, plain.name, generate(pd.decode.url, plain))
    # Nothing is left on D (the failed requests' releases are not tracked).
    wait_tables_zero({"decode": pd.decode_daemon.url}, WATCHDOG_S + 10)
    wait_kv_usage({"decode": pd.decode.url}, {"decode": idle_d}, SETTLE_S)
