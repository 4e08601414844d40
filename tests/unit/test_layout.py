"""Layouts, descriptor tables, compatibility checks and WRITE planning."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.errors import LayoutError, PushsvcError
from pushsvc.state.layout import (
    Layout,
    RegionSpec,
    check_block_ids,
    check_compatible,
    descriptor_table,
    id_arrays,
    names_no_block,
    pair_blocks,
    plan_write,
)


def region(num_blocks: int, block_len: int = 16, *, group: int = 0, base: int = 0, stride: int = 0) -> RegionSpec:
    return RegionSpec(base=base, block_len=block_len, num_blocks=num_blocks, stride=stride or block_len, group=group)


def layout(*regions: RegionSpec, per_logical: int = 1) -> Layout:
    return Layout(regions=tuple(regions), blocks_per_logical=per_logical)


def pairs(plan) -> list[tuple[int, int]]:
    return list(zip(plan.src_indices.tolist(), plan.dst_indices.tolist()))


# ---------------------------------------------------------------- Layout / RegionSpec


def test_layout_error_is_a_pushsvc_error() -> None:
    assert issubclass(LayoutError, PushsvcError)


def test_layout_and_region_are_immutable() -> None:
    lay = layout(region(4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.blocks_per_logical = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.regions[0].num_blocks = 8  # type: ignore[misc]


def test_region_group_defaults_to_zero() -> None:
    assert RegionSpec(base=0, block_len=8, num_blocks=2, stride=8).group == 0


@pytest.mark.parametrize(
    ("groups_of_regions", "expected"),
    [((), 1), ((0,), 1), ((0, 0, 0), 1), ((0, 1, 0), 2), ((1, 0), 2), ((0, 2), 3)],
)
def test_groups_counts_up_to_highest_group(groups_of_regions: tuple[int, ...], expected: int) -> None:
    assert layout(*(region(4, group=g) for g in groups_of_regions)).groups == expected


def test_logical_blocks_is_smallest_region_of_group_over_ratio() -> None:
    lay = layout(region(10, group=0), region(7, group=0), region(100, group=1), per_logical=2)
    assert lay.logical_blocks(0) == 3  # min(10, 7) // 2
    assert lay.logical_blocks(1) == 50


def test_logical_blocks_of_group_without_regions_is_zero() -> None:
    lay = layout(region(8, group=0), region(8, group=2))
    assert lay.logical_blocks(1) == 0
    assert lay.logical_blocks(5) == 0


def test_total_descriptors_and_bytes_per_logical_block() -> None:
    lay = layout(region(10, 16), region(6, 32, group=1), region(4, 8), per_logical=2)
    assert lay.total_descriptors == 20
    assert lay.bytes_per_logical_block == (16 + 32 + 8) * 2


def test_empty_layout_views() -> None:
    lay = layout()
    assert lay.total_descriptors == 0
    assert lay.bytes_per_logical_block == 0
    assert lay.logical_blocks(0) == 0


# ---------------------------------------------------------------- descriptor_table


def test_descriptor_table_lists_every_block_of_every_region_in_order() -> None:
    lay = layout(region(3, 16, base=0x1000, stride=64), region(2, 8, base=0x9000, stride=8, group=1))
    table = descriptor_table(lay, device_id=5)
    assert table.dtype == np.uint64
    assert table.shape == (5, 3)
    assert table.tolist() == [
        [0x1000, 16, 5],
        [0x1040, 16, 5],
        [0x1080, 16, 5],
        [0x9000, 8, 5],
        [0x9008, 8, 5],
    ]


def test_descriptor_table_device_defaults_to_zero() -> None:
    assert descriptor_table(layout(region(2)))[:, 2].tolist() == [0, 0]


def test_descriptor_table_keeps_64_bit_addresses_exact() -> None:
    base = 2**64 - 4 * 4096
    table = descriptor_table(layout(region(4, 4096, base=base)))
    assert [int(a) for a in table[:, 0]] == [base + i * 4096 for i in range(4)]


def test_descriptor_table_of_empty_layout() -> None:
    table = descriptor_table(layout())
    assert table.shape == (0, 3)
    assert table.dtype == np.uint64


def test_descriptor_table_length_is_total_descriptors() -> None:
    lay = layout(region(7), region(3, group=1), region(11))
    assert len(descriptor_table(lay)) == lay.total_descriptors


# ---------------------------------------------------------------- check_compatible


def test_compatible_layouts_may_differ_in_capacity_base_and_stride() -> None:
    src = layout(region(10, 16, base=0, stride=16), region(10, 32, group=1), per_logical=2)
    dst = layout(region(40, 16, base=0xABC000, stride=256), region(3, 32, group=1), per_logical=2)
    check_compatible(src, dst)
    check_compatible(dst, src)


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (layout(region(4), per_logical=1), layout(region(4), per_logical=2), "kernel blocks per logical"),
        (layout(region(4)), layout(region(4), region(4)), "region count"),
        (layout(region(4), region(4)), layout(region(4)), "region count"),
        (layout(region(4), region(4, 16)), layout(region(4), region(4, 32)), "region 1: kernel block length"),
        (layout(region(4), region(4, group=1)), layout(region(4), region(4, group=0)), "region 1: KV group"),
    ],
)
def test_incompatible_layouts_are_rejected(src: Layout, dst: Layout, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        check_compatible(src, dst)


def test_region_order_matters_for_compatibility() -> None:
    with pytest.raises(LayoutError, match="region 0"):
        check_compatible(layout(region(4, 16), region(4, 32)), layout(region(4, 32), region(4, 16)))


# ---------------------------------------------------------------- check_block_ids


TWO_GROUPS = layout(region(10, group=0), region(8, group=0), region(4, group=1), per_logical=2)  # 4 and 2 logical


@pytest.mark.parametrize(
    "block_ids",
    [[], [[]], [[], []], [[0, 1, 2, 3]], [[3, 0], [1, 0]], [[], [1]]],
)
def test_valid_block_ids_pass(block_ids: list[list[int]]) -> None:
    check_block_ids(TWO_GROUPS, block_ids, "local blocks")


@pytest.mark.parametrize(
    ("block_ids", "match"),
    [
        ([[], [], []], "3 block groups, layout has 2"),
        ([[4]], "group 0 names a block outside 0..3"),  # limit is min(10, 8) // 2
        ([[-1]], "group 0 names a block outside"),
        ([[0], [2]], "group 1 names a block outside 0..1"),
        ([[0], [-5, 1]], "group 1 names a block outside"),
        ([[1, 2, 1]], "group 0 names a block twice"),
        ([[], [0, 0]], "group 1 names a block twice"),
    ],
)
def test_invalid_block_ids_are_rejected(block_ids: list[list[int]], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        check_block_ids(TWO_GROUPS, block_ids, "remote blocks")


def test_block_id_error_names_the_side() -> None:
    with pytest.raises(LayoutError, match="^remote blocks: "):
        check_block_ids(TWO_GROUPS, [[99]], "remote blocks")


def test_group_without_regions_accepts_no_block() -> None:
    lay = layout(region(4, group=0), region(4, group=2))
    check_block_ids(lay, [[0], [], [3]], "x")
    with pytest.raises(LayoutError, match="group 1"):
        check_block_ids(lay, [[0], [0], [3]], "x")


def _check_reference(lay: Layout, block_ids: list[list[int]]) -> str:
    """What check_block_ids must say, by Python's builtins alone: "" or the error's words."""
    if len(block_ids) > lay.groups:
        return "block groups"
    for g, ids in enumerate(block_ids):
        if ids and (min(ids) < 0 or max(ids) >= lay.logical_blocks(g)):
            return f"group {g} names a block outside"
        if len(set(ids)) != len(ids):
            return f"group {g} names a block twice"
    return ""


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.lists(st.integers(-3, 1100), max_size=300), max_size=3),
       as_arrays=st.booleans())
def test_block_id_check_agrees_with_the_builtins_for_lists_and_arrays(groups: list[list[int]],
                                                                       as_arrays: bool) -> None:
    """Short groups are checked by builtins, long ones (and arrays: packed ids) by numpy:
    both say what the builtins say, for every size around the switch."""
    lay = layout(region(1000, group=0), region(1024, group=1), per_logical=1)  # 1000 and 1024 logical
    given_ids = [np.asarray(ids, dtype=np.int64) for ids in groups] if as_arrays else groups
    expected = _check_reference(lay, groups)
    if expected:
        with pytest.raises(LayoutError, match=expected):
            check_block_ids(lay, given_ids, "x")
    else:
        check_block_ids(lay, given_ids, "x")


@pytest.mark.parametrize("n", [65, 4096])
def test_a_long_group_names_a_duplicate_or_an_id_out_of_range(n: int) -> None:
    lay = layout(region(n + 1))
    ids = list(range(n))
    check_block_ids(lay, [ids], "x")
    check_block_ids(lay, [np.asarray(ids[::-1], dtype=np.int64)], "x")
    for bad, words in ((ids[:-1] + [0], "twice"), (ids[:-1] + [n + 1], "outside"), ([-1] + ids[1:], "outside")):
        for given_ids in (bad, np.asarray(bad, dtype=np.int64)):
            with pytest.raises(LayoutError, match=words):
                check_block_ids(lay, [given_ids], "x")


def test_a_plan_takes_p_blocks_as_an_array() -> None:
    src = layout(region(300), region(300, block_len=8))
    dst = layout(region(400), region(400, block_len=8))
    ids = list(range(10, 290))
    listed = plan_write(src, dst, [ids], [list(range(5, 105))])
    arrayed = plan_write(src, dst, [np.asarray(ids, dtype=np.int64)], [list(range(5, 105))])
    assert pairs(arrayed) == pairs(listed) and arrayed.nbytes == listed.nbytes


def test_long_groups_become_arrays_and_pair_and_plan_as_lists_do() -> None:
    short, long = [4, 2, 9], list(range(300, 200, -1))  # 3 and 100 ids
    kept = id_arrays([short, long, []])
    assert kept[0] is short and kept[2] == []
    assert isinstance(kept[1], np.ndarray) and kept[1].dtype == np.int64 and kept[1].tolist() == long
    assert id_arrays([kept[1]])[0] is kept[1]  # an array stays as it is
    src, dst = layout(region(400), region(400, block_len=8)), layout(region(500), region(500, block_len=8))
    p_ids = np.asarray(range(50, 170), dtype=np.int64)  # 120 of P's blocks, D takes the last 100 (a prefix hit)
    listed, arrayed = plan_write(src, dst, [p_ids], [long]), plan_write(src, dst, [p_ids], id_arrays([long]))
    assert pairs(arrayed) == pairs(listed) and arrayed.nbytes == listed.nbytes
    by_list, by_array = pair_blocks(src, dst, [p_ids], [long]), pair_blocks(src, dst, [p_ids], id_arrays([long]))
    assert by_array.nbytes == by_list.nbytes == 100 * (16 + 8) and by_array.logical_blocks == 100
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])
               for a, b in zip(by_array.groups, by_list.groups, strict=True))
    with pytest.raises(LayoutError, match="twice"):
        check_block_ids(dst, id_arrays([[*long, 300]]), "remote blocks")


def test_a_registration_names_no_block_only_when_every_group_is_empty_list_or_array() -> None:
    empty = np.empty(0, dtype=np.int64)
    assert names_no_block([]) and names_no_block([[]]) and names_no_block([[], empty])
    assert not names_no_block([[], [0]])  # block 0 is a block
    assert not names_no_block([np.zeros(1, dtype=np.int64)])  # an array of one 0: falsy, yet a block
    assert not names_no_block(id_arrays([list(range(100))]))  # an array whose truth numpy refuses


# ---------------------------------------------------------------- plan_write


def test_plan_pairs_blocks_one_to_one() -> None:
    lay = layout(region(8))
    plan = plan_write(lay, lay, [[5, 1, 7]], [[0, 2, 3]])
    assert pairs(plan) == [(5, 0), (1, 2), (7, 3)]
    assert plan.nbytes == 3 * 16
    assert plan.logical_blocks == 3


def test_plan_indices_are_int32() -> None:
    lay = layout(region(8))
    plan = plan_write(lay, lay, [[1]], [[2]])
    assert plan.src_indices.dtype == np.int32
    assert plan.dst_indices.dtype == np.int32


def test_plan_expands_logical_blocks_by_ratio() -> None:
    lay = layout(region(12, 8), per_logical=3)
    plan = plan_write(lay, lay, [[1, 3]], [[0, 2]])
    assert plan.src_indices.tolist() == [3, 4, 5, 9, 10, 11]
    assert plan.dst_indices.tolist() == [0, 1, 2, 6, 7, 8]
    assert plan.nbytes == 6 * 8
    assert plan.logical_blocks == 2


def test_plan_writes_tail_of_p_blocks_when_d_has_fewer() -> None:
    """A prefix-cache hit on D: only P's last blocks are written, in order."""
    lay = layout(region(16))
    plan = plan_write(lay, lay, [[10, 11, 12, 13]], [[4, 5]])
    assert pairs(plan) == [(12, 4), (13, 5)]
    assert plan.logical_blocks == 2


