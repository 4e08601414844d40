"""No block is handed back while a WRITE may still touch it: withdrawals that outlast
any timer, a worker whose connection breaks while the daemon lives on, and a daemon that
drains D's registrations before it stops.

Two in-process daemons over the fake engine (real sockets and memfd memory); the fake
engine holds WRITEs in flight for as long as a test wants (``hold_writes``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from daemon_fixtures import (
    PushPair,
    assert_tables_empty,
    expected_after_push,
    kv_regions,
    metric,
    push_pair,
    wait_until,
)
from peer_fixtures import eventually, manager, started

from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp

P_ID = "cmpl-a-0-22222222"
D_ID = "cmpl-a-0-11111111"
# D's cancel grace and P's heartbeats: short, so a test that waits several graces is quick;
# P's session stays alive throughout (heartbeats every 0.1 s).
FAST_PEER = {"peer_timeout_s": 0.5, "heartbeat_interval_s": 0.1}
# For tests where P must stay alive and no grace is waited for: a session that lives
# through a loaded host's scheduling delays (0.5 s lost it once beside a CI run).
LIVE_PEER = {"peer_timeout_s": 5.0, "heartbeat_interval_s": 0.5}


def tables(daemon) -> dict[str, int]:
    return daemon.info()["tables"]


def worker_gone(daemon) -> bool:
    return not any(a["worker_connected"] for a in daemon.info()["agents"])


async def held_write(pair: PushPair, d_ids: list[int] = [3, 4], p_ids: list[int] = [0, 1]) -> None:
    """D registered, P staged, the WRITE is posted and held in flight."""
    pair.fake.hold_writes = True
    pair.register_recv(D_ID, d_ids)
    await wait_until(lambda: tables(pair.p)["p_registrations"] == 1, "the PUSH_REG to reach P")
    pair.send_ready(P_ID, p_ids)
    await wait_until(lambda: tables(pair.p)["inflight"] == 1, "the WRITE to be posted")


# ---------------------------------------------------------------- withdrawals outlast the grace


@pytest.mark.asyncio
async def test_an_evicted_registration_waits_for_p_however_long_its_write_takes() -> None:
    async with push_pair(p_config=FAST_PEER, d_config=FAST_PEER) as pair:
        await held_write(pair)
        pair.dw.send(wp.Evict(request_ids=[D_ID]))
        # Four graces later the WRITE is still in flight and P still alive: the blocks
        # stay out of reuse (they used to be handed back when the grace ran out).
        await pair.dw.quiet_for(2.0)
        assert tables(pair.d)["d_pending"] == 1
        pair.fake.complete_held()
        await pair.pw.wait_for(wp.SendDone, P_ID)
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)  # only once the WRITE settled
        assert failed.reason == "cancelled"
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_watchdog_expiry_during_a_long_write_waits_for_p_too() -> None:
    async with push_pair(p_config=LIVE_PEER, d_config={**LIVE_PEER, "watchdog_s": 0.3}) as pair:
        await held_write(pair)
        await pair.dw.quiet_for(2.0)  # the watchdog fired long ago; P is writing
        assert tables(pair.d)["d_pending"] == 1
        pair.fake.complete_held()
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert failed.reason == "watchdog: no push within 0.3s"
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_withdrawn_registration_is_freed_at_once_when_p_confirms() -> None:
    async with push_pair(p_config=FAST_PEER, d_config=FAST_PEER) as pair:
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 1, "the PUSH_REG to reach P")
        pair.dw.send(wp.Evict(request_ids=[D_ID]))
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID, timeout=0.4)  # within the grace: P answered
        assert failed.reason == "cancelled"
        # P never writes it, even if its blocks come now.
        pair.send_ready(D_ID, [0, 1])
        await pair.pw.quiet_for(0.1)
        assert tables(pair.p)["p_staged"] == 1 and tables(pair.p)["p_writing"] == 0
        pair.pw.send(wp.Evict(request_ids=[D_ID]))
        await pair.pw.wait_for(wp.SendFailed, D_ID)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_withdrawal_naming_a_rank_p_no_longer_has_is_confirmed_at_once() -> None:
    """P's worker for the rank left and the rank was released (its agent too): nothing of
    P can write into D's blocks, and P says so instead of leaving D waiting for an answer."""
    async with push_pair() as pair:
        d, _, events = manager("decode-2", None)
        async with started(d):
            peer = await d.ensure("127.0.0.1", pair.p.service.peers.port, "prefill")
            d.send(peer, pp.CancelPush(request_id="cmpl-x-0-11111111", rank=5))
            await eventually(lambda: "push_cancelled" in events.other, "P's confirmation")


# ---------------------------------------------------------------- the worker's connection breaks


