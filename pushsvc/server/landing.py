"""D's landing on the GPU (docs/gpu.md): slots for each registration, copies of landed
parts into the worker's KV, final events held until those copies are done.

Composed into the ``Receiver``, one ``_RankLanding`` per rank whose KV is CUDA memory
with a landing buffer. The receiver asks for slots when a registration arrives
(``reserve``), puts them into the ``PUSH_REG`` (``slot_ids``), reports each part's
notification (``part_landed``, which starts that part's copy while the registration is
live) and ends every request through ``finish``: the final action runs once no copy into
the request's blocks is in flight, and only then do its slots go back, to the
registrations waiting for them in order (``granted``).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from pushsvc.devmem.base import Copier, CopyJob
from pushsvc.errors import DeviceError
from pushsvc.metrics import Metrics
from pushsvc.server.ranks import LandingMemory, Rank
from pushsvc.state.landing import AllocOutcome, Grant, SlotAllocator, SlotRun, part_regions, physical_blocks

log = structlog.get_logger("pushsvc.landing")

# What runs when a request's copies are done: it gets the copy error ("" if none).
Action = Callable[[str], None]


def map_slots(copier: Copier, grant: Grant, block_ids: Sequence[Sequence[int]],
              blocks_per_logical: int) -> list[SlotRun]:
    """Map ``grant``'s slots of each group to ``block_ids`` (``Copier.map``): one run per group."""
    runs = []
    for g, ids in enumerate(block_ids):
        slots = physical_blocks(np.arange(grant.starts[g], grant.starts[g] + len(ids)), blocks_per_logical)
        runs.append(copier.map(g, slots, physical_blocks(np.asarray(ids, dtype=np.int64), blocks_per_logical)))
    return runs


def launch_copies(copier: Copier, regions: Sequence[int], runs: Sequence[SlotRun], into: list[CopyJob]) -> None:
    """One launch per KV group through its mapped ``runs``, over ``regions``, in the
    direction of ``copier``'s plan (D's landing: slots -> blocks; P's staging: blocks ->
    slots); each job goes into ``into`` as soon as it is launched, so a DeviceError from a
    later group leaves the earlier jobs there to be waited for."""
    for run in runs:
        first, count = copier.plan.span(regions, run.group) if run.count else (0, 0)
        if count:
            into.append(copier.launch(run, first, count))


class PartOutcome(enum.Enum):
    MORE = "more"  # parts still to come
    ALL = "all"  # the last part arrived: the WRITE is complete
    MALFORMED = "malformed"  # index seen before, or a part count that changed
    UNKNOWN = "unknown"  # no landing entry (late, or never ours)


@dataclass(eq=False)
class _Entry:
    rid: str
    block_ids: list[list[int]]  # the worker's logical ids, per group
    asked_at: float
    grant: Grant | None = None  # None while waiting for slots
    runs: list[SlotRun] = field(default_factory=list)  # the grant's slots, mapped to the blocks (per group)
    parts: int = 0  # k, from the first part's notification
    arrived: set[int] = field(default_factory=set)
    copies: list[CopyJob] = field(default_factory=list)
    error: str = ""
    landed_at: float = 0.0  # perf_counter() when the last part arrived
    action: Action | None = None  # the final action, held until the copies are done

    @property
    def blocks(self) -> set[int]:
        return {b for ids in self.block_ids for b in ids}


@dataclass(eq=False)
class _RankLanding:
    memory: LandingMemory
    slots: SlotAllocator
    entries: dict[str, _Entry] = field(default_factory=dict)
    closing: bool = False  # shutting down: freed slots go to nobody


