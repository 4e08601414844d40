"""P's staging on the GPU (docs/gpu.md): for a producer rank with a staging buffer, each
matched request's blocks are copied into staging slots, and its WRITE goes from there.

Composed into the ``Sender``. ``start`` takes slots for a match (or queues it behind
earlier ones: backpressure, never an overwrite) and launches the copy; ``poll`` hands a
match whose copy finished to the sender (``ready``), which plans and posts its WRITE from
the slots; ``release`` gives the slots back once that WRITE settled or was never posted.
Slots are held while a copy may still write them or a WRITE may still read them; a match
that ended meanwhile (cancelled, expired, its peer lost) only gives its slots back. The
copy reads the worker's blocks and writes nothing of the worker's, so the worker may get
its blocks back while it runs (the bytes then copied are never sent).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from pushsvc.devmem.base import CopyJob
from pushsvc.errors import DeviceError
from pushsvc.metrics import Metrics
from pushsvc.server.peers import Peer
from pushsvc.server.landing import launch_copies, map_slots
from pushsvc.server.ranks import Rank, StagingMemory
from pushsvc.state.landing import AllocOutcome, Grant, SlotAllocator
from pushsvc.state.producer import Match

log = structlog.get_logger("pushsvc.staging")

# The copy of a match finished: post its WRITE from these slot ids (per group); key names
# the slots for ``release``.
Ready = Callable[[Rank, Match, Peer, list[list[int]], str], None]
Failed = Callable[[Rank, Match, Peer, str, str], None]  # (rank, match, peer, kind, reason)


@dataclass(eq=False)
class _Staged:
    key: str
    match: Match
    peer: Peer
    grant: Grant | None = None  # None while waiting for slots
    jobs: list[CopyJob] = field(default_factory=list)
    error: str = ""


@dataclass(eq=False)
class _RankStaging:
    memory: StagingMemory
    slots: SlotAllocator
    entries: dict[str, _Staged] = field(default_factory=dict)  # by key, until ``release``
    copying: dict[str, _Staged] = field(default_factory=dict)


class Staging:
    def __init__(self, *, metrics: Metrics, current: Callable[[Rank, Match], bool], ready: Ready,
                 failed: Failed) -> None:
        self._metrics = metrics
        self._current = current  # is this match still the rank's live push of its request?
        self._ready = ready
        self._failed = failed
        self._ranks: dict[Rank, _RankStaging] = {}
        self._keys = itertools.count()

    @staticmethod
    def applies(rank: Rank) -> bool:
        return rank.memory is not None and rank.memory.staging is not None

    def _of(self, rank: Rank) -> _RankStaging:
        state = self._ranks.get(rank)
        if state is None:
            memory = rank.memory.staging if rank.memory is not None else None
            assert memory is not None
            state = self._ranks[rank] = _RankStaging(memory, SlotAllocator(rank.memory.layout.groups,
                                                                           memory.geometry.slots))
        return state

    # ------------------------------------------------------------------ slots and copies

    def start(self, rank: Rank, match: Match, peer: Peer) -> None:
        """Slots for ``match``'s blocks and their copy: now, or once earlier ones give theirs back."""
        state = self._of(rank)
        key = f"{match.request_id}#{next(self._keys)}"
        counts = [len(ids) for ids in match.block_ids]
        outcome, grant = state.slots.request(key, counts)
        if outcome is AllocOutcome.TOO_LARGE:
            geometry = state.memory.geometry
            self._failed(rank, match, peer, "staging_too_small",
                         f"{max(counts)} blocks need {max(counts) * geometry.slot_bytes >> 20} MiB of staging space, "
                         f"the rank's staging buffer holds {geometry.slots} blocks ({geometry.nbytes >> 20} MiB; "
                         "raise staging_mib)")
            return
        entry = state.entries[key] = _Staged(key, match, peer, grant)
        if grant is not None:
            self._copy(rank, state, entry)
        else:
            self._metrics.staging_waits.inc()
            log.info("staging_wait", request_id=match.request_id, rank=rank.number, blocks=max(counts),
                     queued=state.slots.queued, used=state.slots.used, slots=state.slots.slots)

    def _copy(self, rank: Rank, state: _RankStaging, entry: _Staged) -> None:
        memory, grant = state.memory, entry.grant
        assert grant is not None
        bpl = rank.memory.layout.blocks_per_logical if rank.memory is not None else 1
        try:
            runs = map_slots(memory.copier, grant, entry.match.block_ids, bpl)
            launch_copies(memory.copier, range(len(memory.layout.regions)), runs, entry.jobs)
        except DeviceError as exc:
            entry.error = str(exc)
        self._metrics.staging_copies.inc(len(entry.jobs))
        state.copying[entry.key] = entry

    def poll(self, rank: Rank) -> None:
        """Hand on the matches whose copies finished; give back the slots of those that ended."""
        state = self._ranks.get(rank)
        for entry in list(state.copying.values()) if state is not None else ():
            entry.jobs = [job for job in entry.jobs if not self._settled(entry, job)]
            if entry.jobs:
                continue
            del state.copying[entry.key]
            if not self._current(rank, entry.match):
                log.debug("staged_for_nothing", request_id=entry.match.request_id, rank=rank.number)
                self.release(rank, entry.key)
            elif entry.error:
                self.release(rank, entry.key)
                self._failed(rank, entry.match, entry.peer, "staging_copy", entry.error)
            else:
                grant = entry.grant
                assert grant is not None
                slot_ids = [list(range(start, start + n)) for start, n in zip(grant.starts, grant.counts)]
                self._ready(rank, entry.match, entry.peer, slot_ids[:len(entry.match.block_ids)], entry.key)

    @staticmethod
    def _settled(entry: _Staged, job: CopyJob) -> bool:
        try:
            return job.done()
        except DeviceError as exc:  # a device fault: these slots hold nothing to send
            entry.error = entry.error or f"staging copy failed on the device: {exc}"
            return True

    def release(self, rank: Rank, key: str) -> None:
        """The slots of ``key`` are free: no copy writes them, no WRITE reads them. Waiting
        matches that fit now get theirs, in order."""
        state = self._ranks.get(rank)
        if state is None or state.entries.pop(key, None) is None:
            return
        for grant in state.slots.release(key):
            waiting = state.entries[grant.key]
            waiting.grant = grant
            if self._current(rank, waiting.match):
                self._copy(rank, state, waiting)
            else:
                self.release(rank, waiting.key)

    # ------------------------------------------------------------------ lifecycle

    def busy(self, rank: Rank) -> bool:
        """Slots held (a copy or a WRITE may use them): the rank's staging buffer is in use."""
        state = self._ranks.get(rank)
        return state is not None and any(e.grant is not None for e in state.entries.values())

    def hot(self, rank: Rank) -> bool:
        state = self._ranks.get(rank)
        return state is not None and bool(state.copying)

    def slot_counts(self) -> dict[str, int]:
        states = self._ranks.values()
        return {"total": sum(s.slots.slots for s in states), "used": sum(s.slots.used for s in states),
                "queued": sum(s.slots.queued for s in states)}

    def abandon(self, rank: Rank) -> None:
        """Shutdown: wait for the rank's copies (they write into its staging buffer)."""
        state = self._ranks.get(rank)
        for entry in list(state.copying.values()) if state is not None else ():
            for job in entry.jobs:
                job.wait()
            entry.jobs = []
        if state is not None:
            state.copying.clear()

    def forget(self, rank: Rank) -> None:
        self._ranks.pop(rank, None)
