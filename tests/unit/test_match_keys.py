"""P pairs D's registration with exactly the blocks of the same exchange.

Two exchanges that reuse one ``X-Request-Id`` get request ids with one base id on both
sides; the match key the proxy mints for each exchange keeps them apart, and without
keys such a collision fails cleanly instead of crossing. A PUSH_REG P cannot check yet
waits instead of failing P's request, and the match key reaches only a P that knows it.
"""

from __future__ import annotations

import numpy as np
import pytest
from daemon_fixtures import (
    PushPair,
    assert_tables_empty,
    expected_after_push,
    metric,
    push_pair,
    wait_until,
)

from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp

# One X-Request-Id, two exchanges: vLLM's random suffixes differ, the base ids do not.
P1, P2 = "cmpl-x-0-aaaaaaaa", "cmpl-x-0-bbbbbbbb"
D1, D2 = "cmpl-x-0-cccccccc", "cmpl-x-0-dddddddd"


def tables(daemon) -> dict[str, int]:
    return daemon.info()["tables"]


def register(pair: PushPair, rid: str, blocks: list[int], key: str = "") -> None:
    pair.register_recv(rid, blocks, match_key=key)


def stage(pair: PushPair, rid: str, blocks: list[int], key: str = "") -> None:
    pair.pw.send(wp.SendReady(request_id=rid, block_ids=[blocks], match_key=key))


@pytest.mark.asyncio
@pytest.mark.parametrize("registrations_first", [True, False])
async def test_exchanges_sharing_a_request_id_pair_by_their_keys(registrations_first: bool) -> None:
    async with push_pair() as pair:
        if registrations_first:
            register(pair, D1, [3, 4], "key-1")
            register(pair, D2, [9, 10], "key-2")
            await wait_until(lambda: tables(pair.p)["p_registrations"] == 2, "both PUSH_REGs to reach P")
        # P's second exchange finishes first: ids alone would pair it with D's first.
        stage(pair, P2, [5, 6], "key-2")
        stage(pair, P1, [0, 1], "key-1")
        if not registrations_first:
            await wait_until(lambda: tables(pair.p)["p_staged"] == 2, "P to stage both")
            register(pair, D1, [3, 4], "key-1")
            register(pair, D2, [9, 10], "key-2")
        for d in (D1, D2):
            await pair.dw.wait_for(wp.RecvDone, d)
        for p in (P1, P2):
            await pair.pw.wait_for(wp.SendDone, p)
        expected = expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4])
        pair.dw.initial = expected
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [5, 6], [9, 10]))
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_shared_base_id_without_keys_fails_every_request_involved_and_writes_nothing() -> None:
    async with push_pair() as pair:
        register(pair, D1, [3, 4])
        register(pair, D2, [9, 10])
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 2, "both PUSH_REGs to reach P")
        stage(pair, P1, [0, 1])
        sent = await pair.pw.wait_for(wp.SendFailed, P1)
        assert sent.reason.startswith("ambiguous_match:")
        for d in (D1, D2):
            failed = await pair.dw.wait_for(wp.RecvFailed, d)
            assert "ambiguous_match" in failed.reason
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == 0
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_release_for_an_exchange_already_served_leaves_nothing_on_p() -> None:
    """vLLM's dummy for a rejected or abandoned D request registers no blocks under
    another request id but the same match key: P keeps no registration for it, only the
    key (should a P request of that exchange still come, it is released on arrival)."""
    async with push_pair() as pair:
        register(pair, D1, [3, 4], "key-1")
        stage(pair, P1, [0, 1], "key-1")
        await pair.dw.wait_for(wp.RecvDone, D1)
        await pair.pw.wait_for(wp.SendDone, P1)
        pair.register_recv("cmpl-dummy", [], match_key="key-1")
        await wait_until(lambda: metric(pair.p, "pushsvc_notifications_total", kind="push_reg_release_noted") == 1,
                         "P to see the release")
        await pair.dw.quiet_for(0.1)  # a release gets no answer on D
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_release_before_blocks_are_staged_frees_them_when_they_come() -> None:
    async with push_pair() as pair:
        pair.register_recv("cmpl-dummy", [], match_key="key-1")
        await wait_until(lambda: metric(pair.p, "pushsvc_notifications_total", kind="push_reg_release_noted") == 1,
                         "the release to reach P")
        assert tables(pair.d)["d_pending"] == 0 and tables(pair.p)["p_registrations"] == 0
        stage(pair, P1, [0, 1], "key-1")
        await pair.pw.wait_for(wp.SendDone, P1)
        assert metric(pair.p, "pushsvc_transfers_total", result="released") == 1
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_release_frees_every_staged_request_of_its_exchange_and_those_that_come_later() -> None:
    """A batch of prompts is one exchange: its sub-requests share the key. D's release
    for it (the rejected request's dummy, under yet another id) frees all of them."""
    async with push_pair() as pair:
        stage(pair, "cmpl-b-0-aaaaaaaa", [0, 1], "key-b")
        stage(pair, "cmpl-b-1-aaaaaaaa", [2], "key-b")
        stage(pair, "cmpl-c-0-aaaaaaaa", [3], "key-c")  # another exchange: untouched
        await wait_until(lambda: tables(pair.p)["p_staged"] == 3, "P to stage")
        pair.register_recv("cmpl-dummy", [], match_key="key-b")
        for rid in ("cmpl-b-0-aaaaaaaa", "cmpl-b-1-aaaaaaaa"):
            await pair.pw.wait_for(wp.SendDone, rid)
        stage(pair, "cmpl-b-2-aaaaaaaa", [4], "key-b")  # a sub-request that finished late
        await pair.pw.wait_for(wp.SendDone, "cmpl-b-2-aaaaaaaa")
        assert metric(pair.p, "pushsvc_transfers_total", result="released") == 3
        assert tables(pair.p)["p_staged"] == 1
        pair.pw.send(wp.Evict(request_ids=["cmpl-c-0-aaaaaaaa"]))
        await pair.pw.wait_for(wp.SendFailed, "cmpl-c-0-aaaaaaaa")
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_sub_requests_of_one_exchange_pair_by_their_ids() -> None:
    async with push_pair() as pair:
        stage(pair, "cmpl-b-1-aaaaaaaa", [5], "key-b")  # sub-request 1 finished first on P
        register(pair, "cmpl-b-0-dddddddd", [3], "key-b")
        register(pair, "cmpl-b-1-dddddddd", [9], "key-b")
        await pair.dw.wait_for(wp.RecvDone, "cmpl-b-1-dddddddd")
        stage(pair, "cmpl-b-0-aaaaaaaa", [0], "key-b")
        await pair.dw.wait_for(wp.RecvDone, "cmpl-b-0-dddddddd")
        expected = expected_after_push(pair.pw, pair.dw, [5], [9])
        pair.dw.initial = expected
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0], [3]))
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_push_reg_from_an_agent_p_does_not_know_yet_waits_for_it() -> None:
    """D's new agent registers before its AgentsUpdate reached P: P's request must not
    fail for that (it used to, as sender_mismatch); the match happens once P knows it."""
    async with push_pair() as pair:
        register(pair, "cmpl-warm", [2])  # D's daemon and P's meet: P knows D's first agent
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 1, "the handshake")
        d_rank = pair.d.service.ranks.current[0]
        p_agent = pair.p.service.ranks.current[0].agent.name
        known = d_rank.agent_info()
        # A second agent of D's daemon for the same memory, as a restarted worker would get.
        newcomer = pair.fake.create_agent(f"decode/r0/{pair.d.daemon_id[:8]}.99")
        newcomer.add_remote(pair.p.service.ranks.current[0].agent.metadata())
        newcomer.register(list(d_rank.agent.buffers), "DRAM")
        stage(pair, P1, [0, 1])
        await wait_until(lambda: tables(pair.p)["p_staged"] == 1, "P to stage")
        reg = notif.PushReg(
            request_id=D1, decode_engine_id="decode", decode_host="127.0.0.1", decode_port=pair.d.service.peers.port,
            decode_tp_size=1, local_block_ids=[[3, 4]], remote_engine_id="prefill", remote_host="127.0.0.1",
            remote_port=pair.p.service.peers.port, remote_tp_size=1, decode_rank=0)
        newcomer.send_notif(p_agent, notif.encode_push_reg(reg))
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 2, "P to keep the PUSH_REG")
        await pair.pw.quiet_for(0.2)  # P's request is not failed
        assert tables(pair.p)["p_staged"] == 1
        # D's daemon announces the agent: now P checks it and pushes.
        info = pp.AgentInfo(rank=0, tp_size=1, agent_name=newcomer.name, metadata=newcomer.metadata(),
                            regions=known.regions, blocks_per_logical=known.blocks_per_logical)
        pair.d.service.peers.announce([info])
        await pair.pw.wait_for(wp.SendDone, P1)
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1], [3, 4]))
        assert newcomer.inbox == {p_agent: [notif.encode_completion(D1, 1)]}
        newcomer.close()
        pair.dw.send(wp.Evict(request_ids=["cmpl-warm"]))


