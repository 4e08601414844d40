"""P TP 1 -> D TP 2 through two in-process daemons over the fake engine: where a joint
agent's one WRITE lands and what its request leaves in D's request timelines."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from daemon_fixtures import (
    BLOCK_LEN,
    D_ENGINE,
    P_ENGINE,
    REGIONS,
    Worker,
    http_get,
    metric,
    running_daemon,
    wait_until,
)

from pushsvc.engine.fake import FakeEngine
from pushsvc.errors import DaemonUnavailable
from pushsvc.protocol import worker as wp

RID = "cmpl-joint-0-11111111"


@contextlib.asynccontextmanager
async def tp1_to_tp2(**d_config: object) -> AsyncIterator[tuple[object, object, Worker, list[Worker]]]:
    """P of TP 1 (head-major blocks of 4 heads) and D of TP 2 (2 heads each), D's daemon
    configured with ``d_config``."""
    fake = FakeEngine()
    async with running_daemon(fake, P_ENGINE) as p, running_daemon(fake, D_ENGINE, **d_config) as d:
        pw = Worker(p, "producer")
        dws = [Worker(d, "consumer", rank=r, tp_size=2) for r in range(2)]
        try:
            await pw.start(8, BLOCK_LEN, seed=10, heads=4)
            for r, w in enumerate(dws):
                await w.start(16, BLOCK_LEN // 2, seed=2 + r, heads=2)
            yield p, d, pw, dws
        finally:
            for w in [pw, *dws]:
                w.close()


def _register(dw: Worker, p, blocks: list[int], rid: str = RID) -> None:
    dw.send(wp.RegisterRecv(request_id=rid, local_block_ids=[blocks], remote_engine_id=p.config.engine_id,
                            remote_host="127.0.0.1", remote_port=p.service.peers.port, remote_tp_size=1))


@pytest.mark.asyncio
async def test_a_joint_request_has_one_timeline_that_either_members_report_ends() -> None:
    """One registration, so one recv timeline on D (the joint's, numbered as the P rank);
    ``Reported`` from D rank 1 (not the joint's number) still adds the moment vLLM heard."""
    async with tp1_to_tp2() as (p, d, pw, dws):
        for w in dws:
            _register(w, p, [3, 4])
        await wait_until(lambda: p.info()["tables"]["p_registrations"] == 1, "P to hold one registration")
        pw.send(wp.SendReady(request_id=RID, block_ids=[[1, 2]]))
        for w in dws:
            await w.wait_for(wp.RecvDone, RID)
        await pw.wait_for(wp.SendDone, RID)
        half = BLOCK_LEN // 2
        for j, w in enumerate(dws):  # head slice j of P's blocks 1, 2 in D rank j's blocks 3, 4
            image = w.snapshot()
            for region in range(REGIONS):
                for p_block, d_block in ((1, 3), (2, 4)):
                    want = pw.block(pw.initial, region, p_block)[j * half:(j + 1) * half]
                    assert np.array_equal(w.block(image, region, d_block), want), f"D rank {j}, region {region}"
                assert np.array_equal(w.block(image, region, 5), w.block(w.initial, region, 5)), "untouched"
        status, body = await http_get(d, f"/v1/requests?request_id={RID}")
        assert status == 200
        [line] = body["timelines"]
        assert line["side"] == "recv" and line["outcome"] == "recv_done" and line["rank"] == 0, line
        dws[1].send(wp.Reported(recving=[RID], at=time.monotonic()))
        await wait_until(lambda: metric(d, "pushsvc_phase_seconds_count", side="recv",
                                        phase="finished_recving") == 1, "D rank 1's report")
        dws[0].send(wp.Reported(recving=[RID], at=time.monotonic()))
        await dws[0].ping(3)
        assert metric(d, "pushsvc_phase_seconds_count", side="recv", phase="finished_recving") == 1, "once"


@pytest.mark.asyncio
async def test_a_d_daemon_that_stops_tells_every_member_of_what_it_gathered_and_sent() -> None:
    """Past its drain, D's daemon ends a registration both members made (out at P) and
    one only D rank 0 made (still gathering): each member that registered hears
    "daemon shutting down", nothing is left unanswered."""
    async with tp1_to_tp2(drain_timeout_s=0.3) as (p, d, _pw, dws):
        for w in dws:
            _register(w, p, [3, 4])
        await wait_until(lambda: p.info()["tables"]["p_registrations"] == 1, "the joint's PUSH_REG at P")
        _register(dws[0], p, [6], rid="cmpl-joint-half")
        await wait_until(lambda: d.info()["joints"][0]["gathering"] == 1, "D rank 0's half to be gathered")
        await d.shutdown()
        for w in dws:
            failed = await w.wait_for(wp.RecvFailed, RID)
            assert failed.reason == "daemon shutting down" and sorted(failed.block_ids) == [3, 4], failed
        half = await dws[0].wait_for(wp.RecvFailed, "cmpl-joint-half")
        assert half.reason == "daemon shutting down" and half.block_ids == [6], half
        with contextlib.suppress(DaemonUnavailable):  # whatever else came before the daemon closed
            dws[1].poll()
        assert dws[1].events == [], "D rank 1 registered only the first"