def test_plan_tail_selection_with_ratio() -> None:
    lay = layout(region(16), per_logical=2)
    plan = plan_write(lay, lay, [[1, 5, 7]], [[0]])
    assert pairs(plan) == [(14, 0), (15, 1)]


def test_plan_is_empty_when_d_needs_nothing() -> None:
    lay = layout(region(8))
    for dst_blocks in ([[]], []):
        plan = plan_write(lay, lay, [[1, 2]], dst_blocks)
        assert plan.src_indices.size == 0
        assert plan.dst_indices.size == 0
        assert plan.src_indices.dtype == np.int32
        assert plan.dst_indices.dtype == np.int32
        assert plan.nbytes == 0
        assert plan.logical_blocks == 0


def test_plan_rejects_d_asking_more_blocks_than_p_has() -> None:
    lay = layout(region(8))
    with pytest.raises(LayoutError, match="remote asks for 3 blocks, only 2 exist"):
        plan_write(lay, lay, [[1, 2]], [[0, 1, 2]])


def test_plan_rejects_d_blocks_in_group_p_left_empty() -> None:
    lay = layout(region(8), region(8, group=1))
    with pytest.raises(LayoutError, match="group 1"):
        plan_write(lay, lay, [[1]], [[1], [2]])


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "match"),
    [
        ([[8]], [[0]], "local blocks: group 0 names a block outside"),
        ([[-1]], [[0]], "local blocks"),
        ([[0, 0]], [[0, 1]], "local blocks: group 0 names a block twice"),
        ([[0]], [[4]], "remote blocks: group 0 names a block outside 0..3"),
        ([[0]], [[-1]], "remote blocks"),
        ([[0, 1]], [[2, 2]], "remote blocks: group 0 names a block twice"),
        ([[0], []], [[0]], "local blocks: 2 block groups"),
        ([[0]], [[0], []], "remote blocks: 2 block groups"),
    ],
)
def test_plan_rejects_bad_block_ids(src_blocks, dst_blocks, match: str) -> None:
    src = layout(region(8))
    dst = layout(region(4))
    with pytest.raises(LayoutError, match=match):
        plan_write(src, dst, src_blocks, dst_blocks)


