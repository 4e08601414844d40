"""P-side matching table: D registrations meet P's finished blocks, in either order.

Pure state. Every method takes ``now`` where time matters and returns what happened;
the caller (the daemon's push service) does the NIXL and socket I/O.

Life of a P request::

    staged (blocks, lease) --match--> writing --write_done/write_failed--> gone
    registration (D's, ttl) --^                    (lease no longer applies: a WRITE
                                                    in flight is settled, never reaped)

Matching tries the exact request id first, then the base id with vLLM's per-engine
random suffix stripped (see ``ids.base_request_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pushsvc.protocol.notif import PushReg
from pushsvc.state.ids import base_request_id


@dataclass(slots=True)
class Registration:
    reg: PushReg
    sender: str  # NIXL agent name the PUSH_REG came from
    expires_at: float
    # The sender was a known agent of the engine and rank the PUSH_REG names. An
    # unknown one is kept (D's AgentsUpdate may still be on its way) but yields.
    verified: bool = True


@dataclass(slots=True)
class Staged:
    request_id: str
    block_ids: list[list[int]]
    lease_expires_at: float


@dataclass(slots=True)
class Match:
    """A P request paired with a D registration: ready for handshake and WRITE."""

    request_id: str
    block_ids: list[list[int]]
    registration: Registration
    matched_at: float

    @property
    def remote_request_id(self) -> str:
        return self.registration.reg.request_id


class RegOutcome(Enum):
    STASHED = "stashed"
    MATCHED = "matched"
    DUPLICATE = "duplicate"
    CANCELLED = "cancelled"


class StageOutcome(Enum):
    STASHED = "stashed"
    MATCHED = "matched"
    DUPLICATE = "duplicate"


@dataclass(frozen=True, slots=True)
class Expired:
    request_id: str
    kind: str  # "lease" (P blocks never claimed) or "registration" (D never matched)
    sender: str = ""


class _BaseIndex:
    """base id -> ids that share it, insertion ordered (oldest first)."""

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[str, list[str]] = {}

    def add(self, rid: str) -> None:
        self._map.setdefault(base_request_id(rid), []).append(rid)

    def remove(self, rid: str) -> None:
        base = base_request_id(rid)
        ids = self._map.get(base)
        if ids and rid in ids:
            ids.remove(rid)
            if not ids:
                del self._map[base]

    def first(self, rid: str) -> str | None:
        ids = self._map.get(base_request_id(rid))
        return ids[0] if ids else None

    def __len__(self) -> int:
        return len(self._map)


@dataclass
class ProducerTable:
    lease_s: float
    registration_ttl_s: float
    registrations: dict[str, Registration] = field(default_factory=dict)  # by D's id
    staged: dict[str, Staged] = field(default_factory=dict)  # by P's id
    writing: dict[str, Match] = field(default_factory=dict)  # by P's id
    _reg_index: _BaseIndex = field(default_factory=_BaseIndex)
    _staged_index: _BaseIndex = field(default_factory=_BaseIndex)
    _writing_remote: dict[str, str] = field(default_factory=dict)  # D id -> P id, while writing
    # D ids whose registration D cancelled: a PUSH_REG still in flight behind the
    # cancel must not be stashed and written later.
    cancelled: dict[str, float] = field(default_factory=dict)

    # ------------------------------------------------------------------ inputs

    def add_registration(self, reg: PushReg, sender: str, now: float,
                         verified: bool = True) -> tuple[RegOutcome, Match | None]:
        rid = reg.request_id
        if rid in self.cancelled:
            return RegOutcome.CANCELLED, None
        held = self.registrations.get(rid)
        if held is not None and verified and not held.verified:
            # Whoever can reach our agent can send a PUSH_REG under D's request id
            # first; the one from D's known agent replaces it rather than being
            # dropped as a duplicate, so the id cannot be squatted.
            self._pop_registration(rid)
        elif held is not None or rid in self._writing_remote:
            return RegOutcome.DUPLICATE, None
        registration = Registration(reg, sender, now + self.registration_ttl_s, verified)
        local = rid if rid in self.staged else self._staged_index.first(rid)
        if local is None:
            self.registrations[rid] = registration
            self._reg_index.add(rid)
            return RegOutcome.STASHED, None
        return RegOutcome.MATCHED, self._start(self._pop_staged(local), registration, now)

    def add_staged(self, request_id: str, block_ids: list[list[int]], now: float) -> tuple[StageOutcome, Match | None]:
        if request_id in self.staged or request_id in self.writing:
            return StageOutcome.DUPLICATE, None
        staged = Staged(request_id, block_ids, now + self.lease_s)
        remote = request_id if request_id in self.registrations else self._reg_index.first(request_id)
        if remote is None:
            self.staged[request_id] = staged
            self._staged_index.add(request_id)
            return StageOutcome.STASHED, None
        return StageOutcome.MATCHED, self._start(staged, self._pop_registration(remote), now)

    def tracks(self, request_id: str) -> bool:
        """P blocks of ``request_id`` are staged or being written: a second SendReady
        for it is a duplicate, whatever blocks it names."""
        return request_id in self.staged or request_id in self.writing

    def finish(self, request_id: str) -> Match | None:
        """The WRITE for ``request_id`` settled (done or failed): forget it."""
        match = self.writing.pop(request_id, None)
        if match is not None:
            self._writing_remote.pop(match.remote_request_id, None)
        return match

    def cancel_registration(self, remote_id: str, now: float) -> Match | None:
        """D withdrew registration ``remote_id``. Returns the match if P is already
        writing it (the caller settles that first); otherwise nothing will be written."""
        self.cancelled[remote_id] = now + self.registration_ttl_s
        if remote_id in self.registrations:
            self._pop_registration(remote_id)
            return None
        local = self._writing_remote.get(remote_id)
        return self.writing[local] if local is not None else None

    def evict(self, request_id: str) -> bool:
        """Drop staged blocks of a P request. A WRITE in flight is not evictable."""
        if request_id in self.staged:
            self._pop_staged(request_id)
            return True
        return False

    def drop_registrations_from(self, senders: set[str]) -> list[Registration]:
        """Forget registrations sent by agents of a peer that went away."""
        gone = [r for r in self.registrations.values() if r.sender in senders]
        for r in gone:
            self._pop_registration(r.reg.request_id)
        return gone

    def expire(self, now: float) -> list[Expired]:
        out: list[Expired] = []
        for rid in [r for r, s in self.staged.items() if s.lease_expires_at <= now]:
            self._pop_staged(rid)
            out.append(Expired(rid, "lease"))
        for rid in [r for r, g in self.registrations.items() if g.expires_at <= now]:
            reg = self._pop_registration(rid)
            out.append(Expired(rid, "registration", reg.sender))
        for rid in [r for r, t in self.cancelled.items() if t <= now]:
            del self.cancelled[rid]
        return out

    # ------------------------------------------------------------------ views

    def next_deadline(self) -> float | None:
        times = [s.lease_expires_at for s in self.staged.values()]
        times += [r.expires_at for r in self.registrations.values()]
        return min(times) if times else None

    @property
    def busy(self) -> bool:
        """Unmatched blocks or WRITEs in flight: notifications must be polled promptly."""
        return bool(self.staged or self.writing)

    def sizes(self) -> dict[str, int]:
        return {
            "p_registrations": len(self.registrations),
            "p_staged": len(self.staged),
            "p_writing": len(self.writing),
        }

    def __repr__(self) -> str:
        return f"<ProducerTable {self.sizes()}>"

    # ------------------------------------------------------------------ internals

    def _start(self, staged: Staged, registration: Registration, now: float) -> Match:
        match = Match(staged.request_id, staged.block_ids, registration, now)
        self.writing[staged.request_id] = match
        self._writing_remote[registration.reg.request_id] = staged.request_id
        return match

    def _pop_staged(self, rid: str) -> Staged:
        self._staged_index.remove(rid)
        return self.staged.pop(rid)

    def _pop_registration(self, rid: str) -> Registration:
        self._reg_index.remove(rid)
        return self.registrations.pop(rid)
