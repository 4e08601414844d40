"""P announces a WRITE (``WriteStarted``) just before it posts it: D polls back to back from
when it hears of it, and a WRITE between two processes of a host settles only while D
progresses too."""

from __future__ import annotations

import pytest
from daemon_fixtures import push_pair

from pushsvc.protocol import worker as wp


def _record_order(pair) -> list[str]:
    """What P's daemon does, in order: side-channel messages by type, and WRITE posts."""
    order: list[str] = []
    peers = pair.p.service.sender._peers
    send = peers.send
    peers.send = lambda peer, msg: (order.append(type(msg).__name__), send(peer, msg))[1]
    agent = pair.p.service.ranks.current[0].agent
    write = agent.write
    agent.write = lambda *args, **kwargs: (order.append("post"), write(*args, **kwargs))[1]
    return order


@pytest.mark.asyncio
async def test_d_hears_of_the_write_before_p_posts_it() -> None:
    async with push_pair() as pair:
        order = _record_order(pair)
        pair.register_recv("r", [3, 4])
        pair.send_ready("r", [0, 1])
        await pair.dw.wait_for(wp.RecvDone, "r")
        await pair.pw.wait_for(wp.SendDone, "r")
        assert order == ["WriteStarted", "post"]


@pytest.mark.asyncio
async def test_a_write_that_cannot_be_posted_after_its_announcement_fails_cleanly_on_both_sides() -> None:
    async with push_pair() as pair:
        order = _record_order(pair)
        pair.fake.fail_next_write = 1
        pair.register_recv("r", [3, 4])
        pair.send_ready("r", [0, 1])
        failed = await pair.dw.wait_for(wp.RecvFailed, "r")
        assert "write_submit_failed" in failed.reason and failed.block_ids == [3, 4]
        await pair.pw.wait_for(wp.SendFailed, "r")
        assert order == ["WriteStarted", "post", "PushFailed"]
        # the next request goes through
        pair.register_recv("s", [5])
        pair.send_ready("s", [2])
        await pair.dw.wait_for(wp.RecvDone, "s")