def test_plan_offsets_indices_by_each_sides_own_region_sizes() -> None:
    """P and D need not allocate the same number of blocks per region."""
    src = layout(region(10, 16), region(10, 32), region(10, 8))
    dst = layout(region(4, 16), region(6, 32), region(5, 8))
    plan = plan_write(src, dst, [[7, 9]], [[0, 3]])
    assert plan.src_indices.tolist() == [7, 9, 17, 19, 27, 29]
    assert plan.dst_indices.tolist() == [0, 3, 4, 7, 10, 13]
    assert plan.nbytes == 2 * (16 + 32 + 8)
    assert plan.logical_blocks == 2


def test_plan_routes_each_region_by_its_group() -> None:
    src = layout(region(8, 16, group=0), region(6, 32, group=1), region(8, 16, group=0), per_logical=2)
    dst = layout(region(4, 16, group=0), region(10, 32, group=1), region(6, 16, group=0), per_logical=2)
    plan = plan_write(src, dst, [[2, 3], [0, 1, 2]], [[1], [4, 0]])
    # group 0: P tail [3] -> D [1]; group 1: P tail [1, 2] -> D [4, 0]
    assert pairs(plan) == [
        (6, 2), (7, 3),  # region 0 (group 0), offsets 0 / 0
        (8 + 2, 4 + 8), (8 + 3, 4 + 9), (8 + 4, 4 + 0), (8 + 5, 4 + 1),  # region 1 (group 1), offsets 8 / 4
        (14 + 6, 14 + 2), (14 + 7, 14 + 3),  # region 2 (group 0), offsets 14 / 14
    ]  # fmt: skip
    assert plan.nbytes == 2 * 16 + 4 * 32 + 2 * 16
    assert plan.logical_blocks == 3


