"""The landing space (pure): geometry, slot allocation with backpressure, gather rows,
and the part split P's WRITEs and D's copies share."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pushsvc.errors import LayoutError
from pushsvc.state.landing import (
    AllocOutcome,
    CopyPlan,
    LandingGeometry,
    SlotAllocator,
    SlotRun,
    check_launch,
    check_pairs,
    copy_ranges,
    part_regions,
    parts_for,
    physical_blocks,
)
from pushsvc.state.layout import Layout, RegionSpec, descriptor_table, plan_write, split_plan

MiB = 1 << 20


def worker_layout(layers: int = 3, blocks: int = 40, block_len: int = 256, groups: int = 1, bpl: int = 1,
                  gap: int = 1 << 16) -> Layout:
    """FlashAttention-shaped: per layer a K and a V region, layers in separate allocations."""
    regions = []
    for layer in range(layers):
        base = (1 << 30) + layer * (2 * blocks * bpl * block_len + gap)
        for half in (0, 1):
            regions.append(RegionSpec(base + half * blocks * bpl * block_len, block_len, blocks * bpl, block_len,
                                      layer % groups))
    return Layout(tuple(regions), bpl)


# ---------------------------------------------------------------- geometry


def test_geometry_is_region_major_and_advertises_the_worker_shape() -> None:
    worker = worker_layout(layers=2, block_len=256)
    geometry = LandingGeometry.build(worker, 10 * 4 * 256 + 100)
    assert geometry.slots == 10 and geometry.slot_bytes == 4 * 256  # one slot: a block of each of 4 regions
    assert geometry.nbytes == 10 * 4 * 256
    landing = geometry.layout(base=0x1000)
    assert [r.block_len for r in landing.regions] == [r.block_len for r in worker.regions]
    assert [r.group for r in landing.regions] == [r.group for r in worker.regions]
    assert all(r.num_blocks == 10 and r.stride == 256 for r in landing.regions)
    # consecutive slots of a region are adjacent: a run of slots is one descriptor run
    table = descriptor_table(landing)
    assert [int(table[10 + s][0]) for s in (3, 4, 5)] == [0x1000 + 10 * 256 + s * 256 for s in (3, 4, 5)]


def test_geometry_with_groups_and_physical_blocks_covers_the_buffer_once() -> None:
    worker = worker_layout(layers=4, groups=2, bpl=2, block_len=128)
    geometry = LandingGeometry.build(worker, 1 * MiB)
    assert geometry.slots == MiB // (8 * 128 * 2)
    landing = geometry.layout(0)
    assert landing.logical_blocks(0) == landing.logical_blocks(1) == geometry.slots
    table = descriptor_table(landing)
    covered = np.zeros(geometry.nbytes, dtype=np.int32)
    for addr, length, _ in table:
        covered[int(addr):int(addr) + int(length)] += 1
    assert (covered == 1).all()


def test_geometry_that_holds_no_slot_is_refused() -> None:
    with pytest.raises(LayoutError, match="holds no slot"):
        LandingGeometry.build(worker_layout(), 100)


# ---------------------------------------------------------------- rows of the copy


@pytest.mark.parametrize("groups,bpl,block_len,parts", [(1, 1, 256, 1), (2, 1, 96, 3), (1, 2, 64, 4),
                                                        (2, 3, 40, 6)])
def test_copies_put_every_landed_block_where_a_direct_write_would(groups, bpl, block_len, parts) -> None:
    """Bytes WRITTEN into slots by P's plan (in parts) and copied part by part end up exactly
    where a WRITE straight into the worker's blocks would put them; no other byte moves."""
    blocks = 12
    worker = worker_layout(layers=3, blocks=blocks, block_len=block_len, groups=groups, bpl=bpl, gap=block_len * 7)
    origin = min(r.base for r in worker.regions)
    geometry = LandingGeometry.build(worker, 8 * bpl * sum(r.block_len for r in worker.regions) + 5)
    landing_layout = geometry.layout(0)
    plan = CopyPlan.build(worker, landing_layout)
    rng = np.random.default_rng(7)
    ids = [[9, 2, 5], [1, 7]][:groups]
    starts = [3, 1][:groups]
    slot_ids = [list(range(s, s + len(g))) for s, g in zip(starts, ids)]
    src_layout = Layout(tuple(RegionSpec(r.base, r.block_len, 64 * bpl, r.block_len, r.group)
                              for r in worker.regions), bpl)
    src_ids = [list(range(len(g))) for g in ids]
    write = plan_write(src_layout, landing_layout, src_ids, slot_ids)
    src_table, dst_table = descriptor_table(src_layout), descriptor_table(landing_layout)
    source = {int(src_table[i][0]): rng.integers(0, 256, int(src_table[i][1]), dtype=np.uint8).tobytes()
              for i in write.src_indices}
    landing = bytearray(geometry.nbytes)
    span = max(r.base + r.num_blocks * r.stride for r in worker.regions) - origin
    before = rng.integers(0, 256, span, dtype=np.uint8).tobytes()
    space = bytearray(before)
    for i, piece in enumerate(split_plan(write, parts)):
        for s_i, d_i in zip(piece.src_indices, piece.dst_indices):  # the part lands ...
            addr, length, _ = (int(x) for x in dst_table[d_i])
            landing[addr:addr + length] = source[int(src_table[s_i][0])]
        for g, g_ids in enumerate(ids):  # ... and is copied, as the daemon does it
            first, count = plan.span(part_regions(len(worker.regions), parts, i), g)
            slots = physical_blocks(range(starts[g], starts[g] + len(g_ids)), bpl)
            blocks = physical_blocks(g_ids, bpl)
            assert check_pairs(plan, first, count, slots, blocks) == ""
            for src, dst, n in zip(*copy_ranges(plan, first, count, slots, blocks)):
                space[dst - origin:dst - origin + n] = landing[src:src + n]
    expected = bytearray(before)
    direct = plan_write(src_layout, worker, src_ids, ids)
    worker_table = descriptor_table(worker)
    for s_i, d_i in zip(direct.src_indices, direct.dst_indices):
        addr, length, _ = (int(x) for x in worker_table[d_i])
        expected[addr - origin:addr - origin + length] = source[int(src_table[s_i][0])]
    assert space == expected