@pytest.mark.asyncio
async def test_a_reconnected_worker_hears_how_its_old_requests_ended() -> None:
    async with push_pair() as pair:
        await held_write(pair)
        # D's worker loses its connection; the daemon (and P's WRITE) live on.
        pair.dw.client.close()
        await wait_until(lambda: worker_gone(pair.d), "D to notice its worker left")
        assert tables(pair.d)["d_pending"] == 1, "held: P may still write into those blocks"
        # The same process connects again and registers the same memory, as the connector does.
        await pair.dw.connect()
        await asyncio.to_thread(pair.dw.client.register_kv, [pair.dw.buffer.fd], kv_regions(pair.dw.num_blocks))
        pair.fake.complete_held()
        ended = await pair.dw.wait_for((wp.RecvDone, wp.RecvFailed), D_ID)
        assert isinstance(ended, wp.RecvFailed) and ended.reason == "cancelled"
        await pair.pw.wait_for(wp.SendDone, P_ID)
        # The bytes landed in memory the worker still owned, nowhere else.
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4]))
        await wait_until(lambda: not pair.d.info()["retiring_agents"], "the old rank to be released")
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_reconnected_p_worker_hears_its_write_settle() -> None:
    async with push_pair() as pair:
        await held_write(pair)
        pair.pw.client.close()
        await wait_until(lambda: worker_gone(pair.p), "P to notice its worker left")
        assert tables(pair.p)["inflight"] == 1
        await pair.pw.connect()
        await asyncio.to_thread(pair.pw.client.register_kv, [pair.pw.buffer.fd], kv_regions(pair.pw.num_blocks))
        pair.fake.complete_held()
        assert isinstance(await pair.pw.wait_for((wp.SendDone, wp.SendFailed), P_ID), wp.SendDone)
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- D drains before it stops


@pytest.mark.asyncio
async def test_d_shutdown_waits_for_its_registrations_and_its_worker_hears_the_outcome() -> None:
    async with push_pair(d_config={"drain_timeout_s": 30.0}) as pair:
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 1, "the PUSH_REG to reach P")
        shutdown = asyncio.get_running_loop().create_task(pair.d.shutdown())
        try:
            await wait_until(lambda: not pair.d.workers.listening, "D's drain to start")
            await pair.dw.quiet_for(0.2)
            assert not shutdown.done(), "D must wait: P may write into the registered blocks"
            pair.send_ready(P_ID, [0, 1])
            await pair.dw.wait_for(wp.RecvDone, D_ID)  # the worker connection outlives the drain
            await asyncio.wait_for(asyncio.shield(shutdown), 5.0)
        finally:
            await shutdown
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4]))


@pytest.mark.asyncio
async def test_d_shutdown_past_its_drain_reports_what_is_left_before_closing() -> None:
    async with push_pair(d_config={"drain_timeout_s": 0.3}) as pair:
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 1, "the PUSH_REG to reach P")
        await asyncio.wait_for(pair.d.shutdown(), 5.0)
        # The agent closed first (nothing can land any more), then the worker was told.
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert failed.reason == "daemon shutting down"
        assert not any(name.startswith("decode") for name in pair.fake.agents)


@pytest.mark.asyncio
async def test_a_draining_daemon_refuses_new_work_with_a_final_event() -> None:
    async with push_pair(p_config={"drain_timeout_s": 30.0}) as pair:
        await held_write(pair)
        shutdown = asyncio.get_running_loop().create_task(pair.p.shutdown())
        try:
            await wait_until(lambda: not pair.p.workers.listening, "P's drain to start")
            pair.send_ready("cmpl-late-0-33333333", [5])
            failed = await pair.pw.wait_for(wp.SendFailed, "cmpl-late-0-33333333")
            assert failed.reason == "daemon shutting down"
            pair.fake.complete_held()
            await pair.pw.wait_for(wp.SendDone, P_ID)
            await asyncio.wait_for(asyncio.shield(shutdown), 5.0)
        finally:
            await shutdown


@pytest.mark.asyncio
@pytest.mark.parametrize(("withdrawal", "reason"), [("evict", "cancelled"),
                                                   ("watchdog", "watchdog: no push within 0.3s")])
async def test_a_push_failure_after_the_withdrawal_ends_it_for_the_withdrawals_reason(withdrawal: str,
                                                                                     reason: str) -> None:
    """D withdrew the registration (the worker evicted it, or its watchdog fired) while
    P's WRITE was in flight; P then reports the push failed (``PushFailed``): no WRITE of P
    can land any more, so D gives the blocks back now, with the withdrawal's reason as the
    worker reads it elsewhere, once, counting no new failure."""
    d_config = {**LIVE_PEER, "watchdog_s": 0.3} if withdrawal == "watchdog" else LIVE_PEER
    async with push_pair(p_config=LIVE_PEER, d_config=d_config) as pair:
        await held_write(pair)
        if withdrawal == "evict":
            pair.dw.send(wp.Evict(request_ids=[D_ID]))
        p_rank = pair.p.service.ranks.current[0]
        await wait_until(lambda: pair.p.service.sender._of(p_rank).writes[P_ID].cancelled, "P to hear the cancel")
        peer = pair.p.service.peers.find_engine(pair.d.config.engine_id)
        assert peer is not None
        pair.p.service.peers.send(peer, pp.PushFailed(request_id=D_ID, rank=0, reason="write_failed: injected"))
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert failed.reason == reason and sorted(failed.block_ids) == [3, 4]
        assert metric(pair.d, "pushsvc_failures_total", kind="push_failed_remote") == 0
        await pair.dw.quiet_for(0.3)  # exactly one final event
        pair.fake.complete_held()
