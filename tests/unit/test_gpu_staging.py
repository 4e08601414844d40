"""P's staging (``staging_mib``) with the device faked: a request's blocks copied into
staging slots, the WRITE from there, slots held while a copy or a WRITE may touch them,
backpressure, refusals, a device fault, and the worker's KV never registered with NIXL."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from daemon_fixtures import expected_after_push, metric, wait_until
from gpu_fixtures import gpu_pair

from pushsvc.protocol import worker as wp

# One slot is a block of both regions: 512 KiB; 2 MiB holds 4.
STAGING = {"staging_mib": 2}


def _staging(daemon) -> dict[str, int]:
    return daemon.service.sender.staging.slot_counts()


async def _p_final(pair, rid: str) -> wp.DaemonMessage:
    return await pair.pw.wait_for((wp.SendDone, wp.SendFailed), rid)


@pytest.mark.asyncio
async def test_a_push_goes_from_staging_slots_and_lands_exactly() -> None:
    async with gpu_pair(p_config=STAGING) as (pair, devmem):
        rank = pair.p.service.ranks.current[0]
        assert rank.memory.staging is not None and rank.memory.dlist is None
        worker = (pair.pw.buffer.address, pair.pw.buffer.size)
        assert worker not in rank.agent.buffers  # NIXL never sees the worker's memory
        assert [rank.memory.staging.buffer.address] == [a for a, _ in rank.agent.buffers]
        pair.register_recv("s", [3, 9, 4])
        pair.send_ready("s", [0, 1, 2, 5])  # a prefix hit on D: P's last three blocks go
        await pair.dw.wait_for(wp.RecvDone, "s")
        assert isinstance(await _p_final(pair, "s"), wp.SendDone)
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1, 2, 5], [3, 9, 4]))
        assert metric(pair.p, "pushsvc_staging_copies_total") == 1
        await wait_until(lambda: _staging(pair.p) == {"total": 4, "used": 0, "queued": 0}, "the slots back")
        assert devmem.copies_in_flight == 0


@pytest.mark.asyncio
async def test_verify_covers_the_staging_copy() -> None:
    async with gpu_pair(p_config={**STAGING, "verify": True}, d_config={"verify": True}) as (pair, _devmem):
        pair.register_recv("v", [10, 11])
        pair.send_ready("v", [4, 5])
        await pair.dw.wait_for(wp.RecvDone, "v")
        assert metric(pair.d, "pushsvc_verify_total", result="identical") == 1


@pytest.mark.asyncio
async def test_matches_wait_for_staging_space_in_order() -> None:
    async with gpu_pair(p_config=STAGING) as (pair, devmem):
        devmem.hold_copies = True  # a's copy stays in flight: its 3 slots stay taken
        pair.register_recv("a", [0, 1, 2])
        pair.register_recv("b", [3, 4])
        pair.send_ready("a", [0, 1, 2])
        await wait_until(lambda: _staging(pair.p)["used"] == 3, "a's slots")
        pair.send_ready("b", [3, 4])
        await wait_until(lambda: _staging(pair.p)["queued"] == 1, "b waiting")
        assert metric(pair.p, "pushsvc_staging_waits_total") == 1
        devmem.hold_copies = False
        await pair.dw.wait_for(wp.RecvDone, "a")
        await pair.dw.wait_for(wp.RecvDone, "b")
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, [0, 1, 2, 3, 4],
                                                                      [0, 1, 2, 3, 4]))
        await wait_until(lambda: _staging(pair.p)["used"] == 0, "the slots back")


@pytest.mark.asyncio
async def test_a_match_larger_than_the_staging_buffer_fails_at_once_on_both_sides() -> None:
    async with gpu_pair(p_config=STAGING) as (pair, _devmem):
        pair.register_recv("huge", [0, 1, 2, 3, 4])
        pair.send_ready("huge", [0, 1, 2, 3, 4])
        failed = await _p_final(pair, "huge")
        assert isinstance(failed, wp.SendFailed) and "staging_too_small" in failed.reason
        assert "raise staging_mib" in failed.reason
        d_failed = await pair.dw.wait_for(wp.RecvFailed, "huge")
        assert "staging_too_small" in d_failed.reason
        assert metric(pair.p, "pushsvc_failures_total", kind="staging_too_small") == 1


@pytest.mark.asyncio
async def test_a_cancel_during_the_copy_keeps_the_slots_until_it_finished_and_writes_nothing() -> None:
    async with gpu_pair(p_config=STAGING) as (pair, devmem):
        devmem.hold_copies = True
        pair.register_recv("c", [6, 7])
        pair.send_ready("c", [0, 1])
        await wait_until(lambda: devmem.copies_in_flight >= 1, "the staging copy in flight")
        pair.dw.send(wp.Evict(request_ids=["c"]))  # D withdraws while P copies
        await pair.dw.wait_for(wp.RecvFailed, "c")
        await _p_final(pair, "c")
        await asyncio.sleep(0.1)
        assert _staging(pair.p)["used"] == 2  # the copy may still write them
        devmem.hold_copies = False
        await wait_until(lambda: _staging(pair.p)["used"] == 0, "the slots back once the copy finished")
        assert metric(pair.p, "pushsvc_write_parts_total") == 0  # nothing was sent
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
        pair.register_recv("d", [6, 7])  # and the rank carries on
        pair.send_ready("d", [0, 1])
        await pair.dw.wait_for(wp.RecvDone, "d")


@pytest.mark.asyncio
async def test_a_device_fault_in_the_staging_copy_fails_the_push_and_frees_the_slots() -> None:
    async with gpu_pair(p_config=STAGING) as (pair, devmem):
        devmem.hold_copies = True
        pair.register_recv("f", [1, 2])
        pair.send_ready("f", [4, 5])
        await wait_until(lambda: devmem.copies_in_flight == 1, "the copy in flight")
        devmem.fault_copies, devmem.hold_copies = True, False
        failed = await _p_final(pair, "f")
        assert isinstance(failed, wp.SendFailed) and failed.reason.startswith("staging_copy: staging copy failed")
        await pair.dw.wait_for(wp.RecvFailed, "f")
        assert metric(pair.p, "pushsvc_failures_total", kind="staging_copy") == 1
        assert _staging(pair.p)["used"] == 0
        assert np.array_equal(pair.dw.snapshot(), pair.dw.initial)