@pytest.mark.parametrize("groups,bpl", [(1, 1), (2, 2)])
def test_a_write_from_staging_sends_the_bytes_a_write_from_the_worker_would(groups, bpl) -> None:
    """P's staging copy (worker blocks -> slots), then a WRITE planned from the slots: the
    same source bytes, in the same order, as a WRITE planned from the worker's blocks."""
    worker = worker_layout(layers=3, blocks=12, block_len=64, groups=groups, bpl=bpl, gap=64 * 5)
    origin = min(r.base for r in worker.regions)
    geometry = LandingGeometry.build(worker, 8 * worker.bytes_per_logical_block)
    staging = geometry.layout(0)
    plan = CopyPlan.build_staging(worker, staging)
    rng = np.random.default_rng(3)
    span = max(r.base + r.num_blocks * r.stride for r in worker.regions) - origin
    kv = rng.integers(0, 256, span, dtype=np.uint8).tobytes()
    buf = bytearray(geometry.nbytes)
    ids = [[9, 2, 5], [1, 7]][:groups]
    starts = [4, 0][:groups]
    for g, g_ids in enumerate(ids):
        first, count = plan.span(range(len(worker.regions)), g)
        slots = physical_blocks(range(starts[g], starts[g] + len(g_ids)), bpl)
        blocks = physical_blocks(g_ids, bpl)
        assert check_pairs(plan, first, count, slots, blocks) == ""
        for src, dst, n in zip(*copy_ranges(plan, first, count, slots, blocks)):
            buf[dst:dst + n] = kv[src - origin:src - origin + n]
    remote = Layout(tuple(RegionSpec(r.base, r.block_len, 64 * bpl, r.block_len, r.group) for r in worker.regions),
                    bpl)
    dst_ids = [list(range(len(g))) for g in ids]
    slot_ids = [list(range(st, st + len(g))) for st, g in zip(starts, ids)]
    staged, direct = plan_write(staging, remote, slot_ids, dst_ids), plan_write(worker, remote, ids, dst_ids)
    assert list(staged.dst_indices) == list(direct.dst_indices)
    s_table, w_table = descriptor_table(staging), descriptor_table(worker)
    for si, wi in zip(staged.src_indices, direct.src_indices):
        (sa, sl, _), (wa, wl, _) = (tuple(int(x) for x in s_table[si]), tuple(int(x) for x in w_table[wi]))
        assert sl == wl and bytes(buf[sa:sa + sl]) == kv[wa - origin:wa - origin + wl]


def test_copy_width_is_the_widest_access_every_address_allows() -> None:
    worker = Layout((RegionSpec(1 << 20, 4096, 10, 8192, 0), RegionSpec((1 << 20) + 4096, 4096, 10, 8192, 0)))
    assert CopyPlan.build(worker, LandingGeometry.build(worker, MiB).layout(1 << 30)).width == 16
    odd = Layout((RegionSpec(1000, 12, 10, 12, 0), RegionSpec(2000, 12, 10, 12, 0)))
    assert CopyPlan.build(odd, LandingGeometry.build(odd, 10_000).layout(0)).width == 4  # gcd(12, 1000)
    assert CopyPlan.build(odd, LandingGeometry.build(odd, 10_000).layout(1)).width == 1  # landing at an odd address


