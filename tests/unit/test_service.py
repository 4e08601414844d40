"""P/D push through two in-process daemons over the fake engine.

Real worker sockets, side channel and memfd memory; only NIXL is replaced. Every
scenario ends with both daemons' tables back at zero.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest
from daemon_fixtures import (
    REGIONS,
    WAIT_S,
    PushPair,
    assert_tables_empty,
    expected_after_push,
    free_tcp_port,
    metric,
    push_pair,
    wait_until,
)

from pushsvc.protocol import worker as wp

P_ID = "cmpl-a-0-22222222"  # P's id for the request
D_ID = "cmpl-a-0-11111111"  # D's id for the same request: same base, other suffix


def tables(pair: PushPair, side: str) -> dict[str, int]:
    return (pair.p if side == "p" else pair.d).info()["tables"]


async def registered_at_p(pair: PushPair, count: int = 1) -> None:
    await wait_until(lambda: tables(pair, "p")["p_registrations"] == count, "the PUSH_REG to reach P")


async def push_ok(pair: PushPair, p_id: str, p_ids: list[int], d_id: str, d_ids: list[int]) -> None:
    await pair.pw.wait_for(wp.SendDone, p_id)
    await pair.dw.wait_for(wp.RecvDone, d_id)
    assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, p_ids, d_ids))
    assert np.array_equal(pair.pw.snapshot(), pair.pw.initial), "P's own KV must not change"


# ---------------------------------------------------------------- happy paths


@pytest.mark.asyncio
@pytest.mark.parametrize("order", ["registration_first", "blocks_first"])
async def test_push_lands_at_mapped_blocks_only(order: str) -> None:
    async with push_pair() as pair:
        p_ids, d_ids = [1, 2, 5], [3, 9, 14]
        if order == "registration_first":
            pair.register_recv(D_ID, d_ids)
            await registered_at_p(pair)
            await pair.dw.quiet_for(0.05)
            pair.send_ready(P_ID, p_ids)
        else:
            pair.send_ready(P_ID, p_ids)
            await wait_until(lambda: tables(pair, "p")["p_staged"] == 1, "P to stage its blocks")
            await pair.pw.quiet_for(0.05)
            pair.register_recv(D_ID, d_ids)
        await push_ok(pair, P_ID, p_ids, D_ID, d_ids)
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == 1
        assert metric(pair.p, "pushsvc_transfer_bytes_total") == 2 * 3 * pair.pw.block_len
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_prefix_hit_on_d_writes_p_tail() -> None:
    """D already holds the prefix: it asks for fewer blocks and gets P's last ones."""
    async with push_pair() as pair:
        p_ids, d_ids = [0, 1, 2, 3], [10, 11]
        pair.register_recv(D_ID, d_ids)
        pair.send_ready(P_ID, p_ids)
        await push_ok(pair, P_ID, p_ids, D_ID, d_ids)
        d = pair.dw.snapshot()
        assert np.array_equal(pair.dw.block(d, 0, 10), pair.pw.block(pair.pw.initial, 0, 2))
        assert np.array_equal(pair.dw.block(d, 1, 11), pair.pw.block(pair.pw.initial, 1, 3))
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_exact_id_match_and_base_id_match_are_independent() -> None:
    """Two requests in flight at once: one with identical ids, one matched by base id."""
    async with push_pair() as pair:
        pair.register_recv("cmpl-b-0-aaaaaaaa", [0, 1])
        pair.register_recv(D_ID, [4, 5])
        await registered_at_p(pair, 2)
        pair.send_ready(P_ID, [6, 7])
        pair.send_ready("cmpl-b-0-aaaaaaaa", [2, 3])
        await pair.dw.wait_for(wp.RecvDone, D_ID)
        await pair.dw.wait_for(wp.RecvDone, "cmpl-b-0-aaaaaaaa")
        await pair.pw.wait_for(wp.SendDone, P_ID)
        await pair.pw.wait_for(wp.SendDone, "cmpl-b-0-aaaaaaaa")
        expected = expected_after_push(pair.pw, pair.dw, [6, 7], [4, 5])
        pair.dw.initial = expected
        expected = expected_after_push(pair.pw, pair.dw, [2, 3], [0, 1])
        assert np.array_equal(pair.dw.snapshot(), expected)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_duplicate_registration_from_worker_is_ignored() -> None:
    async with push_pair() as pair:
        pair.register_recv(D_ID, [3, 4])
        pair.register_recv(D_ID, [3, 4])
        await wait_until(lambda: metric(pair.d, "pushsvc_duplicates_total", kind="registration") == 1,
                         "the duplicate to be counted")
        await registered_at_p(pair)
        pair.send_ready(P_ID, [0, 1])
        await push_ok(pair, P_ID, [0, 1], D_ID, [3, 4])
        await pair.dw.quiet_for(0.1)  # exactly one RecvDone, no failure for the duplicate
        assert metric(pair.d, "pushsvc_duplicates_total", kind="registration") == 1
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- rejected input


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("block_ids", "words"),
    [([3, 16], "outside"), ([2, 2], "twice")],
    ids=["out_of_range", "duplicated"],
)
async def test_bad_block_ids_in_d_registration_fail_at_once(block_ids: list[int], words: str) -> None:
    async with push_pair(d_blocks=16) as pair:
        pair.register_recv(D_ID, block_ids)
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert words in failed.reason
        assert failed.block_ids == block_ids
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="worker", reason="registration") == 1
        assert metric(pair.d, "pushsvc_handshakes_total", result="dialed") == 0, "nothing reached P"
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_registration_naming_another_p_tp_size_fails_at_once_saying_so() -> None:
    """P TP 2 -> D TP 1 splits D's blocks by KV head: a D worker whose regions do not say
    they are head-major cannot take it. D refuses the registration before anything
    reaches P, with a reason that names both sizes (the support matrix in connector.md)."""
    async with push_pair() as pair:
        pair.register_recv(D_ID, [3, 4], remote_tp_size=2)
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert "P TP 2 -> D TP 1" in failed.reason and "not head-major" in failed.reason
        assert metric(pair.d, "pushsvc_handshakes_total", result="dialed") == 0, "nothing reached P"
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("block_ids", "words"),
    [([0, 8], "outside"), ([1, 1], "twice")],
    ids=["out_of_range", "duplicated"],
)
async def test_invalid_p_blocks_fail_the_send(block_ids: list[int], words: str) -> None:
    async with push_pair(p_blocks=8) as pair:
        pair.send_ready(P_ID, block_ids)
        failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert words in failed.reason
        assert metric(pair.p, "pushsvc_malformed_inputs_total", source="worker", reason="finished_blocks") == 1
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- timers


