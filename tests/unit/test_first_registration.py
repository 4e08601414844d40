"""D's first PUSH_REG to a P it just dialed, raced against P's side of the handshake.

D's handshake ends when P's hello arrives; P's ends when D's arrives. D sends its
PUSH_REG (a NIXL notification, not the side channel) at once, so P may read it before
it adopted D's session: from an agent P has not heard of yet, kept unverified. The hello
that P then reads announces that agent, and the registration is written. Registrations
that came before the session opened are still dropped when it does: only its own
announcements may vouch for a registration.

The daemons run in-process, over the fake engine and over real NIXL (an engine each):
P's side of the handshake is held until P read the PUSH_REG, which makes the race certain.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from daemon_fixtures import D_ENGINE, P_ENGINE, WAIT_S, expected_after_push, metric, push_pair, wait_until

from pushsvc.protocol import notif
from pushsvc.protocol import worker as wp
from pushsvc.server.peers import PeerLink

pytestmark = pytest.mark.asyncio

RID = "cmpl-first-0-1a2b3c4d"


def _hold_accepts_until(link: PeerLink, monkeypatch: pytest.MonkeyPatch, release: asyncio.Event) -> None:
    """P's side of every handshake it accepts finishes only once ``release`` is set."""
    introduce = link._introduce

    async def held(session: Any, expect_engine: str = "") -> Any:
        intro = await introduce(session, expect_engine)
        if not session.dialed:
            await release.wait()
        return intro

    monkeypatch.setattr(link, "_introduce", held)


def _engines(kind: str) -> tuple[Any, Any] | None:
    """The fake engine (None: the pair's default), or real NIXL, an engine per daemon."""
    if kind == "fake":
        return None
    from pushsvc.engine.nixl import NixlEngine

    return NixlEngine(["UCX"]), NixlEngine(["UCX"])


@pytest.mark.parametrize("engine", ["fake", pytest.param("nixl", marks=pytest.mark.nixl)])
@pytest.mark.parametrize("authenticated", [False, True], ids=["open", "secret"])
@pytest.mark.parametrize("blocks", [2, 100], ids=["short", "long"])  # long: P keeps D's ids as an array
async def test_a_push_reg_read_before_p_adopted_the_session_is_written(
        monkeypatch: pytest.MonkeyPatch, authenticated: bool, engine: str, blocks: int) -> None:
    p_ids, d_ids = list(range(1, 1 + blocks)), list(reversed(range(130, 130 + blocks)))
    async with push_pair(authenticated=authenticated, engines=_engines(engine), p_blocks=256, d_blocks=256) as pair:
        release = asyncio.Event()
        _hold_accepts_until(pair.p.service.peers, monkeypatch, release)
        pair.send_ready(RID, p_ids)
        pair.register_recv(RID, d_ids)
        # D is done with its side and sent the PUSH_REG; P read it from an unknown agent.
        await wait_until(lambda: metric(pair.p, "pushsvc_notifications_total", kind="push_reg_unverified") == 1,
                         "P to read D's PUSH_REG before it adopted D's session")
        assert pair.p.info()["peers"] == []
        release.set()
        done = await pair.dw.wait_for(wp.RecvDone, RID, WAIT_S)
        assert done.request_id == RID
        await pair.pw.wait_for(wp.SendDone, RID, WAIT_S)
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, p_ids, d_ids))


async def test_a_push_reg_from_before_the_session_opened_is_not_vouched_for_by_it(push_reg: Any) -> None:
    """An unverified registration older than the session (it claims D's engine from an
    agent D announces) is dropped when the session opens, not written."""
    async with push_pair() as pair:
        sender = pair.p.service.sender
        reg = notif.encode_push_reg(push_reg("cmpl-old-0-1a2b3c4d", decode_engine_id=D_ENGINE,
                                             local_block_ids=[[5, 6]], remote_engine_id=P_ENGINE))
        sender.intake.on_push_reg(pair.p.service.ranks.current[0], pair.d_agent, reg)  # before any session
        assert metric(pair.p, "pushsvc_notifications_total", kind="push_reg_unverified") == 1
        await asyncio.sleep(0.01)  # the session below opens strictly later
        pair.send_ready("cmpl-old-0-1a2b3c4d", [1, 2])
        pair.register_recv("cmpl-new-0-1a2b3c4d", [7, 8])  # makes D dial P
        await wait_until(lambda: pair.p.info()["peers"] != [], "D's session with P")
        await wait_until(lambda: pair.p.info()["tables"]["p_registrations"] == 1, "the new PUSH_REG at P")
        assert pair.p.info()["tables"]["p_staged"] == 1, "the old registration did not pair with P's blocks"
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == 0
