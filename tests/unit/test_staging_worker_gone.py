"""P's worker leaving while a match's staging copy runs (``staging_mib``, nothing posted
yet): the push fails on both sides at once, not at D's watchdog, and the rank's memory
(the staging buffer, the worker's imported KV the copy reads) stays until the copy ended."""

from __future__ import annotations

import numpy as np
import pytest
from daemon_fixtures import metric, wait_until
from gpu_fixtures import GpuWorker, gpu_pair

from pushsvc.protocol import worker as wp

STAGING = {"staging_mib": 2}


@pytest.mark.asyncio
async def test_a_worker_leaving_mid_staging_copy_fails_the_push_and_its_rank_outlives_the_copy() -> None:
    async with gpu_pair(p_config=STAGING) as (pair, devmem):
        p = pair.p
        devmem.hold_copies = True  # a's staging copy stays in flight
        pair.register_recv("a", [0, 1])
        pair.send_ready("a", [0, 1])
        await wait_until(lambda: p.service.sender.staging.slot_counts()["used"] == 2, "a's staging copy")
        rank = p.service.ranks.current[0]
        pair.pw.close()
        event = await pair.dw.wait_for((wp.RecvDone, wp.RecvFailed), "a")
        assert isinstance(event, wp.RecvFailed) and "worker_gone" in event.reason, event
        assert metric(p, "pushsvc_failures_total", kind="worker_gone") == 1
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        # The copy still reads the worker's blocks into the staging buffer: the rank is not closed under it.
        assert rank in p.service.ranks.retiring and devmem.copies_in_flight > 0
        devmem.hold_copies = False
        await wait_until(lambda: rank not in p.service.ranks.retiring, "the rank closed once the copy ended")
        assert devmem.copies_in_flight == 0
        assert metric(p, "pushsvc_write_parts_total") == 0  # nothing was sent
        # The worker process hears the request's end when it connects again.
        again = GpuWorker(p, "producer", devmem)
        try:
            await again.start(8, seed=1)
            failed = await again.wait_for(wp.SendFailed, "a")
            assert failed.reason.startswith("worker_gone: P's worker left before the WRITE was posted"), failed
        finally:
            again.close()