@pytest.mark.asyncio
async def test_p_lease_expires_without_registration() -> None:
    async with push_pair(p_config={"lease_s": 0.2}) as pair:
        pair.send_ready(P_ID, [0, 1])
        failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert "lease" in failed.reason
        assert metric(pair.p, "pushsvc_leases_expired_total") == 1
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_d_watchdog_fails_an_unserved_registration() -> None:
    # P's registration TTL stays long: D's watchdog itself must withdraw it from P.
    async with push_pair(d_config={"watchdog_s": 0.5}) as pair:
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert "watchdog" in failed.reason
        assert failed.block_ids == [3, 4]
        assert metric(pair.d, "pushsvc_watchdog_expired_total") == 1
        await pair.dw.quiet_for(0.1)
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- failures reported promptly to D


@pytest.mark.asyncio
async def test_write_submission_failure_fails_both_sides_promptly() -> None:
    async with push_pair() as pair:  # D's watchdog is LONG_S: only PushFailed can explain a quick failure
        pair.fake.fail_next_write = 1
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        pair.send_ready(P_ID, [0, 1])
        p_failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        d_failed = await pair.dw.wait_for(wp.RecvFailed, D_ID, timeout=WAIT_S)
        assert "write_submit_failed" in p_failed.reason
        assert "write_submit_failed" in d_failed.reason
        assert d_failed.block_ids == [3, 4]
        assert metric(pair.d, "pushsvc_watchdog_expired_total") == 0
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_incompatible_layouts_fail_d_promptly() -> None:
    async with push_pair(p_block_len=64, d_block_len=128) as pair:
        pair.register_recv(D_ID, [3, 4])
        pair.send_ready(P_ID, [0, 1])
        d_failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        p_failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert "layout" in d_failed.reason and "block length" in d_failed.reason
        assert "layout" in p_failed.reason
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_handshake_failure_fails_the_registration() -> None:
    async with push_pair() as pair:
        pair.register_recv(D_ID, [3, 4], remote_port=free_tcp_port())
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert "handshake" in failed.reason
        assert metric(pair.d, "pushsvc_handshakes_total", result="failed") == 1
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- evict
#
# Every request ends in exactly one final event; for an evicted one it says "cancelled"
# and comes once its blocks are safe to reuse (P can no longer write into them).


