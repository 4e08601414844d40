"""KV layouts and WRITE planning: which local descriptor goes to which remote one.

A layout is the ordered list of a rank's regions. Both sides build a NIXL descriptor
list of every block of every region in that order (``descriptor_table``), once; a
WRITE then names blocks by index into the two lists (``plan_write``). Scheduler block
ids are logical; each logical block is ``blocks_per_logical`` physical kernel blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from pushsvc.errors import LayoutError

# Block descriptors one agent may describe (24 bytes each in a prepared list). A
# 128-layer model with 64k blocks per layer and separate K/V regions fits. Measured on
# a 2-core host: building and preparing a list of 2^22 descriptors takes ~0.5 s of the
# event loop, so 2^24 costs ~2 s, which stays under the 5 s peer timeout.
MAX_DESCRIPTORS = 1 << 24


@dataclass(frozen=True, slots=True)
class RegionSpec:
    base: int
    block_len: int
    num_blocks: int
    stride: int
    group: int = 0
    heads: int = 0  # KV heads stored outermost in each block (head-major); 0: not split-able
    replicated: bool = False  # every TP rank holds the same bytes here (MLA): written by one P rank


@dataclass(frozen=True, slots=True)
class _Columns:
    offsets: np.ndarray  # int64: the descriptor index of each region's block 0
    block_lens: np.ndarray  # int64
    by_group: dict[int, np.ndarray]  # group -> its region indices, groups in order of first region
    group_bytes: dict[int, int]  # group -> bytes of one block in every region of it


@dataclass(frozen=True)
class Layout:
    regions: tuple[RegionSpec, ...]
    blocks_per_logical: int = 1

    @cached_property
    def _columns(self) -> _Columns:
        """The regions as arrays, built once per layout (planning a WRITE reads them)."""
        counts = np.fromiter((r.num_blocks for r in self.regions), dtype=np.int64, count=len(self.regions))
        groups = np.fromiter((r.group for r in self.regions), dtype=np.int64, count=len(self.regions))
        lens = np.fromiter((r.block_len for r in self.regions), dtype=np.int64, count=len(self.regions))
        offsets = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
        order = list(dict.fromkeys(int(g) for g in groups))  # groups in order of first region
        by_group = {g: np.flatnonzero(groups == g) for g in order}
        return _Columns(offsets, lens, by_group, {g: int(lens[regs].sum()) for g, regs in by_group.items()})

    @cached_property
    def _logical(self) -> dict[int, int]:
        """Group -> logical blocks every region of it can hold: one walk over the regions
        per layout (a plan asks for every group twice)."""
        fewest: dict[int, int] = {}
        for r in self.regions:
            fewest[r.group] = min(fewest.get(r.group, r.num_blocks), r.num_blocks)
        return {g: n // self.blocks_per_logical for g, n in fewest.items()}

    @property
    def groups(self) -> int:
        return 1 + max(self._logical, default=0)

    def logical_blocks(self, group: int) -> int:
        """Logical blocks every region of ``group`` can hold."""
        return self._logical.get(group, 0)

    @property
    def total_descriptors(self) -> int:
        return sum(r.num_blocks for r in self.regions)

    @property
    def bytes_per_logical_block(self) -> int:
        return sum(r.block_len for r in self.regions) * self.blocks_per_logical


def head_slice(layout: Layout, parts: int, index: int, between: str = "P ranks") -> Layout:
    """Slice ``index`` of ``parts`` of every block: the KV heads ``index*h/parts`` up to
    ``(index+1)*h/parts`` of a head-major block of ``h`` heads, a contiguous byte range.
    It is what one of ``parts`` P ranks (P TP = parts x D TP) holds of a D rank's block.
    A region whose blocks are not head-major, or whose heads do not split evenly, cannot
    be sliced: a head-interleaved block (NHD) would need a descriptor per token. ``between``
    names who the parts are for, in the error."""
    if parts == 1:
        return layout
    if not 0 <= index < parts:
        raise LayoutError(f"head slice {index} of {parts}")
    out = []
    for i, r in enumerate(layout.regions):
        if r.heads <= 1:
            raise LayoutError(f"region {i}: blocks are not head-major, they cannot be split between {parts} {between}")
        if r.heads % parts or r.block_len % r.heads:
            raise LayoutError(f"region {i}: {r.heads} KV heads of a {r.block_len}-byte block do not split "
                              f"between {parts} {between}")
        length = r.block_len // parts
        out.append(RegionSpec(r.base + index * length, length, r.num_blocks, r.stride, r.group, r.heads // parts))
    return Layout(tuple(out), layout.blocks_per_logical)


def source_view(layout: Layout, parts: int, index: int) -> Layout:
    """What the ``index``-th of the ``parts`` P ranks that fill a D rank's blocks (P TP =
    parts x D TP, ``state/tp.py``) writes of ``layout``, D's: all of it at equal TP; the
    head slice ``index`` otherwise; replicated KV (MLA) whole, by the first of them only."""
    if parts > 1 and replicated(layout):
        if index != 0:
            raise LayoutError(f"replicated KV (MLA) is written by the first of {parts} P ranks only, "
                              f"not by the one of slice {index}")
        return layout
    return head_slice(layout, parts, index)


def joint_source(layout: Layout, members: int) -> Layout:
    """What a P rank writes of its own blocks into a D joint agent of ``members`` D ranks
    (D TP = members x P TP, ``state/tp.py``), whose regions are each member's in turn:
    head slice ``j`` of every region for member ``j``, the members one after the other;
    replicated KV (MLA) whole to every member."""
    if members == 1:
        return layout
    if replicated(layout):
        return Layout(layout.regions * members, layout.blocks_per_logical)
    sliced = [head_slice(layout, members, j, "D ranks").regions for j in range(members)]
    return Layout(tuple(r for regions in sliced for r in regions), layout.blocks_per_logical)


def joined(layouts: list[Layout]) -> Layout:
    """The layout of a joint agent: the members' regions, member after member (every
    member's blocks count the same: vLLM's one scheduler gives them the same ids)."""
    per = {m.blocks_per_logical for m in layouts}
    if len(per) != 1:
        raise LayoutError(f"members' kernel blocks per logical block differ: {sorted(per)}")
    return Layout(tuple(r for m in layouts for r in m.regions), per.pop())


def replicated(layout: Layout) -> bool:
    """Every region holds bytes every TP rank has too (MLA's latent rows)."""
    return bool(layout.regions) and all(r.replicated for r in layout.regions)


def descriptor_table(layout: Layout, device_id: int = 0) -> np.ndarray:
    """Nx3 uint64 array (address, length, device) of every block of every region."""
    parts = []
    for r in layout.regions:
        rows = np.empty((r.num_blocks, 3), dtype=np.uint64)
        rows[:, 0] = r.base + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.stride)
        rows[:, 1] = r.block_len
        rows[:, 2] = device_id
        parts.append(rows)
    return np.concatenate(parts) if parts else np.empty((0, 3), dtype=np.uint64)