class Landing:
    def __init__(self, *, metrics: Metrics, now: Callable[[], float],
                 granted: Callable[[Rank, str, float], None]) -> None:
        self._metrics = metrics
        self._now = now
        self._granted = granted  # a waiting registration got its slots (rank, rid, waited s)
        self._ranks: dict[Rank, _RankLanding] = {}
        self._copying: set[tuple[Rank, _Entry]] = set()

    def attach(self, rank: Rank) -> None:
        memory = rank.memory
        assert memory is not None and memory.landing is not None
        groups = memory.layout.groups
        self._ranks[rank] = _RankLanding(memory.landing, SlotAllocator(groups, memory.landing.geometry.slots))

    def active(self, rank: Rank) -> bool:
        return rank in self._ranks

    # ------------------------------------------------------------------ slots

    def reserve(self, rank: Rank, rid: str, block_ids: list[list[int]]) -> tuple[AllocOutcome, str]:
        """Slots for ``rid``'s blocks: granted now, queued (``granted`` is called later),
        or never (the outcome's message says how much it would need)."""
        state = self._ranks[rank]
        counts = [len(ids) for ids in block_ids]
        outcome, grant = state.slots.request(rid, counts)
        if outcome is AllocOutcome.TOO_LARGE:
            geometry = state.memory.geometry
            need = max(counts) * geometry.slot_bytes
            return outcome, (f"{max(counts)} blocks need {need >> 20} MiB of landing space, "
                             f"the rank's landing buffer holds {geometry.slots} blocks "
                             f"({geometry.nbytes >> 20} MiB; raise landing_mib)")
        if outcome is AllocOutcome.DUPLICATE:
            return outcome, "request id already holds landing slots"
        entry = state.entries[rid] = _Entry(rid, [list(ids) for ids in block_ids], self._now(), grant)
        if grant is not None:
            self._map(rank, state, entry)
        if outcome is AllocOutcome.QUEUED:
            self._metrics.landing_waits.inc()
            log.info("landing_wait", request_id=rid, rank=rank.number, blocks=max(counts),
                     queued=state.slots.queued, used=state.slots.used, slots=state.slots.slots)
        return outcome, ""

    def slot_ids(self, rank: Rank, rid: str) -> list[list[int]]:
        grant = self._ranks[rank].entries[rid].grant
        assert grant is not None
        return [list(range(start, start + n)) for start, n in zip(grant.starts, grant.counts)]

    def tracks(self, rank: Rank, rid: str) -> bool:
        state = self._ranks.get(rank)
        return state is not None and rid in state.entries

    def holder(self, rank: Rank, block_ids: list[list[int]]) -> tuple[int, str] | None:
        """A block of ``block_ids`` that a request still landing (its copy finishing after
        its registration ended) writes into, with that request."""
        state = self._ranks.get(rank)
        wanted = {b for ids in block_ids for b in ids}
        for entry in state.entries.values() if state is not None else ():
            if entry.action is not None:
                common = wanted & entry.blocks
                if common:
                    return min(common), entry.rid
        return None

    # ------------------------------------------------------------------ parts and copies

    def part_landed(self, rank: Rank, rid: str, index: int, parts: int, copy: bool) -> PartOutcome:
        """Part ``index`` of ``parts`` of ``rid``'s WRITE landed. With ``copy`` (the
        registration is live) its slots are copied into the worker's blocks now."""
        state = self._ranks[rank]
        entry = state.entries.get(rid)
        if entry is None or entry.grant is None or entry.action is not None:
            return PartOutcome.UNKNOWN
        if entry.parts and parts != entry.parts or index in entry.arrived or index >= parts:
            return PartOutcome.MALFORMED
        entry.parts = parts
        entry.arrived.add(index)
        log.debug("part_landed", request_id=rid, part=index, parts=parts, copy=copy)
        if not copy and not entry.error:
            # Left in the slots: the request may no longer end done. Should it all the
            # same, it fails rather than tell the worker of KV that is not in its blocks.
            entry.error = f"part {index} of {parts} landed while the registration was withdrawn: not copied"
        if copy and not entry.error:
            self._copy(rank, state, entry, index, parts)
        if len(entry.arrived) < parts:
            return PartOutcome.MORE
        entry.landed_at = time.perf_counter()
        return PartOutcome.ALL

    def _map(self, rank: Rank, state: _RankLanding, entry: _Entry) -> None:
        """Map the granted slots to the entry's blocks now, off the path a WRITE's
        completion waits for; a refusal fails the request when it ends."""
        assert entry.grant is not None
        memory = state.memory
        try:
            entry.runs = map_slots(memory.copier, entry.grant, entry.block_ids, memory.geometry.worker.blocks_per_logical)
        except DeviceError as exc:
            entry.error = str(exc)
            log.error("landing_copy_failed", request_id=entry.rid, rank=rank.number, error=entry.error)

    def _copy(self, rank: Rank, state: _RankLanding, entry: _Entry, index: int, parts: int) -> None:
        """Copy the regions part ``index`` of ``parts`` carries: one launch per KV group."""
        memory = state.memory
        regions = part_regions(len(memory.geometry.worker.regions), parts, index)
        launched = len(entry.copies)
        try:
            launch_copies(memory.copier, regions, entry.runs, entry.copies)
        except DeviceError as exc:
            entry.error = str(exc)
            log.error("landing_copy_failed", request_id=entry.rid, rank=rank.number, error=entry.error)
        self._metrics.landing_copies.inc(len(entry.copies) - launched)
        if entry.copies:
            self._copying.add((rank, entry))

    def poll(self) -> None:
        """Settle finished copies; run the final actions they held."""
        for rank, entry in list(self._copying):
            entry.copies = [job for job in entry.copies if not self._settled(rank, entry, job)]
            if entry.copies:
                continue
            self._copying.discard((rank, entry))
            if entry.landed_at:
                exposed = time.perf_counter() - entry.landed_at
                self._metrics.landing_exposed_seconds.observe(exposed)
                log.debug("copies_done", request_id=entry.rid, exposed_s=round(exposed, 6))
                entry.landed_at = 0.0
            if entry.action is not None:
                self._end(rank, entry)

    def _settled(self, rank: Rank, entry: _Entry, job: CopyJob) -> bool:
        try:
            return job.done()
        except DeviceError as exc:  # the copy's event reports a device fault: the KV is not trusted
            if not entry.error:
                entry.error = f"landing copy failed on the device: {exc}"
                log.error("landing_copy_failed", request_id=entry.rid, rank=rank.number, error=entry.error)
            return True

    def hot(self, rank: Rank | None = None) -> bool:
        """Copies in flight (of ``rank``, or of any rank)."""
        return any(rank is None or r is rank for r, _ in self._copying)

    # ------------------------------------------------------------------ endings

    def finish(self, rank: Rank, rid: str, action: Action) -> None:
        """``rid`` is final: run ``action`` once no copy into its blocks is in flight, then
        give its slots back (or drop it from the queue)."""
        state = self._ranks.get(rank)
        entry = state.entries.get(rid) if state is not None else None
        if entry is None:
            action("")
            return
        entry.action = action
        if not entry.copies:
            self._end(rank, entry)

    def _end(self, rank: Rank, entry: _Entry) -> None:
        state = self._ranks[rank]
        action, entry.action = entry.action, None
        del state.entries[entry.rid]
        try:
            if action is not None:
                action(entry.error)
        finally:
            for grant in state.slots.release(entry.rid):
                waiting = state.entries[grant.key]
                waiting.grant = grant
                if not state.closing:
                    self._map(rank, state, waiting)
                    self._granted(rank, grant.key, self._now() - waiting.asked_at)

    def busy(self, rank: Rank) -> bool:
        """Copies in flight or final events held for them: the rank's memory is in use."""
        state = self._ranks.get(rank)
        return state is not None and any(e.copies or e.action is not None for e in state.entries.values())

    def abandon(self, rank: Rank) -> None:
        """Shutdown: wait for the rank's copies (they write into the worker's memory), then
        run what they held."""
        state = self._ranks.get(rank)
        if state is not None:
            state.closing = True
        for entry in list(state.entries.values()) if state is not None else ():
            for job in entry.copies:
                job.wait()
            entry.copies = []
            self._copying.discard((rank, entry))
            if entry.action is not None:
                self._end(rank, entry)

    def forget(self, rank: Rank) -> None:
        self._ranks.pop(rank, None)
        self._copying = {(r, e) for r, e in self._copying if r is not rank}

    def slot_counts(self) -> dict[str, int]:
        states = list(self._ranks.values())
        return {"total": sum(s.slots.capacity for s in states), "used": sum(s.slots.used for s in states),
                "queued": sum(s.slots.queued for s in states)}

    def __repr__(self) -> str:
        return f"<Landing ranks={len(self._ranks)} copying={len(self._copying)}>"
