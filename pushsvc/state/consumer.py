"""D-side registration table: requests waiting for P to push their KV.

Pure state, ``now`` passed in. Life of a D request::

    add --> pending --mark_sent--> sent --completion x expected--> done (removed)
               |                    \\--evict--> cancelling --fail (P confirmed)--> removed
               \\--evict--> removed (P never saw it)
    sent --watchdog--> cancelling (reason "watchdog")
    sent/cancelling --P lost--> cancelling (reason "peer_lost"): a completion still
                                counts as done; the grace running out fails it
    any other state --fail / watchdog expiry--> removed

``expected`` is how many completion notifications this rank must see: P ranks that
write into it (P TP / D TP, at least 1).

A block belongs to at most one tracked registration: P may write into it until that
registration is final, so ``holder`` lets the daemon refuse a second one naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


PEER_LOST = "peer_lost"


class RecvState(Enum):
    PENDING = "pending"  # waiting for the handshake with P
    SENT = "sent"  # PUSH_REG delivered to P's agent
    CANCELLING = "cancelling"  # worker evicted it; waiting for P to confirm no WRITE lands


@dataclass(slots=True)
class Remote:
    engine_id: str
    host: str
    port: int
    tp_size: int


@dataclass(slots=True)
class PendingRecv:
    request_id: str
    block_ids: list[list[int]]
    remote: Remote
    deadline: float
    expected: int
    seen: int = 0
    state: RecvState = RecvState.PENDING
    reason: str = "cancelled"  # reported when a cancellation completes

    @property
    def flat_block_ids(self) -> list[int]:
        return [b for group in self.block_ids for b in group]


class CompletionOutcome(Enum):
    DONE = "done"
    PARTIAL = "partial"
    UNKNOWN = "unknown"  # late, duplicate or foreign: counted, otherwise ignored
    CANCELLED = "cancelled"  # the last WRITE of a cancelled registration landed


@dataclass
class ConsumerTable:
    watchdog_s: float
    local_tp_size: int = 1
    cancel_grace_s: float = 5.0  # how long P has to confirm a cancellation
    pending: dict[str, PendingRecv] = field(default_factory=dict)
    _holders: dict[tuple[int, int], str] = field(default_factory=dict)  # (group, block) -> request id

    def tracks(self, request_id: str) -> bool:
        return request_id in self.pending

    def holder(self, block_ids: list[list[int]]) -> tuple[int, str] | None:
        """A block of ``block_ids`` that a tracked registration holds, and its holder."""
        for g, ids in enumerate(block_ids):
            for b in ids:
                rid = self._holders.get((g, b))
                if rid is not None:
                    return b, rid
        return None

    def add(self, request_id: str, block_ids: list[list[int]], remote: Remote, now: float) -> PendingRecv | None:
        """Track a registration; ``None`` if the id is already tracked (idempotent)."""
        if request_id in self.pending:
            return None
        expected = max(1, remote.tp_size // max(1, self.local_tp_size))
        entry = PendingRecv(request_id, block_ids, remote, now + self.watchdog_s, expected)
        self.pending[request_id] = entry
        for g, ids in enumerate(block_ids):
            for b in ids:
                self._holders.setdefault((g, b), request_id)
        return entry

    def mark_sent(self, request_id: str) -> bool:
        entry = self.pending.get(request_id)
        if entry is None or entry.state is not RecvState.PENDING:
            return False
        entry.state = RecvState.SENT
        return True

    def on_completion(self, request_id: str) -> tuple[CompletionOutcome, PendingRecv | None]:
        entry = self.pending.get(request_id)
        if entry is None or entry.state is RecvState.PENDING:
            return CompletionOutcome.UNKNOWN, None
        entry.seen += 1
        if entry.seen < entry.expected:
            return CompletionOutcome.PARTIAL, entry
        self._drop(request_id)
        if entry.state is RecvState.CANCELLING and entry.reason != PEER_LOST:
            return CompletionOutcome.CANCELLED, entry
        return CompletionOutcome.DONE, entry

    def fail(self, request_id: str) -> PendingRecv | None:
        return self._drop(request_id)

    def evict(self, request_id: str, now: float | None = None) -> PendingRecv | None:
        """Drop a registration P cannot have seen yet; a SENT one becomes CANCELLING
        (P may be writing into its blocks) and stays until ``fail`` confirms it, or
        until ``cancel_grace_s`` after ``now`` (when given) runs out."""
        entry = self.pending.get(request_id)
        if entry is None or entry.state is RecvState.CANCELLING:
            return None
        if entry.state is RecvState.SENT:
            entry.state = RecvState.CANCELLING
            if now is not None:
                entry.deadline = min(entry.deadline, now + self.cancel_grace_s)
            return entry
        return self._drop(request_id)

    def orphan(self, request_id: str, now: float) -> PendingRecv | None:
        """P's daemon went away without being known dead: a WRITE it posted may still
        land. Hold the blocks (CANCELLING, reason ``peer_lost``) until the WRITE's
        completion arrives (then the request is done) or ``cancel_grace_s`` runs out."""
        entry = self.pending.get(request_id)
        if entry is None or entry.state is RecvState.PENDING:
            return None
        if entry.state is RecvState.SENT:
            entry.reason = PEER_LOST  # a cancelling one keeps why it was cancelled
        entry.state = RecvState.CANCELLING
        entry.deadline = min(entry.deadline, now + self.cancel_grace_s)
        return entry

    def expire(self, now: float) -> list[PendingRecv]:
        """Overdue entries. A SENT one is not dropped but turned CANCELLING (P may be
        writing into its blocks) with ``cancel_grace_s`` for P to confirm; the caller
        tells P. Every other overdue entry is removed: it is final."""
        overdue = [e for e in self.pending.values() if e.deadline <= now]
        for e in overdue:
            if e.state is RecvState.SENT:
                e.state = RecvState.CANCELLING
                e.reason = "watchdog"
                e.deadline = now + self.cancel_grace_s
            else:
                self._drop(e.request_id)
        return overdue

    def waiting_on(self, engine_id: str) -> list[PendingRecv]:
        return [e for e in self.pending.values() if e.remote.engine_id == engine_id]

    def next_deadline(self) -> float | None:
        return min((e.deadline for e in self.pending.values()), default=None)

    @property
    def busy(self) -> bool:
        return any(e.state is not RecvState.PENDING for e in self.pending.values())

    def sizes(self) -> dict[str, int]:
        return {"d_pending": len(self.pending)}

    def __repr__(self) -> str:
        return f"<ConsumerTable pending={len(self.pending)}>"

    def _drop(self, request_id: str) -> PendingRecv | None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            for g, ids in enumerate(entry.block_ids):
                for b in ids:
                    if self._holders.get((g, b)) == request_id:
                        del self._holders[(g, b)]
        return entry