def test_a_parts_regions_of_one_group_are_one_run_of_the_table() -> None:
    worker = worker_layout(layers=5, groups=2)  # regions alternate groups by layer
    plan = CopyPlan.build(worker, LandingGeometry.build(worker, MiB).layout(0))
    assert list(plan.group_of) == sorted(plan.group_of)
    for parts in (1, 2, 3, 10):
        for i in range(parts):
            regions = part_regions(len(worker.regions), parts, i)
            for g in range(2):
                first, count = plan.span(regions, g)
                want = [r for r in regions if worker.regions[r].group == g]
                assert list(plan.region_of[first:first + count]) == want


def test_pairs_the_kernel_would_skip_are_refused_before_a_launch() -> None:
    worker = worker_layout(layers=2, blocks=40)
    geometry = LandingGeometry.build(worker, 8 * 4 * 256)
    plan = CopyPlan.build(worker, geometry.layout(0))
    ok = np.array([2, 3, 4]), np.array([39, 0, 7])
    assert check_pairs(plan, 0, 4, *ok) == ""
    assert "not one run" in check_pairs(plan, 0, 4, np.array([2, 4, 5]), ok[1])
    assert "not one run" in check_pairs(plan, 0, 4, np.array([6, 7, 8]), ok[1])  # 8 slots only
    assert "outside the worker's KV" in check_pairs(plan, 0, 4, ok[0], np.array([40, 0, 7]))
    assert "outside the worker's KV" in check_pairs(plan, 0, 4, ok[0], np.array([-1, 0, 7]))
    assert "2 landing slots for 3 blocks" in check_pairs(plan, 0, 4, ok[0][:2], ok[1])
    assert "copy entries" in check_pairs(plan, 2, 4, *ok)
    # and what the kernel would do with them anyway: nothing out of range
    src, dst, n = copy_ranges(plan, 0, 4, np.array([7, 8]), np.array([40, 3]))
    assert len(src) == 0


def test_a_launch_names_entries_of_the_group_its_slots_were_mapped_for() -> None:
    worker = worker_layout(layers=3, groups=2)
    plan = CopyPlan.build(worker, LandingGeometry.build(worker, MiB).layout(0))
    g0, g1 = plan.group_span(0), plan.group_span(1)
    assert g0 == (0, 4) and g1 == (4, 2)  # layers 0 and 2 are group 0: their K and V
    run = SlotRun(0, 3, 2)
    assert check_launch(plan, run, *g0) == "" and check_launch(plan, run, 1, 2) == ""
    assert "not all of group 0" in check_launch(plan, run, *g1)
    assert "not all of group 0" in check_launch(plan, run, 2, 3)  # runs into group 1
    assert "copy entries" in check_launch(plan, run, 5, 2)
    assert check_launch(plan, SlotRun(0, 0, 0), 5, 2) == "", "nothing mapped: nothing to launch"
    # span and max_bytes answer the same question from what they found before
    assert plan.span(range(0, 3), 1) == plan.span(range(0, 3), 1) and plan.max_bytes(0, 4) == 256


# ---------------------------------------------------------------- parts


@given(st.integers(1, 300), st.integers(1, 40))
def test_part_regions_cover_each_region_once(n: int, k: int) -> None:
    seen = []
    for i in range(k):
        seen += part_regions(n, k, i)
    assert seen == list(range(n))


def test_parts_for_size_and_bounds() -> None:
    assert parts_for(256 * MiB, 16 * MiB, 64) == 16
    assert parts_for(8 << 30, 16 * MiB, 64) == 32  # at most 32
    assert parts_for(64 * MiB, 16 * MiB, 2) == 2  # never more than the regions
    assert parts_for(1 * MiB, 16 * MiB, 64) == 1
    assert parts_for(64 * MiB, 0, 64) == 1  # parts off


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=2), st.integers(1, 8), st.integers(1, 3))
def test_split_plan_keeps_every_pair_once_in_its_part(counts, parts, bpl) -> None:
    groups = len(counts)
    regions = tuple(RegionSpec(i << 16, 32, 40 * bpl, 32, i % groups) for i in range(2 * groups))
    layout = Layout(regions, bpl)
    src_ids = [list(range(10)) for _ in counts]
    dst_ids = [list(range(20, 20 + n)) for n in counts]
    plan = plan_write(layout, layout, src_ids, dst_ids)
    pieces = split_plan(plan, parts)
    assert len(pieces) == parts
    joined = sorted(zip(np.concatenate([p.src_indices for p in pieces]).tolist(),
                        np.concatenate([p.dst_indices for p in pieces]).tolist()))
    assert joined == sorted(zip(plan.src_indices.tolist(), plan.dst_indices.tolist()))
    assert sum(p.nbytes for p in pieces) == plan.nbytes
    # Each part is one run of the plan, in its order (views, not copies).
    assert np.concatenate([p.src_indices for p in pieces]).tolist() == plan.src_indices.tolist()
    assert np.concatenate([p.dst_indices for p in pieces]).tolist() == plan.dst_indices.tolist()
    for i, piece in enumerate(pieces):
        mine = part_regions(len(regions), parts, i)
        assert set(np.flatnonzero(np.diff(piece.edges)).tolist()) <= set(mine)
        assert piece.edges[mine.start] == 0 and piece.edges[-1] == len(piece.src_indices)
        assert piece.nbytes == int(piece.region_bytes.sum()) == 32 * len(piece.src_indices)