@pytest.mark.asyncio
async def test_evict_of_a_registration_still_handshaking() -> None:
    """P never saw the registration: it is cancelled at once, and the handshake that
    fails later produces no second event."""
    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # accepts (backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        async with push_pair(d_config={"handshake_timeout_s": 1.0}) as pair:
            pair.register_recv(D_ID, [3, 4], remote_port=silent.getsockname()[1])
            await wait_until(lambda: tables(pair, "d")["d_pending"] == 1, "D to track the registration")
            pair.dw.send(wp.Evict(request_ids=[D_ID]))
            failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
            assert failed.reason == "cancelled" and failed.block_ids == [3, 4]
            await wait_until(lambda: metric(pair.d, "pushsvc_handshakes_total", result="failed") == 1,
                             "the handshake to time out")
            await pair.dw.quiet_for(0.1)
            await assert_tables_empty(pair.p, pair.d)
    finally:
        silent.close()


@pytest.mark.asyncio
async def test_evict_of_staged_p_blocks() -> None:
    async with push_pair() as pair:
        pair.send_ready(P_ID, [0, 1])
        await wait_until(lambda: tables(pair, "p")["p_staged"] == 1, "P to stage its blocks")
        pair.pw.send(wp.Evict(request_ids=[P_ID]))
        failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert failed.reason == "cancelled"
        await assert_tables_empty(pair.p, pair.d)
        await pair.pw.quiet_for(0.1)


@pytest.mark.asyncio
async def test_evict_of_unknown_request_is_harmless() -> None:
    async with push_pair() as pair:
        pair.dw.send(wp.Evict(request_ids=["cmpl-nobody-0-00000000"]))
        pair.pw.send(wp.Evict(request_ids=["cmpl-nobody-0-00000000"]))
        await pair.dw.ping(1)
        await pair.pw.ping(2)
        assert pair.dw.events == [] and pair.pw.events == []
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_evicted_registration_is_never_written() -> None:
    """D withdraws a registration P already holds: once D says "cancelled", P's later
    prefill of the same request must not write into D's (now free) blocks."""
    async with push_pair(p_config={"lease_s": 0.3}) as pair:
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        pair.dw.send(wp.Evict(request_ids=[D_ID]))
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert failed.reason == "cancelled"
        assert tables(pair, "p")["p_registrations"] == 0
        # D's worker has now freed blocks 3 and 4; P's prefill finishes afterwards.
        pair.send_ready(P_ID, [0, 1])
        p_failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert "lease" in p_failed.reason, "nothing left to match: the lease runs out"
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial), "P wrote into evicted D blocks"
        await pair.dw.quiet_for(0.1)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_evict_during_a_write_waits_for_it_to_settle() -> None:
    """D evicts while P's WRITE into its blocks is in flight: D keeps the blocks (no
    final event) until the WRITE has settled, then reports "cancelled"."""
    async with push_pair() as pair:
        pair.fake.hold_writes = True
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        pair.send_ready(P_ID, [0, 1])
        await wait_until(lambda: tables(pair, "p")["inflight"] == 1, "the WRITE to be posted")
        pair.dw.send(wp.Evict(request_ids=[D_ID]))
        await pair.dw.quiet_for(0.3)  # the blocks are not free yet: P may still be writing
        assert tables(pair, "d")["d_pending"] == 1
        pair.fake.complete_held()
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert failed.reason == "cancelled"
        await pair.pw.wait_for(wp.SendDone, P_ID)
        await pair.dw.quiet_for(0.1)
        await pair.pw.quiet_for(0.1)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_watchdog_expired_registration_is_never_written() -> None:
    """Regression: D's watchdog once failed a SENT registration without telling P, which
    kept it for registration_ttl_s and later wrote into blocks D's worker had freed."""
    async with push_pair(d_config={"watchdog_s": 0.5}, p_config={"lease_s": 0.3}) as pair:
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert "watchdog" in failed.reason
        # D's worker has now freed blocks 3 and 4; P's prefill finishes afterwards.
        pair.send_ready(P_ID, [0, 1])
        p_failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        assert "lease" in p_failed.reason, "nothing left to match: the lease runs out"
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial), "P wrote into D blocks after D's watchdog"
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- WRITEs in flight