def test_plan_skips_groups_d_did_not_list() -> None:
    lay = layout(region(8, group=0), region(8, 64, group=1))
    plan = plan_write(lay, lay, [[1], [2, 3]], [[5]])
    assert pairs(plan) == [(1, 5)]
    assert plan.nbytes == 16
    assert plan.logical_blocks == 1


def test_plan_pairs_only_descriptors_of_equal_length() -> None:
    src = layout(region(8, 16), region(8, 48, group=1), region(8, 16))
    dst = layout(region(5, 16), region(9, 48, group=1), region(3, 16))
    plan = plan_write(src, dst, [[0, 1], [2]], [[2], [8]])
    src_len = descriptor_table(src)[plan.src_indices, 1]
    dst_len = descriptor_table(dst)[plan.dst_indices, 1]
    assert src_len.tolist() == dst_len.tolist()
    assert int(src_len.sum()) == plan.nbytes


# ---------------------------------------------------------------- plan_write, property based


@st.composite
def plan_case(draw):
    per_logical = draw(st.integers(1, 3))
    n_regions = draw(st.integers(1, 4))
    src_regions, dst_regions = [], []
    for _ in range(n_regions):
        group = draw(st.integers(0, 2))
        block_len = draw(st.sampled_from([1, 8, 16, 24, 4096]))
        s_n = per_logical * draw(st.integers(1, 8)) + draw(st.integers(0, per_logical - 1))
        d_n = per_logical * draw(st.integers(1, 8)) + draw(st.integers(0, per_logical - 1))
        s_base = draw(st.integers(0, 2**40)) * 4096
        d_base = draw(st.integers(0, 2**40)) * 4096
        stride_pad = draw(st.sampled_from([0, 0, 64]))
        src_regions.append(RegionSpec(s_base, block_len, s_n, block_len + stride_pad, group))
        d_pad = draw(st.sampled_from([0, 32]))
        dst_regions.append(RegionSpec(d_base, block_len, d_n, block_len + d_pad, group))
    src = Layout(tuple(src_regions), per_logical)
    dst = Layout(tuple(dst_regions), per_logical)
    n_groups = draw(st.integers(1, src.groups))
    src_blocks, dst_blocks = [], []
    for g in range(n_groups):
        s_ids = draw(st.lists(st.integers(0, src.logical_blocks(g) - 1), unique=True)) if src.logical_blocks(g) else []
        d_limit = dst.logical_blocks(g)
        max_d = min(len(s_ids), d_limit)
        d_ids = draw(st.lists(st.integers(0, d_limit - 1), unique=True, max_size=max_d)) if max_d else []
        src_blocks.append(s_ids)
        dst_blocks.append(d_ids)
    return src, dst, src_blocks, dst_blocks


