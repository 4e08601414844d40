"""``plan_write`` and ``dest_indices`` plan per KV group with array operations. They must
pair exactly what the region-by-region planning they replaced paired (kept here as the
reference), for any layout: interleaved groups, several physical blocks per logical block,
prefix hits on D, groups without blocks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.errors import LayoutError
from pushsvc.state.layout import Layout, RegionSpec, dest_indices, plan_write


def _expand(ids: list[int], per: int) -> np.ndarray:
    return (np.asarray(ids, dtype=np.int64)[:, None] * per + np.arange(per)).reshape(-1)


def reference(src: Layout, dst: Layout, src_blocks: list[list[int]], dst_blocks: list[list[int]]):
    """Region by region, as plan_write did before it was vectorized."""
    s_out, d_out, regs, lens, nbytes = [], [], [], [], 0
    s_off = d_off = 0
    for i, (s, d) in enumerate(zip(src.regions, dst.regions)):
        s_ids = src_blocks[s.group] if s.group < len(src_blocks) else []
        d_ids = dst_blocks[s.group] if s.group < len(dst_blocks) else []
        if len(d_ids) > len(s_ids):
            raise LayoutError("more remote blocks")
        if d_ids:
            sp = _expand(s_ids[len(s_ids) - len(d_ids):], src.blocks_per_logical)
            dp = _expand(d_ids, dst.blocks_per_logical)
            s_out.append(sp + s_off)
            d_out.append(dp + d_off)
            regs.append(np.full(len(dp), i))
            lens.append(np.full(len(dp), s.block_len))
            nbytes += s.block_len * len(sp)
        s_off += s.num_blocks
        d_off += d.num_blocks
    cat = (lambda xs: np.concatenate(xs) if xs else np.empty(0, dtype=np.int64))
    return cat(s_out), cat(d_out), cat(regs), cat(lens), nbytes


@st.composite
def layouts(draw):
    per = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    n_regions = draw(st.integers(1, 12))
    region_groups = draw(st.lists(st.integers(0, groups - 1), min_size=n_regions, max_size=n_regions))
    logical = [draw(st.integers(2, 10)) for _ in range(groups)]

    def layout(extra: int) -> Layout:
        regions, base = [], 0
        for g in region_groups:
            blocks = (logical[g] + extra) * per
            bl = draw(st.sampled_from([16, 64, 256]))
            regions.append(RegionSpec(base, bl, blocks, bl, g))
            base += blocks * bl
        return Layout(tuple(regions), per)

    src, dst = layout(0), layout(draw(st.integers(0, 3)))
    src_blocks, dst_blocks = [], []
    for g in range(max(region_groups) + 1):  # as many lists as the layout has groups
        if g not in region_groups:
            src_blocks.append([])
            dst_blocks.append([])
            continue
        s_ids = draw(st.lists(st.integers(0, logical[g] - 1), unique=True, max_size=logical[g]))
        d_ids = draw(st.lists(st.integers(0, logical[g] - 1), unique=True, max_size=len(s_ids)))
        src_blocks.append(s_ids)
        dst_blocks.append(d_ids)
    return src, dst, src_blocks, dst_blocks


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_plan_write_pairs_what_region_by_region_planning_paired(case) -> None:
    src, dst, src_blocks, dst_blocks = case
    s_ref, d_ref, r_ref, l_ref, n_ref = reference(src, dst, src_blocks, dst_blocks)
    plan = plan_write(src, dst, src_blocks, dst_blocks)
    assert plan.src_indices.tolist() == s_ref.tolist()
    assert plan.dst_indices.tolist() == d_ref.tolist()
    # Region r's pairs are plan[edges[r]:edges[r + 1]], and it carries region_bytes[r].
    assert np.repeat(np.arange(plan.region_count), np.diff(plan.edges)).tolist() == r_ref.tolist()
    ref_bytes = np.bincount(r_ref.astype(np.int64), weights=l_ref, minlength=len(dst.regions)) if len(r_ref) else \
        np.zeros(len(dst.regions))
    assert plan.region_bytes.tolist() == ref_bytes.astype(np.int64).tolist()
    assert plan.nbytes == n_ref and plan.region_count == len(dst.regions)
    assert plan.src_indices.dtype == np.int32 and plan.dst_indices.dtype == np.int32
    assert dest_indices(dst, dst_blocks).tolist() == d_ref.tolist()


def test_interleaved_groups_keep_region_order_and_block_order() -> None:
    regions = tuple(RegionSpec(i * 1000, 10, 8, 10, g) for i, g in enumerate([0, 1, 0, 1]))
    layout = Layout(regions)
    plan = plan_write(layout, layout, [[5, 2], [7]], [[1, 3], [0]])
    # region 0 (group 0): P 5,2 -> D 1,3; region 1 (group 1): 7 -> 0; region 2: 5,2; region 3: 7.
    assert plan.src_indices.tolist() == [5, 2, 8 + 7, 16 + 5, 16 + 2, 24 + 7]
    assert plan.dst_indices.tolist() == [1, 3, 8 + 0, 16 + 1, 16 + 3, 24 + 0]
    assert plan.edges.tolist() == [0, 2, 3, 5, 6] and plan.region_bytes.tolist() == [20, 10, 20, 10]


def test_more_remote_blocks_than_local_is_refused_naming_the_group() -> None:
    layout = Layout((RegionSpec(0, 10, 8, 10, 0), RegionSpec(80, 10, 8, 10, 1)))
    with pytest.raises(LayoutError, match="group 1: remote asks for 2 blocks, only 1 exist"):
        plan_write(layout, layout, [[1], [2]], [[1], [3, 4]])