def check_compatible(src: Layout, dst: Layout) -> None:
    """P and D must pair region i with region i, same page size and group."""
    if src.blocks_per_logical != dst.blocks_per_logical:
        raise LayoutError(
            f"kernel blocks per logical block differ: local {src.blocks_per_logical}, "
            f"remote {dst.blocks_per_logical}"
        )
    if len(src.regions) != len(dst.regions):
        raise LayoutError(f"region count differs: local {len(src.regions)}, remote {len(dst.regions)}")
    for i, (s, d) in enumerate(zip(src.regions, dst.regions)):
        if s.block_len != d.block_len:
            raise LayoutError(f"region {i}: kernel block length differs ({s.block_len} vs {d.block_len})")
        if s.group != d.group:
            raise LayoutError(f"region {i}: KV group differs ({s.group} vs {d.group})")


# Up to this many ids a group is checked with Python's builtins; above, with numpy, which
# needs ~60 us to read a list of 4096 ints but then ~15 us to check them (the builtins:
# ~170 us), and nothing to read an array (packed ids, ``protocol/worker.unpack_ids``).
_CHECK_BY_BUILTINS = 64


def check_block_ids(layout: Layout, block_ids: Sequence[Sequence[int]], who: str) -> None:
    """Every id in range for its group, no id twice: else nothing may be written. A
    group is a list of ints or an integer array."""
    if len(block_ids) > layout.groups:
        raise LayoutError(f"{who}: {len(block_ids)} block groups, layout has {layout.groups}")
    for g, ids in enumerate(block_ids):
        n = len(ids)
        if not n:
            continue
        limit = layout.logical_blocks(g)
        if n <= _CHECK_BY_BUILTINS and not isinstance(ids, np.ndarray):
            low, high, twice = min(ids), max(ids), len(set(ids)) != n
        else:
            ordered = np.sort(np.asarray(ids, dtype=np.int64))
            low, high = int(ordered[0]), int(ordered[-1])
            twice = bool((ordered[1:] == ordered[:-1]).any())
        if low < 0 or high >= limit:
            raise LayoutError(f"{who}: group {g} names a block outside 0..{limit - 1}")
        if twice:
            raise LayoutError(f"{who}: group {g} names a block twice")


