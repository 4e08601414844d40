"""Landing space on D (pure): where WRITEs for a GPU worker land before D's daemon copies
them into the worker's KV (docs/gpu.md).

* ``LandingGeometry``: the landing buffer's layout for a worker layout: every region of
  the worker gets a dense area of ``slots`` logical blocks (region-major). A request's
  slots are one contiguous range per region, so a WRITE from contiguous P blocks is one
  descriptor run per region (NIXL merges adjacent descriptors; a WRITE of scattered 32 KiB
  descriptors ran 300x slower on one H200). ``layout(base)`` is what D advertises to P
  instead of the worker's layout.
* ``SlotAllocator``: contiguous slot ranges per KV group, first fit, waiting requests
  served strictly in arrival order (a large request is never overtaken for good). It never
  hands out a slot another grant holds.
* ``CopyPlan`` / ``copy_ranges`` / ``check_pairs``: the copy from the landing slots of a
  request into the worker's blocks, one table entry per region, as the copy kernel reads it
  (``copy_ranges`` is what the kernel does, for the fake device and the tests).
* ``part_regions`` / ``parts_for``: a WRITE split into parts by region (layer), so each
  part keeps its descriptor runs whole; P and D cut the same way.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from pushsvc.errors import LayoutError
from pushsvc.state.layout import Layout, RegionSpec, part_regions

__all__ = ["part_regions"]  # the split P's WRITEs and D's copies share

MAX_PARTS = 32


def parts_for(nbytes: int, part_bytes: int, regions: int, max_parts: int = MAX_PARTS) -> int:
    """How many parts a WRITE of ``nbytes`` is split into: about ``part_bytes`` each, at
    most ``max_parts``, and never more than the regions it covers (a part is at least a
    whole region)."""
    if part_bytes <= 0 or regions <= 1:
        return 1
    return max(1, min(max_parts, regions, -(-nbytes // part_bytes)))


# ---------------------------------------------------------------- geometry


@dataclass(frozen=True, slots=True)
class LandingGeometry:
    worker: Layout
    slots: int  # logical blocks per region (every group has this many)
    offsets: tuple[int, ...]  # per region: where its area starts in the buffer

    @classmethod
    def build(cls, worker: Layout, budget_bytes: int) -> LandingGeometry:
        """As many slots as ``budget_bytes`` holds."""
        bpl = worker.blocks_per_logical
        per_slot = sum(r.block_len for r in worker.regions) * bpl
        slots = budget_bytes // per_slot if per_slot else 0
        if slots < 1:
            raise LayoutError(f"landing space of {budget_bytes} bytes holds no slot of {per_slot} bytes "
                              "(one block of every layer)")
        offsets, at = [], 0
        for r in worker.regions:
            offsets.append(at)
            at += slots * bpl * r.block_len
        return cls(worker, slots, tuple(offsets))

    @property
    def nbytes(self) -> int:
        return self.slots * self.worker.blocks_per_logical * sum(r.block_len for r in self.worker.regions)

    @property
    def slot_bytes(self) -> int:
        """Bytes one logical slot takes, over every region."""
        return self.nbytes // self.slots

    def layout(self, base: int) -> Layout:
        """The landing buffer at ``base`` as a layout P can WRITE into: region ``r`` keeps
        its block length and group, its blocks dense."""
        bpl = self.worker.blocks_per_logical
        return Layout(tuple(
            RegionSpec(base + self.offsets[i], r.block_len, self.slots * bpl, r.block_len, r.group, r.heads,
                       r.replicated)
            for i, r in enumerate(self.worker.regions)
        ), bpl)


# ---------------------------------------------------------------- the copy


COPY_FIELDS = 8  # int64s per entry of a copy table (64 bytes; the kernel reads them as such)
COPY_ALIGN = 16  # the widest access of the copy kernel, in bytes


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """A copy between a rank's KV and a buffer of the daemon's own, as the copy kernel reads
    it: one entry per worker region, ordered by KV group and then region, each

        ``(src_base, src_stride, src_blocks, dst_base, dst_stride, dst_blocks, nbytes, 0)``

    D's landing copy (``build``, ``gather`` False) moves physical landing slot ``s`` of an
    entry into the worker's physical block ``w``: ``nbytes`` from ``src_base + s *
    src_stride`` to ``dst_base + w * dst_stride``. P's staging copy (``build_staging``,
    ``gather`` True) moves the worker's block ``w`` into staging slot ``s``: from ``src_base
    + w * src_stride`` to ``dst_base + s * dst_stride``. Nothing moves for an index out of
    its side's block count. A part's regions of one group are one run of entries
    (``span``), so one launch copies them."""

    table: np.ndarray  # (regions, COPY_FIELDS) int64
    region_of: np.ndarray  # the worker region of each entry
    group_of: np.ndarray  # the KV group of each entry
    groups: int
    slots: int  # physical slots per region of the daemon's buffer
    width: int  # bytes that divide every address, stride and length (at most COPY_ALIGN)
    gather: bool = False  # True: worker -> staging slots (P); False: landing slots -> worker (D)
    # True: P's copy into a same-host D's KV (``build_pairs``): any source block to any
    # destination block, the pairs named per launch.
    pairs: bool = False
    # What ``span`` and ``max_bytes`` found, by their arguments: every part's copy of a
    # request asks the same few questions again, on a path a WRITE's completion waits for.
    _known: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, worker: Layout, landing: Layout) -> CopyPlan:
        """The copy from ``landing`` (``LandingGeometry.layout``) into ``worker``, region by region."""
        return cls._build(worker, landing, gather=False)

    @classmethod
    def build_staging(cls, worker: Layout, staging: Layout) -> CopyPlan:
        """The copy from ``worker`` into ``staging`` (``LandingGeometry.layout`` of P's KV)."""
        return cls._build(worker, staging, gather=True)

    @classmethod
    def build_pairs(cls, src: Layout, dst: Layout) -> CopyPlan:
        """The copy from P's KV ``src`` into D's KV ``dst`` (mapped here): entry ``e`` moves
        source block ``s`` of region ``e`` to destination block ``d`` for each pair (s, d)
        a launch names (``check_pair_ids``; ``copy_ranges`` with ``slots`` = s, ``blocks`` = d)."""
        plan = cls._build(dst, src, gather=False)
        return cls(plan.table, plan.region_of, plan.group_of, plan.groups, 0, plan.width, pairs=True)

    @property
    def mode(self) -> int:
        """The kernel's ``mode``: 0 landing, 1 staging, 2 pairs (``devmem/kernel.py``)."""
        return 2 if self.pairs else int(self.gather)

    @classmethod
    def _build(cls, worker: Layout, own: Layout, gather: bool) -> CopyPlan:
        if len(worker.regions) != len(own.regions):
            raise LayoutError("the buffer's layout does not match the worker's regions")
        order = sorted(range(len(worker.regions)), key=lambda i: (worker.regions[i].group, i))
        table = np.zeros((len(order), COPY_FIELDS), dtype=np.int64)
        width = COPY_ALIGN
        for row, i in enumerate(order):
            w, o = worker.regions[i], own.regions[i]
            src, dst = (w, o) if gather else (o, w)
            table[row, :7] = (src.base, src.stride, src.num_blocks, dst.base, dst.stride, dst.num_blocks, w.block_len)
            width = math.gcd(width, o.base, o.stride, w.base, w.stride, w.block_len)
        group_of = np.array([worker.regions[i].group for i in order], dtype=np.int64)
        slots = min((r.num_blocks for r in own.regions), default=0)
        return cls(table, np.array(order, dtype=np.int64), group_of, worker.groups, slots, width, gather)

    def span(self, regions: range, group: int) -> tuple[int, int]:
        """(first entry, entries) of ``regions`` that are in ``group``: one contiguous run."""
        key = ("span", regions.start, regions.stop, group)
        known = self._known.get(key)
        if known is None:
            mine = np.flatnonzero((self.group_of == group) & (self.region_of >= regions.start)
                                  & (self.region_of < regions.stop))
            known = self._known[key] = (int(mine[0]), len(mine)) if len(mine) else (0, 0)
        return known

    def group_span(self, group: int) -> tuple[int, int]:
        """(first entry, entries) of every region of ``group``."""
        return self.span(range(len(self.table)), group)

    def max_bytes(self, first: int, count: int) -> int:
        key = ("bytes", first, count)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = int(self.table[first:first + count, 6].max()) if count else 0
        return known

    def block_limits(self, first: int, count: int) -> tuple[int, int]:
        """The source and destination blocks every one of entries ``first .. first + count``
        holds (``count`` > 0): a pair copy's ids must lie below them."""
        key = ("limits", first, count)
        known = self._known.get(key)
        if known is None:
            t = self.table[first:first + count]
            known = self._known[key] = (int(t[:, 2].min()), int(t[:, 5].min()))
        return known


def copy_ranges(plan: CopyPlan, first: int, count: int, slots: np.ndarray,
                blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the copy kernel does for entries ``first .. first + count`` and the pairs
    (``slots[i]`` -> ``blocks[i]``), as (source addresses, destination addresses, lengths),
    pair-major. Pairs out of an entry's range copy nothing."""
    t = plan.table[first:first + count]
    s = np.asarray(slots, dtype=np.int64)[:, None]
    w = np.asarray(blocks, dtype=np.int64)[:, None]
    if plan.gather:  # the worker's block is the source, the slot the destination
        s, w = w, s
    keep = ((s >= 0) & (s < t[None, :, 2]) & (w >= 0) & (w < t[None, :, 5])).reshape(-1)
    src = (t[None, :, 0] + s * t[None, :, 1]).reshape(-1)
    dst = (t[None, :, 3] + w * t[None, :, 4]).reshape(-1)
    lengths = np.broadcast_to(t[None, :, 6], (len(s), len(t))).reshape(-1)
    return src[keep], dst[keep], lengths[keep]


def check_pairs(plan: CopyPlan, first: int, count: int, slots: np.ndarray, blocks: np.ndarray) -> str:
    """Why these pairs cannot be copied as one launch ("" if they can): the slots must be one
    ascending run and every pair in range of every entry (the kernel would skip the rest)."""
    if len(slots) != len(blocks):
        return f"{len(slots)} landing slots for {len(blocks)} blocks"
    if not len(slots) or not count:
        return ""
    if first < 0 or first + count > len(plan.table):
        return f"copy entries {first}..{first + count - 1} of {len(plan.table)}"
    t = plan.table[first:first + count]
    own, worker = (t[:, 5], t[:, 2]) if plan.gather else (t[:, 2], t[:, 5])
    if slots[0] < 0 or np.any(np.diff(slots) != 1) or slots[-1] >= own.min():
        return "slots are not one run inside the buffer"
    if blocks.min() < 0 or blocks.max() >= worker.min():
        return f"block {int(blocks.max())} outside the worker's KV ({int(worker.min())} blocks)"
    return ""


def check_pair_ids(plan: CopyPlan, first: int, count: int, src: np.ndarray, dst: np.ndarray) -> str:
    """Why the pairs (``src[i]`` -> ``dst[i]``) cannot be copied by entries ``first ..
    first + count`` of a pair plan ("" if they can): every block inside every entry's
    range, and ids that fit the kernel's 32-bit halves."""
    if not plan.pairs:
        return "not a pair copy"
    if len(src) != len(dst):
        return f"{len(src)} source blocks for {len(dst)} destination blocks"
    if not len(src) or not count:
        return ""
    if first < 0 or first + count > len(plan.table):
        return f"copy entries {first}..{first + count - 1} of {len(plan.table)}"
    src_blocks, dst_blocks = plan.block_limits(first, count)
    if src.min() < 0 or src.max() >= min(src_blocks, 2**32):
        return f"source block {int(src.max())} outside P's KV ({src_blocks} blocks)"
    if dst.min() < 0 or dst.max() >= min(dst_blocks, 2**31):
        return f"destination block {int(dst.max())} outside D's KV ({dst_blocks} blocks)"
    return ""


def group_entries(plan: CopyPlan, group: int, first: int, count: int) -> str:
    """Why entries ``first .. first + count`` are not all of ``group`` ("" if they are; the
    plan's entries are sorted by group, so its ends say it)."""
    if not count:
        return ""
    if first < 0 or first + count > len(plan.group_of):
        return f"copy entries {first}..{first + count - 1} of {len(plan.group_of)}"
    if plan.group_of[first] != group or plan.group_of[first + count - 1] != group:
        return f"copy entries {first}..{first + count - 1} are not all of group {group}"
    return ""


def entry_runs(plan: CopyPlan, group: int, regions: np.ndarray) -> list[tuple[int, int]]:
    """The plan's entries of ``group`` that copy one of ``regions`` (the worker's region
    indices), as runs of adjacent entries (first, count): one launch each."""
    entries = np.flatnonzero((plan.group_of == group) & np.isin(plan.region_of, regions))
    if not len(entries):
        return []
    cuts = np.flatnonzero(np.diff(entries) != 1) + 1
    starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(entries)]))
    return [(int(entries[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist())]


def check_launch(plan: CopyPlan, run: SlotRun, first: int, count: int) -> str:
    """Why entries ``first .. first + count`` cannot be copied through ``run`` ("" if they
    can): they must be entries of the plan, of the group whose map ``run`` set (its pairs
    were checked against every entry of that group when it was mapped)."""
    return group_entries(plan, run.group, first, count) if run.count else ""


@dataclass(frozen=True, slots=True)
class SlotRun:
    """Slots ``first .. first + count`` (physical) of ``group`` whose slot -> block map a
    copier set (``Copier.map``); the copies through them name it."""

    group: int
    first: int
    count: int


def physical_blocks(ids: list[int] | np.ndarray, per_logical: int) -> np.ndarray:
    """Physical block ids of logical ``ids``, in order."""
    base = np.asarray(ids, dtype=np.int64) * per_logical
    return (base[:, None] + np.arange(per_logical, dtype=np.int64)).reshape(-1)


# ---------------------------------------------------------------- allocator


class AllocOutcome(enum.Enum):
    GRANTED = "granted"
    QUEUED = "queued"  # waits for space; granted later by ``release``/``withdraw``
    TOO_LARGE = "too_large"  # could never fit
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class Grant:
    key: str
    starts: tuple[int, ...]  # first slot per group (0 where the count is 0)
    counts: tuple[int, ...]


class _Extents:
    """Free slot ranges of one group: sorted, never adjacent."""

    __slots__ = ("starts", "lengths")

    def __init__(self, slots: int) -> None:
        self.starts = [0]
        self.lengths = [slots]

    def first_fit(self, n: int) -> int | None:
        for i, length in enumerate(self.lengths):
            if length >= n:
                return i
        return None

    def take(self, i: int, n: int) -> int:
        start = self.starts[i]
        if self.lengths[i] == n:
            del self.starts[i], self.lengths[i]
        else:
            self.starts[i] += n
            self.lengths[i] -= n
        return start

    def give(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] > start:
            raise AssertionError(f"slots {start}..{start + n - 1} freed twice")
        if i < len(self.starts) and start + n > self.starts[i]:
            raise AssertionError(f"slots {start}..{start + n - 1} freed twice")
        if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == start:
            i -= 1
            self.lengths[i] += n
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, n)
        if i + 1 < len(self.starts) and self.starts[i] + self.lengths[i] == self.starts[i + 1]:
            self.lengths[i] += self.lengths[i + 1]
            del self.starts[i + 1], self.lengths[i + 1]

    @property
    def free(self) -> int:
        return sum(self.lengths)


class SlotAllocator:
    def __init__(self, groups: int, slots: int) -> None:
        self.slots = slots
        self._free = [_Extents(slots) for _ in range(groups)]
        self._grants: dict[str, Grant] = {}
        self._waiting: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def request(self, key: str, counts: list[int] | tuple[int, ...]) -> tuple[AllocOutcome, Grant | None]:
        counts = tuple(counts) + (0,) * (len(self._free) - len(counts))
        if key in self._grants or key in self._waiting:
            return AllocOutcome.DUPLICATE, None
        if len(counts) > len(self._free) or any(n > self.slots for n in counts):
            return AllocOutcome.TOO_LARGE, None
        if not self._waiting:
            grant = self._try(key, counts)
            if grant is not None:
                return AllocOutcome.GRANTED, grant
        self._waiting[key] = counts
        return AllocOutcome.QUEUED, None

    def _try(self, key: str, counts: tuple[int, ...]) -> Grant | None:
        found = []
        for g, n in enumerate(counts):
            i = self._free[g].first_fit(n) if n else -1
            if i is None:
                return None
            found.append(i)
        starts = tuple(self._free[g].take(i, n) if n else 0 for g, (i, n) in enumerate(zip(found, counts)))
        grant = self._grants[key] = Grant(key, starts, counts)
        return grant

    def release(self, key: str) -> list[Grant]:
        """Give back ``key``'s slots, or drop it from the queue; returns the grants this
        made possible for waiting requests, in their order."""
        if self._waiting.pop(key, None) is not None:
            return self._serve()
        grant = self._grants.pop(key, None)
        if grant is None:
            return []
        for g, (start, n) in enumerate(zip(grant.starts, grant.counts)):
            if n:
                self._free[g].give(start, n)
        return self._serve()

    def _serve(self) -> list[Grant]:
        served = []
        while self._waiting:
            key, counts = next(iter(self._waiting.items()))
            grant = self._try(key, counts)
            if grant is None:
                break
            del self._waiting[key]
            served.append(grant)
        return served

    def grant(self, key: str) -> Grant | None:
        return self._grants.get(key)

    def waiting(self, key: str) -> bool:
        return key in self._waiting

    @property
    def capacity(self) -> int:
        """Slots over every group."""
        return self.slots * len(self._free)

    @property
    def used(self) -> int:
        """Slots granted, over every group."""
        return sum(self.slots - e.free for e in self._free)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def __len__(self) -> int:
        return len(self._grants)

    def __repr__(self) -> str:
        return f"<SlotAllocator slots={self.slots} grants={len(self._grants)} used={self.used} queued={self.queued}>"