@pytest.mark.asyncio
async def test_held_write_outlives_the_lease_and_settles_done() -> None:
    async with push_pair(p_config={"lease_s": 0.2}) as pair:
        pair.fake.hold_writes = True
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        pair.send_ready(P_ID, [0, 1])
        await wait_until(lambda: tables(pair, "p")["inflight"] == 1, "the WRITE to be posted")
        await pair.pw.quiet_for(0.5)  # well past the 0.2 s lease: a posted WRITE is not reaped
        assert tables(pair, "p")["inflight"] == 1
        assert metric(pair.p, "pushsvc_leases_expired_total") == 0
        pair.fake.complete_held()
        await push_ok(pair, P_ID, [0, 1], D_ID, [3, 4])
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_held_write_that_errors_fails_both_sides() -> None:
    async with push_pair(p_config={"lease_s": 0.2}) as pair:
        pair.fake.hold_writes = True
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        pair.send_ready(P_ID, [0, 1])
        await wait_until(lambda: tables(pair, "p")["inflight"] == 1, "the WRITE to be posted")
        await pair.pw.quiet_for(0.3)
        pair.fake.complete_held(error=True)
        p_failed = await pair.pw.wait_for(wp.SendFailed, P_ID)
        d_failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert "write_failed" in p_failed.reason
        assert "write_failed" in d_failed.reason
        assert metric(pair.d, "pushsvc_watchdog_expired_total") == 0
        await assert_tables_empty(pair.p, pair.d)


# ---------------------------------------------------------------- peers and hostile input


@pytest.mark.asyncio
async def test_peer_shutdown_fails_sent_registrations() -> None:
    async with push_pair() as pair:
        pair.register_recv(D_ID, [3, 4])
        await registered_at_p(pair)
        await pair.p.shutdown()
        # P says so before it leaves: nothing was posted, so D's blocks are free at once.
        failed = await pair.dw.wait_for(wp.RecvFailed, D_ID)
        assert "P daemon shutting down" in failed.reason
        assert failed.block_ids == [3, 4]
        assert metric(pair.d, "pushsvc_watchdog_expired_total") == 0
        await assert_tables_empty(pair.p, pair.d)
        assert pair.d.info()["peers"] == []


