"""D tells P (``RegSent``, side channel 1.9) that a registration's PUSH_REGs went out, so
P's blocks staged before D registered are matched at once instead of at P's next busy
pass; P polls hot for them for at most ``REG_SENT_HOT_S``, and only for blocks it holds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from daemon_fixtures import REGIONS, assert_tables_empty, metric, push_pair, wait_until

from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.sender import REG_SENT_HOT_S

SENT = "pushsvc_reg_sent_total"


def stage(pair, rid: str, blocks: list[int], key: str = "") -> None:
    pair.pw.send(wp.SendReady(request_id=rid, block_ids=[blocks], match_key=key))


def landed(pair, p_ids: list[int], d_ids: list[int]) -> bool:
    """P's blocks ``p_ids`` are in D's blocks ``d_ids``, every region."""
    now = pair.dw.snapshot()
    return all(np.array_equal(pair.dw.block(now, r, t), pair.pw.block(pair.pw.initial, r, s))
               for r in range(REGIONS) for s, t in zip(p_ids, d_ids))


def staged(daemon) -> int:
    return daemon.info()["tables"]["p_staged"]


async def _warm(pair) -> None:
    """One push first, so both daemons know each other (no handshake in what follows)."""
    pair.register_recv("cmpl-warm", [9])
    pair.send_ready("cmpl-warm", [7])
    await pair.dw.wait_for(wp.RecvDone, "cmpl-warm")
    await pair.pw.wait_for(wp.SendDone, "cmpl-warm")
    # D's notice for it may trail the push: counted before a test takes its baseline.
    await wait_until(lambda: sum(metric(pair.p, SENT, outcome=o) or 0 for o in ("ahead", "awaited")) == 1,
                     "P to count the warm-up's notice")


@pytest.mark.asyncio
async def test_blocks_staged_first_are_pushed_on_d_s_notice() -> None:
    async with push_pair() as pair:
        await _warm(pair)
        ahead, awaited = (metric(pair.p, SENT, outcome=o) for o in ("ahead", "awaited"))
        # Registration first: P holds no blocks for it yet.
        pair.register_recv("cmpl-q", [5], match_key="key-0")
        await wait_until(lambda: metric(pair.p, SENT, outcome="ahead") == ahead + 1, "P to count the notice")
        assert pair.p.info()["tables"]["p_registrations"] == 1
        stage(pair, "cmpl-q", [2], "key-0")
        await pair.dw.wait_for(wp.RecvDone, "cmpl-q")
        # Blocks first: P holds them when the notice comes.
        stage(pair, "cmpl-r", [0, 1], "key-1")
        await wait_until(lambda: staged(pair.p) == 1, "P to stage the blocks")
        pair.register_recv("cmpl-r", [3, 4], match_key="key-1")
        await pair.dw.wait_for(wp.RecvDone, "cmpl-r")
        await pair.pw.wait_for(wp.SendDone, "cmpl-r")
        assert landed(pair, [0, 1], [3, 4])
        await wait_until(lambda: metric(pair.p, SENT, outcome="awaited") == awaited + 1, "P to count the notice")
        assert metric(pair.p, SENT, outcome="ahead") == ahead + 1
        state = pair.p.service.sender._of(pair.p.service.ranks.current[0])
        await wait_until(lambda: not state.expected, "the expectation to go with the match")
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_p_polls_hot_for_announced_blocks_only_until_the_window_ends() -> None:
    """A notice P can pair with staged blocks makes that rank hot for ``REG_SENT_HOT_S``
    from the first notice (a second one does not extend it); one it cannot pair with,
    none. The table is not touched: the blocks stay staged for their PUSH_REG."""
    async with push_pair() as pair:
        await _warm(pair)
        service, sender = pair.p.service, pair.p.service.sender
        ahead, awaited = (metric(pair.p, SENT, outcome=o) for o in ("ahead", "awaited"))
        rank = service.ranks.current[0]
        peer = service.peers.find_engine("decode")
        stage(pair, "cmpl-r", [0, 1], "key-1")
        await wait_until(lambda: staged(pair.p) == 1, "P to stage the blocks")
        now = asyncio.get_running_loop().time()
        sender._now = lambda: now
        service.reg_sent(peer, pp.RegSent(request_id="cmpl-other", rank=0, match_key="key-2"))
        assert not sender.hot(rank, now, 0.5)
        service.reg_sent(peer, pp.RegSent(request_id="cmpl-r", rank=0, match_key="key-1"))
        assert sender.hot(rank, now, 0.5) and sender.hot(rank, now + REG_SENT_HOT_S * 0.9, 0.5)
        sender._now = lambda: now + REG_SENT_HOT_S * 0.5
        service.reg_sent(peer, pp.RegSent(request_id="cmpl-r", rank=0, match_key="key-1"))
        assert not sender.hot(rank, now + REG_SENT_HOT_S * 1.01, 0.5)
        assert metric(pair.p, SENT, outcome="awaited") == awaited + 2
        assert metric(pair.p, SENT, outcome="ahead") == ahead + 1
        assert staged(pair.p) == 1 and pair.p.info()["tables"]["p_registrations"] == 0
        del sender._now
        # The PUSH_REG then pairs as ever.
        pair.register_recv("cmpl-r", [3, 4], match_key="key-1")
        await pair.dw.wait_for(wp.RecvDone, "cmpl-r")
        await pair.pw.wait_for(wp.SendDone, "cmpl-r")
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_p_before_1_9_gets_no_notice_and_still_pushes() -> None:
    async with push_pair() as pair:
        await _warm(pair)
        awaited = metric(pair.p, SENT, outcome="awaited")
        sent: list[str] = []
        peers = pair.d.service.receiver._registrar._peers
        send = peers.send
        peers.send = lambda peer, msg: (sent.append(type(msg).__name__), send(peer, msg))[1]
        pair.d.service.peers.find_engine("prefill").minor = pp.REG_SENT_MINOR - 1  # as an older P said
        pair.send_ready("cmpl-r", [0, 1])
        await wait_until(lambda: staged(pair.p) == 1, "P to stage the blocks")
        pair.register_recv("cmpl-r", [3, 4])
        await pair.dw.wait_for(wp.RecvDone, "cmpl-r")
        await pair.pw.wait_for(wp.SendDone, "cmpl-r")
        assert "RegSent" not in sent and metric(pair.p, SENT, outcome="awaited") == awaited
        assert landed(pair, [0, 1], [3, 4])