@settings(max_examples=300, deadline=None)
@given(case=plan_case())
def test_plan_matches_reference_model(case) -> None:
    src, dst, src_blocks, dst_blocks = case
    check_compatible(src, dst)
    plan = plan_write(src, dst, src_blocks, dst_blocks)

    expected: list[tuple[int, int]] = []
    expected_bytes = 0
    s_off = d_off = 0
    k = src.blocks_per_logical
    for s_reg, d_reg in zip(src.regions, dst.regions):
        g = s_reg.group
        s_ids = src_blocks[g] if g < len(src_blocks) else []
        d_ids = dst_blocks[g] if g < len(dst_blocks) else []
        tail = s_ids[len(s_ids) - len(d_ids) :] if d_ids else []
        for s, d in zip(tail, d_ids):
            for p in range(k):
                expected.append((s_off + s * k + p, d_off + d * k + p))
                expected_bytes += s_reg.block_len
        s_off += s_reg.num_blocks
        d_off += d_reg.num_blocks
    assert pairs(plan) == expected
    assert plan.nbytes == expected_bytes
    assert plan.logical_blocks == sum(len(ids) for ids in dst_blocks)

    # Every index lands inside its table, on a descriptor of the same length.
    s_table, d_table = descriptor_table(src), descriptor_table(dst)
    assert len(plan.src_indices) == len(plan.dst_indices)
    if len(plan.src_indices):
        assert plan.src_indices.min() >= 0 and plan.src_indices.max() < len(s_table)
        assert plan.dst_indices.min() >= 0 and plan.dst_indices.max() < len(d_table)
        assert s_table[plan.src_indices, 1].tolist() == d_table[plan.dst_indices, 1].tolist()
    # Each side writes/receives every descriptor at most once.
    assert len(set(plan.src_indices.tolist())) == len(plan.src_indices)
    assert len(set(plan.dst_indices.tolist())) == len(plan.dst_indices)
