"""P's staged requests are bounded per rank: P's blocks bound nothing (requests share
them through the prefix cache), so a worker staging request after request under new ids
would otherwise grow the table for as long as the lease. Past the bound its finished
blocks are refused, each refusal counted, and a place freed is taken again."""

from __future__ import annotations

import pytest
from daemon_fixtures import LONG_S, P_ENGINE, Worker, metric, running_daemon

from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp

BOUND = 3  # the real one is 65,536: a test sending that many frames takes a minute


@pytest.mark.asyncio
async def test_finished_blocks_past_the_staged_bound_are_refused_and_counted(monkeypatch) -> None:
    async with running_daemon(FakeEngine(), P_ENGINE, lease_s=LONG_S) as p:
        pw = Worker(p, "producer")
        await pw.start(8)
        try:
            rank = p.service.ranks.current[0]
            table = p.service.sender._of(rank).table
            monkeypatch.setattr(table, "max_staged", BOUND, raising=False)
            for i in range(BOUND + 2):  # every request names the same blocks, as prefix sharing does
                pw.send(wp.SendReady(request_id=f"r-{i}", block_ids=[[0, 1, 2]]))
            for i in (BOUND, BOUND + 1):
                failed = await pw.wait_for(wp.SendFailed, f"r-{i}")
                assert failed.reason == f"P holds {BOUND} staged requests of this rank already, none registered " \
                                        "for by D yet", failed
            assert list(table.staged) == [f"r-{i}" for i in range(BOUND)]
            assert metric(p, "pushsvc_malformed_inputs_total", source="worker", reason="finished_blocks") == 2
            pw.send(wp.Evict(request_ids=["r-0"]))
            assert (await pw.wait_for(wp.SendFailed, "r-0")).reason == "cancelled"
            pw.send(wp.SendReady(request_id="r-again", block_ids=[[0, 1, 2]]))
            await pw.ping(1)
            assert "r-again" in table.staged
            assert [e for e in pw.events if isinstance(e, (wp.SendFailed, wp.Error))] == []
        finally:
            pw.close()
