"""P TP 2 -> D TP 1 through two in-process daemons over the fake engine: the paths that
real NIXL does not let a test provoke (a PUSH_REG that reaches one of P's two ranks and
not the other; a P without one of the ranks D needs)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from daemon_fixtures import BLOCK_LEN, D_ENGINE, P_ENGINE, Worker, metric, running_daemon, wait_until

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp

RID = "cmpl-tp-0-11111111"


@contextlib.asynccontextmanager
async def tp2_to_tp1(p_ranks: tuple[int, ...] = (0, 1), **d_config: object) -> AsyncIterator[
        tuple[FakeEngine, object, object, list[Worker], Worker]]:
    """P of TP 2 (its workers of ``p_ranks``, each with half of D's block) and D of TP 1
    (head-major blocks of 4 heads, its daemon configured with ``d_config``)."""
    fake = FakeEngine()
    async with running_daemon(fake, P_ENGINE) as p, running_daemon(fake, D_ENGINE, **d_config) as d:
        pws = [Worker(p, "producer", rank=r, tp_size=2) for r in p_ranks]
        dw = Worker(d, "consumer")
        try:
            for r, w in zip(p_ranks, pws):
                await w.start(8, BLOCK_LEN // 2, seed=10 + r, heads=2)
            await dw.start(16, BLOCK_LEN, seed=2, heads=4)
            yield fake, p, d, pws, dw
        finally:
            for w in [*pws, dw]:
                w.close()


def _register(dw: Worker, p, blocks: list[int]) -> None:
    dw.send(wp.RegisterRecv(request_id=RID, local_block_ids=[blocks], remote_engine_id=p.config.engine_id,
                            remote_host="127.0.0.1", remote_port=p.service.peers.port, remote_tp_size=2))


@pytest.mark.asyncio
async def test_a_push_reg_that_reaches_one_p_rank_only_is_withdrawn_from_it() -> None:
    """The PUSH_REG reached P rank 0, the one to P rank 1 failed: P rank 0 may write, so the
    registration is withdrawn from it (CancelPush), and the worker hears the failure only
    once P rank 0 confirmed; nothing was written into D's blocks."""
    async with tp2_to_tp1() as (fake, p, d, pws, dw):
        fake.unreachable.add(p.service.ranks.current[1].agent.name)
        _register(dw, p, [3, 4])
        failed = await dw.wait_for(wp.RecvFailed, RID)
        assert failed.reason.startswith("push_reg_send_failed: ") and "injected" in failed.reason, failed
        assert sorted(failed.block_ids) == [3, 4]
        assert metric(d, "pushsvc_failures_total", kind="push_reg_send_failed") == 1
        # P rank 0 got it, and dropped it on D's CancelPush (tombstoned): blocks that come
        # now are never written into D's (reused) blocks.
        await wait_until(lambda: p.info()["tables"]["p_registrations"] == 0, "P rank 0 to drop it")
        pws[0].send(wp.SendReady(request_id=RID, block_ids=[[1, 2]]))
        await wait_until(lambda: p.info()["tables"]["p_staged"] == 1, "P rank 0 to stage")
        assert np.array_equal(dw.snapshot(), dw.initial)
        await dw.quiet_for(0.3)  # exactly one final event


@pytest.mark.asyncio
async def test_a_p_without_a_rank_d_needs_fails_the_registration_naming_it() -> None:
    """... once P did not announce it for as long as a handshake may take."""
    async with tp2_to_tp1(p_ranks=(0,), handshake_timeout_s=0.5) as (_fake, p, d, _pws, dw):
        _register(dw, p, [5])
        failed = await dw.wait_for(wp.RecvFailed, RID)
        assert failed.reason == "handshake_failed: peer prefill has no rank 1 of TP 2", failed
        assert p.info()["tables"]["p_registrations"] == 0, "nothing was sent to P rank 0 either"


@pytest.mark.asyncio
async def test_a_registration_waits_for_a_p_rank_announced_after_the_handshake() -> None:
    """Regression (seen in the e2e restart test): D met a P daemon that had just started,
    whose hello named no agent for a rank D needs, and failed the requests at once ("has no
    rank"); the worker's registration came moments later. D now waits for the
    announcement, and the push goes through."""
    async with tp2_to_tp1(p_ranks=(0,)) as (_fake, p, d, pws, dw):
        _register(dw, p, [3, 4])
        await dw.quiet_for(0.3)  # no failure while P rank 1 is missing
        assert p.info()["tables"]["p_registrations"] == 0, "nothing sent before all of P's ranks are known"
        late = Worker(p, "producer", rank=1, tp_size=2)
        try:
            await late.start(8, BLOCK_LEN // 2, seed=11, heads=2)
            await wait_until(lambda: p.info()["tables"]["p_registrations"] == 2, "both P ranks to hold it")
            pws[0].send(wp.SendReady(request_id=RID, block_ids=[[1, 2]]))
            late.send(wp.SendReady(request_id=RID, block_ids=[[1, 2]]))
            await dw.wait_for(wp.RecvDone, RID)
            image = dw.snapshot()
            for source, w in enumerate((pws[0], late)):
                sent = w.snapshot()
                for d_block, p_block in ((3, 1), (4, 2)):
                    half = dw.block(image, 0, d_block).reshape(2, -1)[source]
                    assert np.array_equal(half, w.block(sent, 0, p_block).reshape(-1)), (source, d_block)
            assert metric(d, "pushsvc_failures_total", kind="handshake_failed") == 0
        finally:
            late.close()


@pytest.mark.asyncio
async def test_a_p_lost_while_d_waits_for_its_rank_fails_the_registration_at_once() -> None:
    async with tp2_to_tp1(p_ranks=(0,), handshake_timeout_s=30) as (_fake, p, d, _pws, dw):
        _register(dw, p, [5])
        await wait_until(lambda: bool(d.service.peers.find_engine(p.config.engine_id)), "D to meet P")
        await dw.quiet_for(0.2)
        for peer in list(p.service.peers.peers.values()):
            for session in list(peer.sessions):
                session.close()  # P's side of the side channel goes away
        failed = await dw.wait_for(wp.RecvFailed, RID, timeout=10)
        assert failed.reason.startswith("handshake_failed: peer prefill was lost before it announced"), failed
