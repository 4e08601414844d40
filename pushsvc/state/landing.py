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
* ``CopyGeometry`` / ``CopyRows`` / ``copy_rows``: the copy as rows of ``unit`` bytes, from
  the landing rows of the request's slots to the worker rows of its blocks.
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
            RegionSpec(base + self.offsets[i], r.block_len, self.slots * bpl, r.block_len, r.group)
            for i, r in enumerate(self.worker.regions)
        ), bpl)


# ---------------------------------------------------------------- rows of the copy


@dataclass(frozen=True, slots=True)
class CopyRows:
    """How the rows of one block position move, for a set of regions of one group: the
    landing row of entry ``e`` for physical slot ``p`` is ``p * src_strides[e] +
    src_offsets[e]``; it goes to worker row ``w * dst_strides[e] + dst_offsets[e]`` for
    the worker's physical block ``w``."""

    src_offsets: np.ndarray  # int64
    src_strides: np.ndarray
    dst_offsets: np.ndarray
    dst_strides: np.ndarray

    def __len__(self) -> int:
        return len(self.src_offsets)


@dataclass(frozen=True, slots=True)
class CopyGeometry:
    origin: int  # lowest worker region address
    span: int  # bytes from origin to the end of the highest region
    unit: int  # bytes per row, dividing every block length, stride and offset
    regions: tuple[RegionSpec, ...]  # the worker's
    landing: tuple[int, ...]  # per region: the offset of its landing area
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, worker: Layout, landing: LandingGeometry) -> CopyGeometry:
        origin, span, unit = row_extent(worker)
        for off in landing.offsets:
            unit = math.gcd(unit, off)
        return cls(origin, span, unit, worker.regions, landing.offsets)

    def rows(self, regions: range, group: int) -> CopyRows | None:
        """The rows of ``regions``' blocks of ``group`` (None if none of them is in it)."""
        key = (regions.start, regions.stop, group)
        if key not in self._cache:
            parts = [[], [], [], []]
            u = self.unit
            for i in regions:
                r = self.regions[i]
                if r.group != group:
                    continue
                n = r.block_len // u
                j = np.arange(n, dtype=np.int64)
                parts[0].append(self.landing[i] // u + j)
                parts[1].append(np.full(n, n, dtype=np.int64))
                parts[2].append((r.base - self.origin) // u + j)
                parts[3].append(np.full(n, r.stride // u, dtype=np.int64))
            self._cache[key] = CopyRows(*(np.concatenate(p) for p in parts)) if parts[0] else None
        return self._cache[key]


def row_extent(layout: Layout) -> tuple[int, int, int]:
    """(origin, span, unit) of a layout's memory seen as rows: from its lowest region to the
    end of its highest, in rows of the largest size dividing every block length, stride
    and region offset."""
    origin = min(r.base for r in layout.regions)
    span = max(r.base + (r.num_blocks - 1) * r.stride + r.block_len for r in layout.regions) - origin
    unit = 0
    for r in layout.regions:
        unit = math.gcd(unit, r.block_len, r.stride, r.base - origin)
    return origin, span, unit


def physical_blocks(ids: list[int] | np.ndarray, per_logical: int) -> np.ndarray:
    """Physical block ids of logical ``ids``, in order."""
    base = np.asarray(ids, dtype=np.int64) * per_logical
    return (base[:, None] + np.arange(per_logical, dtype=np.int64)).reshape(-1)


def copy_rows(rows: CopyRows, slots: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(landing rows, worker rows) for physical landing ``slots`` going to the worker's
    physical ``blocks`` (pairwise), in the same order."""
    src = (slots[:, None] * rows.src_strides[None, :] + rows.src_offsets[None, :]).reshape(-1)
    dst = (blocks[:, None] * rows.dst_strides[None, :] + rows.dst_offsets[None, :]).reshape(-1)
    return src, dst


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