# ---------------------------------------------------------------- allocator


def test_allocator_grants_contiguous_ranges_and_queues_in_order() -> None:
    alloc = SlotAllocator(groups=1, slots=10)
    assert alloc.request("a", [4])[1].starts == (0,)
    assert alloc.request("b", [4])[1].starts == (4,)
    outcome, grant = alloc.request("c", [4])
    assert outcome is AllocOutcome.QUEUED and grant is None
    # d would fit (2 free), but c waits first: no overtaking
    assert alloc.request("d", [2])[0] is AllocOutcome.QUEUED
    served = alloc.release("a")
    assert [g.key for g in served] == ["c", "d"]  # c takes 0..3, then d fits in 8..9
    assert alloc.grant("c").starts == (0,) and alloc.grant("d").starts == (8,)
    assert alloc.used == 10 and alloc.queued == 0


def test_allocator_refuses_what_can_never_fit_and_duplicates() -> None:
    alloc = SlotAllocator(groups=2, slots=8)
    assert alloc.request("big", [9, 0])[0] is AllocOutcome.TOO_LARGE
    assert alloc.request("three", [1, 1, 1])[0] is AllocOutcome.TOO_LARGE
    assert alloc.request("a", [2, 3])[0] is AllocOutcome.GRANTED
    assert alloc.request("a", [1])[0] is AllocOutcome.DUPLICATE
    assert alloc.used == 5 and alloc.capacity == 16


def test_allocator_waits_for_contiguous_space_and_coalesces() -> None:
    alloc = SlotAllocator(groups=1, slots=6)
    for key in "abc":
        alloc.request(key, [2])
    alloc.release("a")
    alloc.release("c")
    assert alloc.request("d", [4])[0] is AllocOutcome.QUEUED  # 4 free, but not in one piece
    assert [g.key for g in alloc.release("b")] == ["d"]
    assert alloc.grant("d").starts == (0,)


def test_withdrawn_waiter_lets_the_next_one_in() -> None:
    alloc = SlotAllocator(groups=1, slots=4)
    alloc.request("a", [3])
    alloc.request("big", [4])
    alloc.request("small", [1])
    assert [g.key for g in alloc.release("big")] == ["small"]  # big leaves the queue
    assert not alloc.waiting("big") and alloc.grant("small") is not None


class AllocatorMachine(RuleBasedStateMachine):
    """Grants never overlap, a waiter is never passed over, nothing is lost."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(groups=2, slots=12)
        self.next = 0
        self.order: list[str] = []  # waiters, in arrival order

    @rule(a=st.integers(0, 6), b=st.integers(0, 6))
    def request(self, a: int, b: int) -> None:
        key = f"r{self.next}"
        self.next += 1
        waiting = bool(self.order)
        outcome, _ = self.alloc.request(key, [a, b])
        if waiting:
            assert outcome is AllocOutcome.QUEUED  # nobody overtakes a waiter
        if outcome is AllocOutcome.QUEUED:
            self.order.append(key)
        else:
            assert outcome is AllocOutcome.GRANTED

    @precondition(lambda self: len(self.alloc) or self.order)
    @rule(data=st.data())
    def release(self, data) -> None:
        keys = sorted(self.alloc._grants) + self.order
        key = data.draw(st.sampled_from(keys))
        if key in self.order:
            self.order.remove(key)
        served = [g.key for g in self.alloc.release(key)]
        assert served == self.order[:len(served)]  # in arrival order
        del self.order[:len(served)]

    @invariant()
    def grants_disjoint(self) -> None:
        for g in range(2):
            used = np.zeros(12, dtype=np.int32)
            for grant in self.alloc._grants.values():
                used[grant.starts[g]:grant.starts[g] + grant.counts[g]] += 1
            assert used.max(initial=0) <= 1
            assert int(used.sum()) == sum(gr.counts[g] for gr in self.alloc._grants.values())
        assert self.alloc.queued == len(self.order)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