@pytest.mark.asyncio
@pytest.mark.parametrize(("p_minor", "sent_key"), [(pp.MATCH_KEY_MINOR, "key-1"), (pp.MATCH_KEY_MINOR - 1, "")])
async def test_the_match_key_goes_only_to_a_p_whose_minor_knows_it(p_minor: int, sent_key: str) -> None:
    async with push_pair() as pair:
        register(pair, "cmpl-warm", [2])  # D learns P's daemon: the handshake is done
        await wait_until(lambda: pair.d.service.peers.find_engine("prefill") is not None, "D to know P")
        pair.d.service.peers.find_engine("prefill").minor = p_minor  # as an older P would have said
        register(pair, D1, [3, 4], "key-1")
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 2, "the PUSH_REG to reach P")
        table = pair.p.service.sender._of(pair.p.service.ranks.current[0]).table
        assert table.registrations[("decode", D1)].match_key == sent_key


@pytest.mark.asyncio
async def test_a_release_p_cannot_receive_is_dropped_quietly() -> None:
    """P's worker left (its agent is gone): a release for P finds nobody to tell. It is
    given up with a log line; the worker's connection gets no error for it."""
    async with push_pair() as pair:
        register(pair, "cmpl-warm", [2])  # D knows P's daemon and agent
        await wait_until(lambda: tables(pair.p)["p_registrations"] == 1, "the handshake")
        pair.pw.client.close()
        await wait_until(lambda: not pair.p.info()["agents"] and not pair.p.info()["retiring_agents"],
                         "P to release its rank")
        await pair.dw.wait_for(wp.RecvFailed, "cmpl-warm")  # P told D it will never serve that one
        pair.register_recv("cmpl-dummy", [], match_key="key-1")
        await pair.dw.quiet_for(0.2)
        assert metric(pair.d, "pushsvc_malformed_inputs_total", source="worker", reason="internal") == 0
