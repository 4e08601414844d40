"""D-side registration table: requests waiting for P to push their KV.

Pure state, ``now`` passed in; methods return what the caller (``server/receiver.py``)
must do. Life of a D request::

    add --> PENDING --mark_sent--> SENT --completion of each source--> done (removed)
              |                     |  \\--(verify, digests late)--> LANDED --digests--> done
              \\--evict/watchdog-->  |
                  removed           \\--evict/watchdog--> CANCELLING --P confirms--> removed
    SENT/CANCELLING --P lost--> CANCELLING, held for the grace; a completion still counts

From ``SENT`` on, P may be writing into the blocks, so no path hands them back while a
WRITE may still land: a cancelled registration waits for P's ``PushCancelled`` (or the
WRITE's completion) for as long as the session to P lives, however long P's WRITE takes.
Only once P is *lost* (no session) does a timer start: ``cancel_grace_s``, after which
the blocks are given back; and P known *dead* (a new incarnation said hello) ends the
wait at once.

**Sources.** The P ranks that write into this rank (one at equal TP, k with P TP = k x
D TP, ``state/tp.py``; for replicated KV, MLA's, only the first of those) are the entry's
*sources*, each by its agent, named by ``mark_sent`` as the PUSH_REGs go out. A source
is *open* while it may still write: its completion (counted once, and only from that
agent), its ``PushCancelled`` or its ``PushFailed`` closes it. The entry
ends only once no source is open: done if every source landed, else failed. A
``PushFailed`` from one source withdraws the entry from the others (CANCELLING), never
frees blocks another source may still be writing into. In verify mode each source's
digests are kept apart, for its own slice of the blocks.

A block belongs to at most one tracked registration (``holder``, ``state/holders.py``),
so the daemon can refuse a second registration naming a block P may still write into.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from enum import Enum

from pushsvc.state.holders import BlockHolders

PEER_LOST = "peer_lost"
WATCHDOG = "watchdog"
CANCELLED = "cancelled"


class RecvState(Enum):
    PENDING = "pending"  # waiting for the handshake with P: P cannot have seen it
    SENT = "sent"  # PUSH_REG delivered to P's agent
    CANCELLING = "cancelling"  # withdrawn (or P lost): waiting until no WRITE can land
    LANDED = "landed"  # verify mode: every WRITE landed, P's digests not here yet


def flat(block_ids: list[list[int]]) -> list[int]:
    """Block ids of every KV-cache group, in one list (what a worker's event carries)."""
    return [b for group in block_ids for b in group]


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
    registered_at: float
    # When the entry's timer fires: the watchdog while PENDING/SENT; the end of the
    # grace for a CANCELLING entry whose P is lost (None: wait for P's answer); the
    # digest wait while LANDED.
    deadline: float | None
    match_key: str = ""
    p_daemon: str = ""  # the P incarnation the PUSH_REGs went to
    sources: dict[str, int] = field(default_factory=dict)  # their agents -> P rank: only these count
    open: set[str] = field(default_factory=set)  # sources that may still write
    landed: set[str] = field(default_factory=set)  # sources whose completion came
    state: RecvState = RecvState.PENDING
    reason: str = CANCELLED  # why a CANCELLING entry is being withdrawn
    announced_at: float | None = None  # P's WriteStarted arrived (hot polling)
    digests: dict[str, bytes] = field(default_factory=dict)  # verify mode: each source's, from WriteStarted
    # A pipeline-parallel P's: each source's regions' layers (what of D's blocks it writes).
    layers: dict[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    ipc: bool = False  # P copies into the worker's blocks itself (same-host push): no landing slots

    @property
    def flat_block_ids(self) -> list[int]:
        return flat(self.block_ids)

    @property
    def seen(self) -> int:
        return len(self.landed)

    def agent_of(self, p_rank: int) -> str | None:
        """The source agent of P rank ``p_rank``."""
        return next((a for a, r in self.sources.items() if r == p_rank), None)

    @property
    def may_finish(self) -> bool:
        """A completion may still make it done: registered with P, or held for a lost P
        (a WRITE it posted may still land within the grace)."""
        return self.state is RecvState.SENT or (self.state is RecvState.CANCELLING and self.reason == PEER_LOST)

    @property
    def complete(self) -> bool:
        """Every source landed."""
        return bool(self.sources) and self.landed == set(self.sources)

    @property
    def all_digests(self) -> bool:
        return set(self.digests) >= set(self.sources)

    @property
    def held(self) -> bool:
        """Withdrawn while P is lost: the grace timer runs."""
        return self.state is RecvState.CANCELLING and self.deadline is not None


class SourceOutcome(Enum):
    NONE = "none"  # not a source that may write, or nothing changes
    WAIT = "wait"  # other sources may still write: keep waiting
    CANCEL = "cancel"  # the failed source withdrew the entry: ask the open sources to cancel
    HELD = "held"  # as CANCEL, but P cannot be asked: the grace timer runs
    FINAL = "final"  # no source can write any more: the entry is gone, report it now


class CompletionOutcome(Enum):
    DONE = "done"  # every WRITE landed: RecvDone
    VERIFY = "verify"  # every WRITE landed and P's digests are here: check, then report
    AWAIT_DIGESTS = "await_digests"  # verify mode: landed before P's digests (kept LANDED)
    PARTIAL = "partial"
    UNKNOWN = "unknown"  # late, duplicate or foreign: counted, otherwise ignored
    CANCELLED = "cancelled"  # the last WRITE of a withdrawn registration landed: RecvFailed


class EvictOutcome(Enum):
    NONE = "none"  # unknown, or already withdrawn
    FINAL = "final"  # P cannot be writing: the entry is gone, report it now
    CANCEL = "cancel"  # P may be writing: ask P (CancelPush), report when it answers
    HELD = "held"  # P may be writing and cannot be asked: the grace timer runs


class ExpiryAction(Enum):
    FAIL = "fail"  # final: report RecvFailed with the reason
    CANCEL = "cancel"  # the watchdog fired while P may be writing: ask P first
    HOLD = "hold"  # as CANCEL, but P cannot be asked: the grace timer runs


@dataclass(frozen=True, slots=True)
class RecvExpiry:
    entry: PendingRecv
    action: ExpiryAction
    kind: str = ""  # FAIL: the failure kind for metrics and logs
    reason: str = ""  # FAIL: the final reason the worker reads


@dataclass
class ConsumerTable:
    watchdog_s: float
    cancel_grace_s: float = 5.0  # how long a lost P's WRITEs may still land
    digest_wait_s: float = 5.0  # verify mode: how long a landed request waits for P's digests
    verify: bool = False  # verify mode: a request is done only once P's digests checked
    pending: dict[str, PendingRecv] = field(default_factory=dict)
    holders: BlockHolders = field(default_factory=BlockHolders)  # which entry holds each block

    # ------------------------------------------------------------------ inputs

    def add(self, request_id: str, block_ids: list[list[int]], remote: Remote, now: float,
            match_key: str = "") -> PendingRecv | None:
        """Track a registration; ``None`` if the id is already tracked (idempotent)."""
        if request_id in self.pending:
            return None
        entry = PendingRecv(request_id, block_ids, remote, now, now + self.watchdog_s, match_key)
        self.pending[request_id] = entry
        self.holders.hold(request_id, block_ids)
        return entry

    def mark_sent(self, request_id: str, p_daemon: str, sources: dict[str, int],
                  layers: dict[str, tuple[tuple[str, ...], ...]] | None = None) -> bool:
        """The PUSH_REGs went to the agents ``sources`` (agent -> P rank's source id) of
        ``p_daemon``; ``layers``: a pipeline-parallel P's, each source's regions' layers."""
        entry = self.pending.get(request_id)
        if entry is None or entry.state is not RecvState.PENDING or not sources:
            return False
        entry.state = RecvState.SENT
        entry.p_daemon, entry.sources, entry.open = p_daemon, dict(sources), set(sources)
        entry.layers = {a: k for a, k in (layers or {}).items() if a in sources}
        return True

    def sent_by(self, request_id: str, p_daemon: str) -> PendingRecv | None:
        """The entry ``request_id`` if its PUSH_REG went to that P incarnation."""
        entry = self.pending.get(request_id)
        return entry if entry is not None and entry.p_daemon and entry.p_daemon == p_daemon else None

    def announce(self, request_id: str, p_daemon: str, p_rank: int, digests: bytes,
                 now: float) -> PendingRecv | None:
        """P rank ``p_rank`` said it posted its WRITE (``WriteStarted``). Returns the entry
        if that completes it: a LANDED entry whose digests were the last thing missing (it
        is removed; the caller verifies and reports)."""
        entry = self.sent_by(request_id, p_daemon)
        agent = entry.agent_of(p_rank) if entry is not None else None
        if entry is None or agent is None:
            return None
        if self.verify:
            entry.digests[agent] = digests
        if entry.state is RecvState.LANDED:
            return self._drop(request_id) if entry.all_digests else None
        entry.announced_at = now
        return None

    def on_completion(self, request_id: str, sender: str, now: float) -> tuple[CompletionOutcome, PendingRecv | None]:
        """A completion notification from agent ``sender``; it counts once, and only from
        a source the PUSH_REG went to that may still write."""
        entry = self.pending.get(request_id)
        if entry is None or entry.state in (RecvState.PENDING, RecvState.LANDED) or sender not in entry.open:
            return CompletionOutcome.UNKNOWN, None
        entry.open.discard(sender)
        entry.landed.add(sender)
        if entry.open:
            return CompletionOutcome.PARTIAL, entry
        if not entry.complete or not entry.may_finish:
            self._drop(request_id)
            return CompletionOutcome.CANCELLED, entry
        if not self.verify:
            self._drop(request_id)
            return CompletionOutcome.DONE, entry
        if entry.all_digests:
            self._drop(request_id)
            return CompletionOutcome.VERIFY, entry
        # Every byte landed, but the digests (sent on the side channel) are behind the
        # completion: the blocks stay held until they come or the wait runs out.
        entry.state = RecvState.LANDED
        entry.deadline = now + self.digest_wait_s
        return CompletionOutcome.AWAIT_DIGESTS, entry

    def fail(self, request_id: str) -> PendingRecv | None:
        return self._drop(request_id)

    def source_cancelled(self, request_id: str, p_daemon: str, p_rank: int) -> PendingRecv | None:
        """P rank ``p_rank`` confirmed a cancel: it writes nothing more. Returns the entry
        if no source may write any more (it is removed; the caller reports it)."""
        entry = self.sent_by(request_id, p_daemon)
        if entry is None or entry.state is not RecvState.CANCELLING:
            return None  # the WRITE's completion got here first: already final
        agent = entry.agent_of(p_rank)
        if agent is None or agent not in entry.open:
            return None
        entry.open.discard(agent)
        return None if entry.open else self._drop(request_id)

    def source_failed(self, request_id: str, p_daemon: str, p_rank: int, reason: str, now: float,
                      peer_alive: bool) -> tuple[SourceOutcome, PendingRecv | None]:
        """P rank ``p_rank`` cannot write (``PushFailed``). The entry fails; while another
        source may still write it is withdrawn from them first (``reason`` kept)."""
        entry = self.sent_by(request_id, p_daemon)
        agent = entry.agent_of(p_rank) if entry is not None else None
        if entry is None or agent is None:
            return SourceOutcome.NONE, None
        entry.open.discard(agent)
        if not entry.open or entry.state is RecvState.LANDED:
            return SourceOutcome.FINAL, self._drop(request_id)
        if entry.state is RecvState.CANCELLING:
            return SourceOutcome.WAIT, entry  # withdrawn already: the others' answers end it
        entry.state, entry.reason = RecvState.CANCELLING, reason
        outcome, _ = self._withdrawn(entry, now, peer_alive)
        return (SourceOutcome.CANCEL if outcome is EvictOutcome.CANCEL else SourceOutcome.HELD), entry

    def evict(self, request_id: str, now: float, peer_alive: bool,
              reason: str = CANCELLED) -> tuple[EvictOutcome, PendingRecv | None]:
        """The worker (or, with ``reason``, the daemon) withdrew ``request_id``. A
        registration P may be writing into becomes CANCELLING: with a live session to P it
        waits for P's answer (no timer), without one the grace timer runs."""
        entry = self.pending.get(request_id)
        if entry is None:
            return EvictOutcome.NONE, None
        if entry.state is RecvState.CANCELLING:
            if entry.reason != PEER_LOST:
                return EvictOutcome.NONE, None  # withdrawn already
            # Held for a lost P: its grace keeps running, but the worker withdrew it, so
            # a WRITE that still lands no longer makes it done.
            entry.reason = reason
            return EvictOutcome.HELD, entry
        if entry.state is not RecvState.SENT:  # PENDING: P never saw it; LANDED: all written
            return EvictOutcome.FINAL, self._drop(request_id)
        entry.state, entry.reason = RecvState.CANCELLING, reason
        return self._withdrawn(entry, now, peer_alive)

    def peer_lost(self, p_daemon: str, now: float) -> list[PendingRecv]:
        """P's daemon went away without being known dead: a WRITE it posted may still
        land. Its SENT and CANCELLING registrations are held for ``cancel_grace_s``; a
        completion still makes a held SENT registration done."""
        out = []
        for entry in self.sent_to(p_daemon):
            if entry.state is RecvState.SENT:
                entry.state, entry.reason = RecvState.CANCELLING, PEER_LOST
                entry.deadline = now + self.cancel_grace_s  # the full grace, whatever the watchdog said
            elif entry.state is RecvState.CANCELLING and entry.deadline is None:
                entry.deadline = now + self.cancel_grace_s
            elif not entry.held:
                continue  # PENDING, LANDED: nothing of P can still land
            out.append(entry)
        return out

    def peer_back(self, p_daemon: str) -> list[PendingRecv]:
        """A lost P incarnation is reachable again. P dropped the registrations of the
        session it lost, so the held ones will never be written: they wait for P's
        confirmation of a cancel (the caller sends it) instead of the grace timer."""
        out = [e for e in self.sent_to(p_daemon) if e.held]
        for entry in out:
            entry.deadline = None
        return out

    def peer_gone(self, p_daemon: str) -> list[RecvExpiry]:
        """The P incarnation is known dead: nothing of it can land any more."""
        out = []
        for entry in [e for e in self.sent_to(p_daemon) if e.state is not RecvState.PENDING]:
            self._drop(entry.request_id)
            if entry.state is RecvState.LANDED:  # its digests will never come
                reason = f"verify: P daemon {entry.remote.engine_id} restarted before its digests arrived"
                out.append(RecvExpiry(entry, ExpiryAction.FAIL, "verify", reason))
                continue
            if entry.state is RecvState.SENT:
                entry.reason = PEER_LOST
            kind = PEER_LOST if entry.reason == PEER_LOST else "cancel_unconfirmed"
            out.append(RecvExpiry(entry, ExpiryAction.FAIL, kind, self.final_reason(entry, gone=True)))
        return out

    def expire(self, now: float, live_daemons: Container[str]) -> list[RecvExpiry]:
        """Entries whose timer fired. An overdue SENT entry is not dropped but withdrawn
        (P may be writing into its blocks); everything else that is overdue is final."""
        out: list[RecvExpiry] = []
        for e in [e for e in self.pending.values() if e.deadline is not None and e.deadline <= now]:
            if e.state is RecvState.SENT:
                e.state, e.reason = RecvState.CANCELLING, WATCHDOG
                outcome, _ = self._withdrawn(e, now, e.p_daemon in live_daemons)
                out.append(RecvExpiry(e, ExpiryAction.CANCEL if outcome is EvictOutcome.CANCEL else ExpiryAction.HOLD))
                continue
            self._drop(e.request_id)
            if e.state is RecvState.PENDING:
                out.append(RecvExpiry(e, ExpiryAction.FAIL, WATCHDOG, f"watchdog: no push within {self.watchdog_s}s"))
            elif e.state is RecvState.LANDED:
                out.append(RecvExpiry(e, ExpiryAction.FAIL, "verify", "verify: P's digests never arrived"))
            else:
                kind = PEER_LOST if e.reason == PEER_LOST else "cancel_unconfirmed"
                out.append(RecvExpiry(e, ExpiryAction.FAIL, kind, self.final_reason(e)))
        return out

    # ------------------------------------------------------------------ views

    def final_reason(self, entry: PendingRecv, gone: bool = False, settled: bool = False) -> str:
        """What the worker reads when a withdrawn registration ends: ``settled`` when P
        answered (its confirmation, or its WRITE's completion), ``gone`` when P died."""
        peer = entry.remote.engine_id
        if entry.reason == PEER_LOST:
            if gone:
                return f"peer_lost: P daemon {peer} restarted"
            if entry.deadline is None:
                return f"peer_lost: the session to P daemon {peer} was lost and P dropped the registration"
            return f"peer_lost: P daemon {peer} went away; no WRITE landed within {self.cancel_grace_s}s"
        base = f"watchdog: no push within {self.watchdog_s}s" if entry.reason == WATCHDOG else entry.reason
        if gone:
            return f"{base}: P daemon {peer} restarted"
        if entry.deadline is not None and not settled:  # the grace ran out before P answered
            return f"{base}: P did not confirm"
        return base

    def tracks(self, request_id: str) -> bool:
        return request_id in self.pending

    def holder(self, block_ids: list[list[int]]) -> tuple[int, str] | None:
        """A block of ``block_ids`` that a tracked registration holds, and its holder."""
        return self.holders.holder(block_ids)

    def waiting_on(self, engine_id: str) -> list[PendingRecv]:
        return [e for e in self.pending.values() if e.remote.engine_id == engine_id]

    def sent_to(self, p_daemon: str) -> list[PendingRecv]:
        return [e for e in self.pending.values() if e.p_daemon == p_daemon]

    @property
    def busy(self) -> bool:
        """A registration is out at P (or waits for P's digests): poll promptly."""
        return any(e.state is not RecvState.PENDING for e in self.pending.values())

    @property
    def unsettled(self) -> bool:
        """P may still write into some registration's blocks."""
        return any(e.state in (RecvState.SENT, RecvState.CANCELLING) for e in self.pending.values())

    def hot(self, now: float, hot_max_s: float) -> bool:
        """P announced a WRITE into this rank less than ``hot_max_s`` ago."""
        return any(e.announced_at is not None and now - e.announced_at < hot_max_s for e in self.pending.values())

    def sizes(self) -> dict[str, int]:
        return {"d_pending": len(self.pending)}

    def __repr__(self) -> str:
        return f"<ConsumerTable pending={len(self.pending)}>"

    # ------------------------------------------------------------------ internals

    def _withdrawn(self, entry: PendingRecv, now: float, peer_alive: bool) -> tuple[EvictOutcome, PendingRecv]:
        if peer_alive:
            entry.deadline = None
            return EvictOutcome.CANCEL, entry
        entry.deadline = now + self.cancel_grace_s
        return EvictOutcome.HELD, entry

    def _drop(self, request_id: str) -> PendingRecv | None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            self.holders.release(request_id)
        return entry