@pytest.mark.asyncio
async def test_malformed_push_reg_is_counted_and_daemon_keeps_serving() -> None:
    async with push_pair() as pair:
        agent = pair.fake.agents[pair.p_agent]
        agent.inbox[pair.d_agent].append(b"PUSH_REG:garbage")
        await wait_until(
            lambda: metric(pair.p, "pushsvc_malformed_inputs_total", source="notification", reason="push_reg") == 1,
            "the malformed PUSH_REG to be counted")
        await pair.pw.ping(7)
        pair.register_recv(D_ID, [3, 4])
        pair.send_ready(P_ID, [0, 1])
        await push_ok(pair, P_ID, [0, 1], D_ID, [3, 4])
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_push_reg_with_blocks_outside_d_is_refused_before_any_write() -> None:
    from pushsvc.protocol import notif

    async with push_pair(d_blocks=100) as pair:
        pair.register_recv("warm-up", [1])  # D and P know each other from here on
        pair.send_ready("warm-up", [1])
        await pair.dw.wait_for(wp.RecvDone, "warm-up")
        await pair.pw.wait_for(wp.SendDone, "warm-up")
        before = pair.dw.snapshot()
        # Past D's 100 blocks; one block named twice; the same in groups long enough that P
        # keeps them as arrays (over 64 ids).
        for bad in ([[100]], [[3, 3]], [[*range(70), 100]], [[*range(70), 5]]):
            reg = notif.PushReg(
                request_id="forged", decode_engine_id=pair.d.config.engine_id, decode_host="127.0.0.1",
                decode_port=pair.d.service.peers.port, decode_tp_size=1, local_block_ids=bad,
                remote_engine_id=pair.p.config.engine_id, remote_host="127.0.0.1",
                remote_port=pair.p.service.peers.port, remote_tp_size=1)
            pair.fake.agents[pair.p_agent].inbox[pair.d_agent].append(notif.encode_push_reg(reg))
        await wait_until(lambda: metric(pair.p, "pushsvc_malformed_inputs_total", source="notification",
                                        reason="push_reg_blocks") == 4, "every PUSH_REG to be refused")
        pair.send_ready("forged", [0])
        await pair.pw.quiet_for(0.3)  # nothing to match: no WRITE, no final event yet
        assert pair.p.info()["tables"]["p_staged"] == 1
        assert pair.p.info()["tables"]["p_registrations"] == 0
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == 1  # the warm-up only
        assert np.array_equal(pair.dw.snapshot(), before)  # no byte of D changed
        pair.pw.send(wp.Evict(request_ids=["forged"]))
        assert (await pair.pw.wait_for(wp.SendFailed, "forged")).reason == "cancelled"
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
@pytest.mark.parametrize("corrupt", [False, True], ids=["identical", "corrupted"])
async def test_verify_mode_checks_every_pushed_block(corrupt: bool) -> None:
    async with push_pair(p_config={"verify": True}, d_config={"verify": True}) as pair:
        pair.fake.corrupt_writes = int(corrupt)
        pair.register_recv(D_ID, [3, 4, 9])
        pair.send_ready(P_ID, [0, 1, 2])
        event = await pair.dw.wait_for((wp.RecvDone, wp.RecvFailed), D_ID)
        await pair.pw.wait_for(wp.SendDone, P_ID)
        if corrupt:
            assert isinstance(event, wp.RecvFailed)
            assert event.reason.startswith("verify: 1 of ") and event.block_ids == [3, 4, 9]
            assert metric(pair.d, "pushsvc_verify_total", result="mismatch") == 1
            assert metric(pair.d, "pushsvc_verify_blocks_total", result="mismatch") == 1
        else:
            assert isinstance(event, wp.RecvDone)
            assert metric(pair.d, "pushsvc_verify_total", result="identical") == 1
            assert metric(pair.d, "pushsvc_verify_blocks_total", result="identical") == 3 * REGIONS
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_verify_on_d_without_digests_from_p_fails_clearly() -> None:
    # P is not in verify mode: its WRITE completes at once and no digests ever come.
    async with push_pair(d_config={"verify": True, "peer_timeout_s": 1.0, "heartbeat_interval_s": 0.2}) as pair:
        pair.register_recv(D_ID, [3])
        pair.send_ready(P_ID, [0])
        event = await pair.dw.wait_for((wp.RecvDone, wp.RecvFailed), D_ID)
        assert isinstance(event, wp.RecvFailed) and "verify" in event.reason
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_empty_registration_releases_p_without_writing() -> None:
    async with push_pair() as pair:
        before = pair.dw.snapshot()
        pair.send_ready(P_ID, [0, 1])
        pair.dw.send(wp.RegisterRecv(request_id=D_ID, local_block_ids=[], remote_engine_id=pair.p.config.engine_id,
                                     remote_host="127.0.0.1", remote_port=pair.p.service.peers.port))
        assert isinstance(await pair.pw.wait_for((wp.SendDone, wp.SendFailed), P_ID), wp.SendDone)
        # A release is fire and forget: D tracks nothing for it and its worker waits
        # for no answer, so nothing is left behind for a watchdog either.
        assert tables(pair, "d")["d_pending"] == 0
        await pair.dw.quiet_for(0.1)
        assert metric(pair.p, "pushsvc_transfers_total", result="released") == 1
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == 0
        assert np.array_equal(pair.dw.snapshot(), before)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_describe_names_the_daemon_without_registering_a_worker() -> None:
    import asyncio

    from pushsvc.client import describe_daemon

    async with push_pair() as pair:
        welcome = await asyncio.to_thread(describe_daemon, pair.p.config.socket_path)
        assert welcome.engine_id == pair.p.config.engine_id
        assert welcome.side_channel_port == pair.p.service.peers.port
        assert sorted(pair.p.service.ranks.current) == [0]  # still only the real worker


@pytest.mark.asyncio
async def test_nixl_handles_are_released_when_writes_settle_and_peers_leave() -> None:
    async with push_pair() as pair:
        pair.register_recv(D_ID, [3, 4])
        pair.send_ready(P_ID, [0, 1])
        await push_ok(pair, P_ID, [0, 1], D_ID, [3, 4])
        # Each side: its memory, its own descriptor list, the peer's agent; P (which WRITEs)
        # also D's descriptor list, D (which only notifies P) none of P's.
        steady = {"registrations": 1, "dlists": 2, "xfers": 0, "remote_agents": 1}
        assert pair.p.info()["nixl_handles"] == steady
        assert pair.d.info()["nixl_handles"] == {**steady, "dlists": 1}
        assert metric(pair.p, "pushsvc_nixl_handles", kind="dlists") == 2
        assert metric(pair.p, "process_open_fds") > 0
        await pair.p.shutdown()
        await wait_until(lambda: pair.d.info()["peers"] == [], "D to see P leave")
        assert pair.d.info()["nixl_handles"] == {"registrations": 1, "dlists": 1, "xfers": 0, "remote_agents": 0}
        assert pair.p.service.nixl_handles() == {"registrations": 0, "dlists": 0, "xfers": 0, "remote_agents": 0}
