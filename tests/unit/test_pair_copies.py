"""The same-host push's copy plan (pure): P's and D's blocks paired per group, the pair
table and what the kernel does with it, and the pairs it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from pushsvc.devmem.fake import FakeDeviceMemory
from pushsvc.errors import DeviceError, LayoutError
from pushsvc.state.landing import CopyPlan, check_pair_ids, copy_ranges, entry_runs, group_entries
from pushsvc.state.layout import Layout, RegionSpec, pair_blocks

BLOCK = 1 << 19


def _layout(base: int, blocks: int, stride: int = BLOCK, groups: tuple[int, ...] = (0, 0)) -> Layout:
    return Layout(tuple(RegionSpec(base + i * (1 << 30), BLOCK, blocks, stride, g) for i, g in enumerate(groups)))


def test_pairs_take_ps_last_blocks_in_order_per_group() -> None:
    p, d = _layout(0, 10, groups=(0, 1)), _layout(1 << 40, 20, groups=(0, 1))
    pairs = pair_blocks(p, d, [[1, 2, 3], [4, 5]], [[7, 8], [9, 0]])
    assert [(g, s.tolist(), t.tolist()) for g, s, t in pairs.groups] == [(0, [2, 3], [7, 8]), (1, [4, 5], [9, 0])]
    assert pairs.nbytes == 4 * BLOCK and pairs.logical_blocks == 4
    with pytest.raises(LayoutError, match="remote asks for 3 blocks, only 2 exist"):
        pair_blocks(p, d, [[1, 2]], [[1, 2, 3]])


def test_the_pair_plan_copies_what_the_host_reference_says() -> None:
    p, d = _layout(0, 10), _layout(1 << 40, 20)
    plan = CopyPlan.build_pairs(p, d)
    assert plan.pairs and plan.mode == 2 and plan.table[0, :7].tolist() == [0, BLOCK, 10, 1 << 40, BLOCK, 20, BLOCK]
    src, dst, n = copy_ranges(plan, 0, 2, np.array([3, 0]), np.array([19, 4]))
    assert src.tolist() == [3 * BLOCK, (1 << 30) + 3 * BLOCK, 0, 1 << 30]
    assert dst.tolist() == [(1 << 40) + 19 * BLOCK, (1 << 40) + (1 << 30) + 19 * BLOCK, (1 << 40) + 4 * BLOCK,
                            (1 << 40) + (1 << 30) + 4 * BLOCK]
    assert n.tolist() == [BLOCK] * 4


@pytest.mark.parametrize("src, dst, why", [
    ([10], [0], "source block 10 outside P's KV"),
    ([0], [20], "destination block 20 outside D's KV"),
    ([-1], [0], "source block"),
    ([0, 1], [0], "2 source blocks for 1 destination blocks"),
])
def test_pairs_out_of_either_kv_are_refused(src: list[int], dst: list[int], why: str) -> None:
    plan = CopyPlan.build_pairs(_layout(0, 10), _layout(1 << 40, 20))
    assert why in check_pair_ids(plan, 0, 2, np.array(src), np.array(dst))
    assert check_pair_ids(plan, 0, 2, np.array([9]), np.array([19])) == ""


def test_each_span_is_checked_against_its_own_smallest_region() -> None:
    """The limits are kept per span: a span of the larger regions does not lend its
    limits to one that holds a smaller region, asked after it."""
    p = Layout((RegionSpec(0, BLOCK, 10, BLOCK, 0), RegionSpec(1 << 30, BLOCK, 6, BLOCK, 0)))
    d = Layout((RegionSpec(1 << 40, BLOCK, 20, BLOCK, 0), RegionSpec((1 << 40) + (1 << 30), BLOCK, 12, BLOCK, 0)))
    plan = CopyPlan.build_pairs(p, d)
    assert check_pair_ids(plan, 0, 1, np.array([9]), np.array([19])) == ""
    assert plan.block_limits(0, 1) == (10, 20) and plan.block_limits(0, 2) == (6, 12)
    assert "source block 9 outside P's KV (6 blocks)" in check_pair_ids(plan, 0, 2, np.array([9]), np.array([0]))
    assert "destination block 12 outside D's KV (12 blocks)" in check_pair_ids(plan, 0, 2, np.array([0]),
                                                                                  np.array([12]))


def test_a_layers_regions_are_copied_as_runs_of_entries_of_their_own_group() -> None:
    """``entry_runs``: the plan's entries are sorted by group, so the regions a layer makes
    final (here layer 1's K and V in group 0, its third region in group 1) are a run per
    group, and regions that are not adjacent in the plan are runs of their own."""
    groups = (0, 0, 1, 0, 0, 1)  # two layers: K, V (group 0) and a region of group 1 each
    plan = CopyPlan.build_pairs(_layout(0, 10, groups=groups), _layout(1 << 40, 20, groups=groups))
    assert plan.region_of.tolist() == [0, 1, 3, 4, 2, 5] and plan.group_of.tolist() == [0, 0, 0, 0, 1, 1]
    assert entry_runs(plan, 0, np.array([3, 4, 5])) == [(2, 2)]
    assert entry_runs(plan, 1, np.array([3, 4, 5])) == [(5, 1)]
    assert entry_runs(plan, 0, np.array([0, 3])) == [(0, 1), (2, 1)]
    assert entry_runs(plan, 0, np.array([0, 1, 3, 4])) == [(0, 4)]
    assert entry_runs(plan, 1, np.array([0, 1])) == []
    assert group_entries(plan, 0, 2, 2) == "" and group_entries(plan, 1, 4, 2) == ""
    assert "are not all of group 0" in group_entries(plan, 0, 3, 2)
    assert "copy entries 5..6 of 6" in group_entries(plan, 1, 5, 2)


def test_a_copy_of_entries_outside_its_group_is_refused() -> None:
    """The pairs of one KV group never go through another group's entries (a hybrid
    model's groups pair different blocks)."""
    groups = (0, 1)
    devmem = FakeDeviceMemory()
    device = devmem.add_device(b"u" * 16)
    plan = CopyPlan.build_pairs(_layout(0, 10, groups=groups), _layout(1 << 40, 20, groups=groups))
    copier = device.pair_copier(plan)
    with pytest.raises(DeviceError, match="are not all of group 0"):
        copier.launch(0, np.array([1]), np.array([2]), (0, 2))
    assert device.pair_copies == 0