def id_arrays(block_ids: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """``block_ids`` with each group of more than 64 ids as an int64 array, the shorter ones
    as they are: for ids a daemon checks and pairs more than once (D's ``PUSH_REG`` at P:
    once its sender is known, again when it is matched and planned). ``check_block_ids`` turns a long
    list into an array each time it looks; ``pair_blocks`` and ``plan_write`` too."""
    return [np.fromiter(ids, dtype=np.int64, count=len(ids))
            if len(ids) > _CHECK_BY_BUILTINS and not isinstance(ids, np.ndarray) else ids for ids in block_ids]


def names_no_block(block_ids: Sequence[Sequence[int]]) -> bool:
    """Whether no group of ``block_ids`` names a block: a registration that only releases
    its exchange. Groups may be lists or arrays (``id_arrays``), so it asks their lengths,
    never their truth."""
    return not any(len(ids) for ids in block_ids)


@dataclass(frozen=True, slots=True)
class WritePlan:
    src_indices: np.ndarray  # int32 indices into the source descriptor table
    dst_indices: np.ndarray
    nbytes: int
    logical_blocks: int
    # The pairs are listed region by region: region r's are ``edges[r]:edges[r + 1]``
    # (empty for a region with none), and it carries ``region_bytes[r]`` (what
    # ``split_plan`` cuts by, and what layer-wise push posts region by region).
    edges: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    region_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def region_count(self) -> int:
        return len(self.edges) - 1


def _expand(ids: Sequence[int], per_logical: int) -> np.ndarray:
    # int32 throughout: a layout holds at most MAX_DESCRIPTORS (2^24) descriptors, and the
    # ids were checked against it (check_block_ids).
    if per_logical == 1:  # the usual case, one kernel block per logical block: no arithmetic
        return np.asarray(ids, dtype=np.int32)
    base = np.asarray(ids, dtype=np.int32) * np.int32(per_logical)
    return (base[:, None] + np.arange(per_logical, dtype=np.int32)).reshape(-1)


def dest_indices(dst: Layout, dst_blocks: list[list[int]]) -> np.ndarray:
    """D's descriptor indices for ``dst_blocks``, in the order ``plan_write`` pairs them
    (regions in order, blocks in order): what D's daemon checks a WRITE against."""
    cols = dst._columns
    pieces = []
    for g, regs in cols.by_group.items():
        ids = dst_blocks[g] if g < len(dst_blocks) else []
        if ids:
            phys = _expand(ids, dst.blocks_per_logical)
            pieces.append((np.repeat(regs, len(phys)), (cols.offsets[regs][:, None] + phys).reshape(-1)))
    if not pieces:
        return np.empty(0, dtype=np.int32)
    regions, idx = (np.concatenate(p) for p in zip(*pieces))
    if len(pieces) > 1:
        idx = idx[np.argsort(regions, kind="stable")]
    return idx.astype(np.int32)



def _tails(src: Layout, dst: Layout, src_blocks: list[list[int]], dst_blocks: list[list[int]], paired: int):
    """Per group with blocks to move, in order of its first region: (group, its regions
    below ``paired``, P's physical blocks, D's), D's blocks taking P's last ones in order (a
    prefix hit on D). D asking for more blocks than P has is an error."""
    every = paired >= len(src.regions)
    for g, regs in src._columns.by_group.items():
        if not every:
            regs = regs[regs < paired]
            if not len(regs):
                continue
        s_ids = src_blocks[g] if g < len(src_blocks) else []
        d_ids = dst_blocks[g] if g < len(dst_blocks) else []
        if len(d_ids) > len(s_ids):
            raise LayoutError(f"group {g}: remote asks for {len(d_ids)} blocks, only {len(s_ids)} exist")
        if len(d_ids):
            yield g, regs, _expand(s_ids[len(s_ids) - len(d_ids):], src.blocks_per_logical), _expand(
                d_ids, dst.blocks_per_logical)


def plan_write(
    src: Layout, dst: Layout, src_blocks: list[list[int]], dst_blocks: list[list[int]]
) -> WritePlan:
    """Pair P's blocks with D's blocks, region by region.

    D may have allocated fewer blocks than P holds (a prefix-cache hit on D): then only
    P's last ``len(dst)`` blocks of that group are written, into D's blocks in order.
    D asking for more blocks than P has is an error: some of D's KV would stay unwritten.
    """
    check_block_ids(src, src_blocks, "local blocks")
    check_block_ids(dst, dst_blocks, "remote blocks")
    s_cols, d_cols = src._columns, dst._columns
    paired = min(len(src.regions), len(dst.regions))  # regions pair by position
    # Every region of a group moves the same blocks: expand them once per group and place
    # them in all of its regions at once (one array operation per group, not per region).
    pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (regions, src, dst) per group, a row per region
    counts = np.zeros(len(dst.regions), dtype=np.int64)  # pairs per region
    for g, regs, s_phys, d_phys in _tails(src, dst, src_blocks, dst_blocks, paired):
        counts[regs] = len(d_phys)
        pieces.append((regs, s_cols.offsets[regs].astype(np.int32)[:, None] + s_phys,
                       d_cols.offsets[regs].astype(np.int32)[:, None] + d_phys))
    logical = sum(len(dst_blocks[g]) for g in range(len(dst_blocks)))
    region_bytes = counts.copy()
    region_bytes[:paired] *= s_cols.block_lens[:paired]
    edges = np.concatenate(([0], np.cumsum(counts)))
    if not pieces:
        empty = np.empty(0, dtype=np.int32)
        return WritePlan(empty, empty, 0, logical, edges, region_bytes)
    if len(pieces) == 1:
        _, src_rows, dst_rows = pieces[0]
        src_idx, dst_idx = src_rows.reshape(-1), dst_rows.reshape(-1)
    else:  # groups interleave across regions: their rows back in region order
        rows = sorted((int(r), s_row, d_row) for regs, s2, d2 in pieces for r, s_row, d_row in zip(regs, s2, d2))
        src_idx = np.concatenate([row[1] for row in rows])
        dst_idx = np.concatenate([row[2] for row in rows])
    return WritePlan(src_indices=src_idx, dst_indices=dst_idx, nbytes=int(region_bytes.sum()),
                     logical_blocks=logical, edges=edges, region_bytes=region_bytes)


@dataclass(frozen=True, slots=True)
class BlockPairs:
    """P's copy of one request into a same-host D's KV (``devmem`` pair copies): per KV
    group, P's physical blocks and D's, pairwise (every region of a group moves the same
    blocks)."""

    groups: tuple[tuple[int, np.ndarray, np.ndarray], ...]  # (group, P's blocks, D's blocks)
    nbytes: int
    logical_blocks: int


def pair_blocks(src: Layout, dst: Layout, src_blocks: list[list[int]], dst_blocks: list[list[int]]) -> BlockPairs:
    """``plan_write``'s pairing, per group instead of per descriptor: D's blocks take P's
    last ``len(dst)`` blocks of the group, in order (a prefix hit on D); D asking for more
    blocks than P has is an error. The layouts were found compatible, and both sides' ids
    checked (``check_block_ids``), before: this is on the path of every same-host push."""
    groups, nbytes = [], 0
    for g, regs, s_phys, d_phys in _tails(src, dst, src_blocks, dst_blocks, len(src.regions)):
        groups.append((int(g), s_phys.astype(np.int64), d_phys.astype(np.int64)))
        nbytes += len(d_phys) * src._columns.group_bytes[g]
    logical = sum(len(ids) for ids in dst_blocks)
    return BlockPairs(tuple(groups), nbytes, logical)


def part_run(plan: WritePlan, parts: int, i: int) -> tuple[range, slice]:
    """Part ``i`` of ``parts`` of ``plan``: its regions (``part_regions``) and the run of
    the plan's pairs they hold (the plan lists its pairs in region order)."""
    part = part_regions(plan.region_count, parts, i)
    return part, slice(int(plan.edges[part.start]), int(plan.edges[part.stop]))


def split_plan(plan: WritePlan, parts: int) -> list[WritePlan]:
    """Cut ``plan`` into ``parts`` WRITEs by region: part ``i`` carries every pair of the
    regions ``part_regions(region_count, parts, i)``. D cuts its copies the same way.

    ``plan_write`` lists the pairs in region order, so each part is one run of the plan
    (views, not copies); a part's ``edges`` still number every region, those of other
    parts empty."""
    if parts <= 1:
        return [plan]
    regions, edges = plan.region_count, plan.edges
    out = []
    for i in range(parts):
        part, run = part_run(plan, parts, i)
        a, b = run.start, run.stop
        mine = np.zeros(regions, dtype=np.int64)
        mine[part.start:part.stop] = plan.region_bytes[part.start:part.stop]
        out.append(WritePlan(plan.src_indices[a:b], plan.dst_indices[a:b], int(mine.sum()),
                             plan.logical_blocks if i == 0 else 0, np.clip(edges - a, 0, b - a), mine))
    return out


def slice_cuts(plan: WritePlan, max_bytes: int) -> tuple[int, ...]:
    """Where to cut ``plan``'s pairs into runs of about ``max_bytes`` each (at most
    ``max_bytes`` plus one pair; every run holds at least one pair): the pair indices
    ``(0, ..., len)``. One run where ``max_bytes`` is 0 or the plan fits in it."""
    n = len(plan.src_indices)
    if max_bytes <= 0 or plan.nbytes <= max_bytes or n <= 1:
        return (0, n)
    counts = np.diff(plan.edges)
    ends = np.cumsum(np.repeat(plan.region_bytes // np.maximum(counts, 1), counts))
    # A run ends with the last pair that ends by the next multiple of max_bytes.
    cuts = np.searchsorted(ends, np.arange(max_bytes, int(ends[-1]), max_bytes), side="right")
    return tuple(int(c) for c in np.unique(np.concatenate(([0], cuts, [n]))))


def part_regions(regions: int, parts: int, i: int) -> range:
    """The regions part ``i`` of ``parts`` of a WRITE carries."""
    return range(regions * i // parts, regions * (i + 1) // parts)
