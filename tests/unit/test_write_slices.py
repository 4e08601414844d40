"""A host-memory WRITE posted a slice per loop pass (docs/architecture.md, "UCX transports"):
``slice_cuts`` (every pair once, in the plan's order, runs bounded by the slice size) and P's
daemon posting the slices (two in-process daemons over the fake engine, whose WRITEs move
their bytes inside the post, as over TCP)."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from daemon_fixtures import assert_tables_empty, expected_after_push, metric, push_pair, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.errors import TransferError
from pushsvc.protocol import worker as wp
from pushsvc.state.layout import Layout, RegionSpec, plan_write, slice_cuts


def _plan(block_lens: list[int], blocks: int):
    regions = tuple(RegionSpec(i << 24, bl, 64, bl) for i, bl in enumerate(block_lens))
    layout = Layout(regions)
    return plan_write(layout, layout, [list(range(blocks))], [list(range(blocks))])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([16, 64, 4096, 65536]), min_size=1, max_size=6), st.integers(1, 64),
       st.integers(1, 1 << 20))
def test_slices_cover_every_pair_once_in_order_and_stay_near_the_size(block_lens, blocks, max_bytes) -> None:
    plan = _plan(block_lens, blocks)
    cuts = slice_cuts(plan, max_bytes)
    n = len(plan.src_indices)
    assert cuts[0] == 0 and cuts[-1] == n
    assert all(a < b for a, b in zip(cuts, cuts[1:]))  # every run holds a pair; none twice
    pair_bytes = np.repeat(plan.region_bytes // np.diff(plan.edges), np.diff(plan.edges))
    biggest = int(pair_bytes.max())
    for a, b in zip(cuts, cuts[1:]):
        assert int(pair_bytes[a:b].sum()) <= max_bytes + biggest
    assert len(cuts) - 1 <= max(1, math.ceil(plan.nbytes / max_bytes))


def test_a_plan_that_fits_or_no_size_is_one_run() -> None:
    plan = _plan([65536, 65536], 16)  # 2 MiB
    n = len(plan.src_indices)
    assert slice_cuts(plan, 0) == (0, n)
    assert slice_cuts(plan, 2 << 20) == (0, n)
    assert slice_cuts(plan, 1 << 20) == (0, 16, 32)  # one region's 16 blocks per MiB
    assert slice_cuts(plan, 64 << 10) == tuple(range(33))  # a block per run


# ---------------------------------------------------------------- the daemon posting them

KiB = 1 << 10
SLICED = {"post_slice_mib": 1}  # 8 blocks x 2 regions x 256 KiB = 4 MiB: four slices


def _record_posts(pair) -> list[tuple[int, bool]]:
    """P's WRITE posts: (the loop iteration it ran in, whether it carried a notification)."""
    posts: list[tuple[int, bool]] = []
    ticks = [0]

    async def tick() -> None:
        while True:
            ticks[0] += 1
            await asyncio.sleep(0)

    pair.ticker = asyncio.get_running_loop().create_task(tick())
    agent = pair.p.service.ranks.current[0].agent
    write = agent.write
    agent.write = lambda local, li, remote, ri, note: (posts.append((ticks[0], bool(note))),
                                                      write(local, li, remote, ri, note))[1]
    return posts


@pytest.mark.asyncio
async def test_a_large_host_write_goes_a_slice_per_pass_and_lands_exactly() -> None:
    async with push_pair(p_block_len=256 * KiB, d_block_len=256 * KiB, p_config={**SLICED, "verify": True},
                         d_config={"verify": True}) as pair:
        posts = _record_posts(pair)
        ids = list(range(8))
        pair.register_recv("r", ids[::-1])
        pair.send_ready("r", ids)
        await pair.dw.wait_for(wp.RecvDone, "r")
        await pair.pw.wait_for(wp.SendDone, "r")
        pair.ticker.cancel()
        assert [note for _, note in posts] == [False, False, False, True]  # the completion rides the last
        assert len({tick for tick, _ in posts}) == 4  # each in a pass of its own: the loop ran between
        assert metric(pair.p, "pushsvc_write_parts_total") == 4
        assert np.array_equal(pair.dw.snapshot(), expected_after_push(pair.pw, pair.dw, ids, ids[::-1]))
        assert metric(pair.d, "pushsvc_verify_total", result="identical") == 1
        assert metric(pair.d, "pushsvc_verify_blocks_total", result="mismatch") == 0
        await assert_tables_empty(pair.p, pair.d)


@pytest.mark.asyncio
async def test_a_write_that_fits_one_slice_or_with_slices_off_is_one_post() -> None:
    for config, blocks in (({"post_slice_mib": 0}, 8), (SLICED, 2)):
        async with push_pair(p_block_len=256 * KiB, d_block_len=256 * KiB, p_config=config) as pair:
            posts = _record_posts(pair)
            pair.register_recv("r", list(range(blocks)))
            pair.send_ready("r", list(range(blocks)))
            await pair.dw.wait_for(wp.RecvDone, "r")
            pair.ticker.cancel()
            assert [note for _, note in posts] == [True]


@pytest.mark.asyncio
async def test_a_slice_that_cannot_be_posted_fails_the_push_on_both_sides() -> None:
    async with push_pair(p_block_len=256 * KiB, d_block_len=256 * KiB, p_config=SLICED) as pair:
        posts = _record_posts(pair)
        agent = pair.p.service.ranks.current[0].agent
        write = agent.write

        def second_fails(*args):
            if len(posts) == 2:
                raise TransferError("injected failure of the second slice")
            return write(*args)

        agent.write = second_fails
        pair.register_recv("r", list(range(8)))
        pair.send_ready("r", list(range(8)))
        failed = await pair.dw.wait_for(wp.RecvFailed, "r")
        assert "write_submit_failed" in failed.reason and "second slice" in failed.reason
        assert "second slice" in (await pair.pw.wait_for(wp.SendFailed, "r")).reason
        pair.ticker.cancel()
        assert [note for _, note in posts] == [False, False]  # no completion ever went
        assert metric(pair.p, "pushsvc_failures_total", kind="write_submit_failed") == 1
        await assert_tables_empty(pair.p, pair.d)
        agent.write = write  # the next request goes through
        pair.register_recv("s", [0])
        pair.send_ready("s", [1])
        await pair.dw.wait_for(wp.RecvDone, "s")


@pytest.mark.asyncio
async def test_a_registration_withdrawn_between_slices_stops_the_write_and_is_confirmed_once_it_settled() -> None:
    async with push_pair(p_block_len=256 * KiB, d_block_len=256 * KiB, p_config=SLICED) as pair:
        posts = _record_posts(pair)
        pair.fake.hold_writes = True  # the first slice stays in flight
        pair.register_recv("r", list(range(8)))
        pair.send_ready("r", list(range(8)))
        await wait_until(lambda: len(posts) == 1, "the first slice to be posted")
        pair.dw.send(wp.Evict(request_ids=["r"]))
        await wait_until(lambda: pair.p.service.sender._of(pair.p.service.ranks.current[0]).writes["r"].cancelled,
                         "P to hear of the withdrawal")
        await pair.dw.quiet_for(0.3)  # D holds its blocks while the slice may still land
        pair.fake.hold_writes = False
        pair.fake.complete_held()
        failed = await pair.dw.wait_for(wp.RecvFailed, "r")
        assert failed.reason == "cancelled"
        assert "withdrew" in (await pair.pw.wait_for(wp.SendFailed, "r")).reason
        pair.ticker.cancel()
        assert len(posts) == 1  # nothing posted after the withdrawal
        await assert_tables_empty(pair.p, pair.d)
