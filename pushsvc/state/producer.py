"""P-side matching table: D registrations meet P's finished blocks, in either order.

Pure state. Every method takes ``now`` where time matters and returns what happened;
the caller (``server/sender.py``) does the NIXL and socket I/O.

Life of a P request::

    staged (blocks, lease) --match--> writing --finish--> gone
    registration (D's, ttl) --^          (the lease no longer applies: a WRITE in
                                          flight is settled, never reaped)

**Matching.** Request ids pair a registration with P's blocks: the exact id first, then
the base id with vLLM's per-engine random suffix stripped (``ids.base_request_id``). A
P/D exchange also carries a match key, minted once for it (by the proxy, or by P's
connector): when both sides have one, different keys never pair, so two exchanges that
reused one ``X-Request-Id`` cannot cross (D's request B would decode on P's KV of request
A), while the sub-requests of one exchange (a batch of prompts shares its key) still pair
by their ids. A base id that more than one candidate shares is **ambiguous**: nothing is
paired, and the arrival and the candidates it collided with are all refused.

A registration with no blocks is a **release**: D's request ended before it was
scheduled (vLLM names its dummy for that by the request body's id, not the one P holds
the blocks under). With a key it frees every staged P request of its exchange, and those
that come later; without one it pairs by id like any registration, and is not kept when
nothing is staged for it.

**Who owns a registration.** Registrations are keyed by ``(owner, D's request id)``;
the owner is the D engine the PUSH_REG names, which P checks against the sending agent
before it writes. A cancellation from an engine touches and tombstones only its own.
A registration from an agent P does not know yet is *unverified*: it is kept (D's
``AgentsUpdate`` may still be on its way) but never matched until ``confirm`` says its
sender checked out.

Every table here is bounded: registrations (``max_registrations``, unverified ones
``max_unverified``), staged P requests (``max_staged``: P's blocks bound nothing, since
requests may share blocks through the prefix cache), tombstones, ended exchanges and
released keys (``max_tombstones``, oldest dropped). A registration or staged request that
would wait beyond its cap is refused (``FULL``); one that pairs at once needs no place.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from pushsvc.protocol.notif import PushReg
from pushsvc.state.ids import base_request_id
from pushsvc.state.layout import names_no_block

RegKey = tuple[str, str]  # (D engine id, D's request id)


@dataclass(slots=True)
class Registration:
    reg: PushReg
    sender: str  # NIXL agent name the PUSH_REG came from
    registered_at: float
    expires_at: float
    verified: bool = True

    @property
    def key(self) -> RegKey:
        return (self.reg.decode_engine_id, self.reg.request_id)

    @property
    def request_id(self) -> str:
        return self.reg.request_id

    @property
    def match_key(self) -> str:
        return self.reg.match_key

    @property
    def release(self) -> bool:
        return names_no_block(self.reg.local_block_ids)


@dataclass(slots=True)
class Staged:
    request_id: str
    block_ids: Sequence[Sequence[int]]  # per group a list, or an array (packed ids)
    match_key: str
    staged_at: float
    lease_expires_at: float


@dataclass(slots=True)
class Match:
    """A P request paired with a D registration: ready for handshake and WRITE."""

    staged: Staged
    registration: Registration
    matched_at: float

    @property
    def request_id(self) -> str:
        return self.staged.request_id

    @property
    def block_ids(self) -> Sequence[Sequence[int]]:
        return self.staged.block_ids

    @property
    def remote_request_id(self) -> str:
        return self.registration.request_id


class RegOutcome(Enum):
    STASHED = "stashed"  # kept until P's blocks come
    UNVERIFIED = "unverified"  # kept, but its sender must check out (``confirm``) first
    MATCHED = "matched"  # paired; for a release, with every staged request of its exchange
    RELEASED = "released"  # a release that found nothing staged (its key, if any, is remembered)
    DUPLICATE = "duplicate"
    CANCELLED = "cancelled"  # its owner cancelled this id: a PUSH_REG that was still on the way
    FINISHED = "finished"  # the P request it names (its key and base id) already ended
    AMBIGUOUS = "ambiguous"  # several P requests share its base id: refused with them
    FULL = "full"  # the table holds as many registrations as it may


class StageOutcome(Enum):
    STASHED = "stashed"
    MATCHED = "matched"
    RELEASED = "released"  # D released its exchange before the blocks came: nothing to write
    DUPLICATE = "duplicate"
    AMBIGUOUS = "ambiguous"  # several registrations share its base id: refused with them
    FULL = "full"  # it would wait, and the table holds as many staged requests as it may


@dataclass(frozen=True, slots=True)
class RegResult:
    outcome: RegOutcome
    # MATCHED: one pair; a release with a key pairs every staged request of its exchange.
    matches: tuple[Match, ...] = ()
    # AMBIGUOUS: the staged P requests that collided with it; they are dropped too.
    collided: tuple[Staged, ...] = ()

    @property
    def match(self) -> Match | None:
        return self.matches[0] if self.matches else None


@dataclass(frozen=True, slots=True)
class StageResult:
    outcome: StageOutcome
    match: Match | None = None
    # AMBIGUOUS: the registrations that collided with it; they are dropped too.
    collided: tuple[Registration, ...] = ()


class ExpiryKind(Enum):
    LEASE = "lease"  # P blocks nobody registered for: SendFailed to P's worker
    REGISTRATION = "registration"  # a registration whose blocks never came: dropped


@dataclass(frozen=True, slots=True)
class Expired:
    request_id: str
    kind: ExpiryKind
    reason: str  # final, as the worker or the log should read it
    sender: str = ""
    owner: str = ""


def _same_exchange(a_key: str, b_key: str) -> bool:
    """Two entries may pair unless both carry match keys and the keys differ."""
    return not (a_key and b_key) or a_key == b_key


def _pick(candidates: list, request_id: str, id_of) -> tuple[object | None, tuple]:
    """The one candidate ``request_id`` pairs with: the only one with its exact id, else
    the only one with its base id. Several at the deciding level: ambiguous."""
    exact = [c for c in candidates if id_of(c) == request_id]
    if len(exact) == 1:
        return exact[0], ()
    base = base_request_id(request_id)
    same_base = exact or [c for c in candidates if base_request_id(id_of(c)) == base]
    if len(same_base) == 1:
        return same_base[0], ()
    return None, tuple(same_base)


class _BaseIndex:
    """base id -> keys of the entries that share it, insertion ordered."""

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[str, list] = {}

    def add(self, rid: str, key) -> None:
        self._map.setdefault(base_request_id(rid), []).append(key)

    def remove(self, rid: str, key) -> None:
        base = base_request_id(rid)
        keys = self._map.get(base)
        if keys and key in keys:
            keys.remove(key)
            if not keys:
                del self._map[base]

    def get(self, rid: str) -> list:
        return self._map.get(base_request_id(rid), [])

    def __len__(self) -> int:
        return len(self._map)


class _Expiring:
    """Keys remembered until a deadline, at most ``cap`` of them (the oldest go first)."""

    __slots__ = ("_until", "_cap")

    def __init__(self, cap: int) -> None:
        self._until: OrderedDict = OrderedDict()
        self._cap = cap

    def add(self, key, until: float) -> None:
        self._until[key] = until
        self._until.move_to_end(key)
        while len(self._until) > self._cap:
            self._until.popitem(last=False)

    def __contains__(self, key) -> bool:
        return key in self._until

    def expire(self, now: float) -> None:
        for key in [k for k, t in self._until.items() if t <= now]:
            del self._until[key]

    def __len__(self) -> int:
        return len(self._until)


@dataclass
class ProducerTable:
    lease_s: float
    registration_ttl_s: float
    # An unverified registration waits at most this long for its sender to be announced
    # (D's AgentsUpdate travels behind its PUSH_REG by milliseconds, not seconds).
    unverified_ttl_s: float = 5.0
    max_registrations: int = 1 << 16
    max_unverified: int = 1 << 12
    max_tombstones: int = 1 << 16
    max_staged: int = 1 << 16  # staged P requests, none of them registered for by D yet
    registrations: dict[RegKey, Registration] = field(default_factory=dict)
    staged: dict[str, Staged] = field(default_factory=dict)  # by P's id
    writing: dict[str, Match] = field(default_factory=dict)  # by P's id
    _reg_base: _BaseIndex = field(default_factory=_BaseIndex)  # base of D's id -> registration keys
    _staged_base: _BaseIndex = field(default_factory=_BaseIndex)  # base of P's id -> P ids
    _staged_keys: dict[str, list[str]] = field(default_factory=dict)  # match key -> P ids
    _writing_remote: dict[RegKey, str] = field(default_factory=dict)  # while writing: D's key -> P id
    _unverified: int = 0
    # (owner, D id) whose registration its owner cancelled: a PUSH_REG still in flight
    # behind the cancel must not be stashed and written later.
    cancelled: _Expiring = field(init=False)
    # (match key, base id) of P requests that ended (written, failed, evicted, expired):
    # a registration for one is answered at once instead of waiting in the table.
    finished: _Expiring = field(init=False)
    # Match keys a release named while nothing of its exchange was staged: P requests
    # of that exchange that come later are released on arrival.
    released: _Expiring = field(init=False)

    def __post_init__(self) -> None:
        self.cancelled = _Expiring(self.max_tombstones)
        self.finished = _Expiring(self.max_tombstones)
        self.released = _Expiring(self.max_tombstones)

    # ------------------------------------------------------------------ inputs

    def add_registration(self, reg: PushReg, sender: str, now: float, verified: bool = True) -> RegResult:
        key = (reg.decode_engine_id, reg.request_id)
        if key in self.cancelled:
            return RegResult(RegOutcome.CANCELLED)
        held = self.registrations.get(key)
        if held is not None and verified and not held.verified:
            # Whoever can reach our agent can send a PUSH_REG under D's request id
            # first; the one from D's known agent replaces it rather than being
            # dropped as a duplicate, so the id cannot be squatted.
            self._pop_registration(key)
        elif held is not None or key in self._writing_remote:
            return RegResult(RegOutcome.DUPLICATE)
        if not verified:
            if self._unverified >= self.max_unverified or len(self.registrations) >= self.max_registrations:
                return RegResult(RegOutcome.FULL)
            ttl = min(self.registration_ttl_s, self.unverified_ttl_s)
            self._put_registration(Registration(reg, sender, now, now + ttl, verified=False))
            return RegResult(RegOutcome.UNVERIFIED)
        return self._place_registration(Registration(reg, sender, now, now + self.registration_ttl_s), now)

    def confirm(self, key: RegKey, now: float) -> RegResult | None:
        """The sender of the unverified registration ``key`` checked out: place it now,
        as if it had just arrived from a known agent. None if there is no such entry."""
        registration = self.registrations.get(key)
        if registration is None or registration.verified:
            return None
        self._pop_registration(key)
        registration.verified = True
        registration.expires_at = registration.registered_at + self.registration_ttl_s
        return self._place_registration(registration, now)

    def drop_unverified(self, owner: str, before: float = math.inf) -> list[Registration]:
        """Forget the unverified registrations that claim ``owner`` and arrived before
        ``before``: only an announcement within the session they arrived in may confirm
        them, and that session ended (or they came before the one that opened then)."""
        gone = [r for r in self.registrations.values()
                if not r.verified and r.reg.decode_engine_id == owner and r.registered_at < before]
        for r in gone:
            self._pop_registration(r.key)
        return gone

    def counterpart(self, reg: PushReg) -> Staged | None:
        """The staged P request ``reg`` would pair with, if exactly one (nothing changes)."""
        return self.awaiting(reg.request_id, reg.match_key)

    def awaiting(self, request_id: str, match_key: str) -> Staged | None:
        """The staged P request a registration of D's ``request_id`` and ``match_key``
        would pair with, if exactly one (nothing changes)."""
        found, _ = self._staged_for(request_id, match_key)
        return found

    def unverified_from(self, senders: set[str]) -> list[Registration]:
        return [r for r in self.registrations.values() if not r.verified and r.sender in senders]

    def add_staged(self, request_id: str, block_ids: Sequence[Sequence[int]], now: float, match_key: str = "") -> StageResult:
        if request_id in self.staged or request_id in self.writing:
            return StageResult(StageOutcome.DUPLICATE)
        staged = Staged(request_id, block_ids, match_key, now, now + self.lease_s)
        if match_key and match_key in self.released:
            self._end(staged, now)
            return StageResult(StageOutcome.RELEASED)
        found, collided = self._registration_for(staged)
        if collided:
            for r in collided:
                self._pop_registration(r.key)
            self._end(staged, now)
            return StageResult(StageOutcome.AMBIGUOUS, collided=collided)
        if found is None:
            if len(self.staged) >= self.max_staged:
                self._end(staged, now)  # ended: D's registration under its key is answered at once
                return StageResult(StageOutcome.FULL)
            self.staged[request_id] = staged
            self._staged_base.add(request_id, request_id)
            if match_key:
                self._staged_keys.setdefault(match_key, []).append(request_id)
            return StageResult(StageOutcome.STASHED)
        return StageResult(StageOutcome.MATCHED, self._start(staged, self._pop_registration(found.key), now))

    def tracks(self, request_id: str) -> bool:
        """P blocks of ``request_id`` are staged or being written: a second SendReady
        for it is a duplicate, whatever blocks it names."""
        return request_id in self.staged or request_id in self.writing

    def finish(self, request_id: str, now: float) -> Match | None:
        """The WRITE for ``request_id`` settled (done or failed), or nothing was to be
        written (a release): forget it."""
        match = self.writing.pop(request_id, None)
        if match is not None:
            if self._writing_remote.get(match.registration.key) == request_id:  # a release's is not indexed
                del self._writing_remote[match.registration.key]
            self._end(match.staged, now)
        return match

    def cancel_registration(self, owner: str, remote_id: str, now: float) -> Match | None:
        """``owner`` withdrew its registration ``remote_id``. Returns the match if P is
        already writing it (the caller settles that first); otherwise nothing will be
        written. Only ``owner``'s own registration is touched and tombstoned."""
        key = (owner, remote_id)
        self.cancelled.add(key, now + self.registration_ttl_s)
        if key in self.registrations:
            self._pop_registration(key)
            return None
        local = self._writing_remote.get(key)
        return self.writing[local] if local is not None else None

    def evict(self, request_id: str, now: float) -> Staged | None:
        """Drop staged blocks of a P request. A WRITE in flight is not evictable."""
        if request_id not in self.staged:
            return None
        staged = self._pop_staged(request_id)
        self._end(staged, now)
        return staged

    def drop_registrations_from(self, senders: set[str]) -> list[Registration]:
        """Forget registrations sent by agents that went away."""
        gone = [r for r in self.registrations.values() if r.sender in senders]
        for r in gone:
            self._pop_registration(r.key)
        return gone

    def drop_registration(self, key: RegKey) -> Registration | None:
        return self._pop_registration(key) if key in self.registrations else None

    def expire(self, now: float) -> list[Expired]:
        out: list[Expired] = []
        for rid in [r for r, s in self.staged.items() if s.lease_expires_at <= now]:
            staged = self._pop_staged(rid)
            self._end(staged, now)
            out.append(Expired(rid, ExpiryKind.LEASE, "lease expired: no registration"))
        for key in [k for k, g in self.registrations.items() if g.expires_at <= now]:
            reg = self._pop_registration(key)
            waited = round(reg.expires_at - reg.registered_at, 3)
            why = "its sender was never announced" if not reg.verified else "P's blocks never came"
            out.append(Expired(reg.request_id, ExpiryKind.REGISTRATION,
                               f"registration expired after {waited}s: {why}", reg.sender, reg.reg.decode_engine_id))
        self.cancelled.expire(now)
        self.finished.expire(now)
        self.released.expire(now)
        return out

    # ------------------------------------------------------------------ views

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
        return f"<ProducerTable {self.sizes()} unverified={self._unverified} tombstones={len(self.cancelled)}>"

    # ------------------------------------------------------------------ matching

    def _place_registration(self, registration: Registration, now: float) -> RegResult:
        """A verified registration arrives (or was just confirmed)."""
        if registration.release and registration.match_key:
            return self._release(registration, now)
        found, collided = self._staged_for(registration.request_id, registration.match_key)
        if collided:
            for s in collided:
                self._pop_staged(s.request_id)
                self._end(s, now)
            return RegResult(RegOutcome.AMBIGUOUS, collided=collided)
        if found is not None:
            return RegResult(RegOutcome.MATCHED, (self._start(self._pop_staged(found.request_id), registration, now),))
        if registration.release:
            # Without a key nothing ties a release to P blocks that come later (vLLM's
            # dummy carries the request body's id): it frees what is staged, or nothing.
            return RegResult(RegOutcome.RELEASED)
        ended = (registration.match_key, base_request_id(registration.request_id))
        if registration.match_key and ended in self.finished:
            return RegResult(RegOutcome.FINISHED)
        if len(self.registrations) >= self.max_registrations:
            return RegResult(RegOutcome.FULL)
        self._put_registration(registration)
        return RegResult(RegOutcome.STASHED)

    def _release(self, registration: Registration, now: float) -> RegResult:
        """A keyed release frees every staged request of its exchange, now and later."""
        ids = list(self._staged_keys.get(registration.match_key, ()))
        self.released.add(registration.match_key, now + self.registration_ttl_s)
        if not ids:
            return RegResult(RegOutcome.RELEASED)
        return RegResult(RegOutcome.MATCHED, tuple(self._start(self._pop_staged(rid), registration, now,
                                                               track_remote=False) for rid in ids))

    def _staged_for(self, rid: str, key: str) -> tuple[Staged | None, tuple[Staged, ...]]:
        """The staged P request a registration of D's ``rid`` and ``key`` pairs with, or
        the candidates that make the pairing ambiguous."""
        candidates = [self.staged[s] for s in self._staged_base.get(rid)
                      if _same_exchange(self.staged[s].match_key, key)]
        found, collided = _pick(candidates, rid, lambda s: s.request_id)
        return found, collided  # type: ignore[return-value]

    def _registration_for(self, staged: Staged) -> tuple[Registration | None, tuple[Registration, ...]]:
        candidates = [r for k in self._reg_base.get(staged.request_id)
                      if (r := self.registrations[k]).verified and _same_exchange(r.match_key, staged.match_key)]
        found, collided = _pick(candidates, staged.request_id, lambda r: r.request_id)
        return found, collided  # type: ignore[return-value]

    def _start(self, staged: Staged, registration: Registration, now: float, track_remote: bool = True) -> Match:
        match = Match(staged, registration, now)
        self.writing[staged.request_id] = match
        if track_remote:
            self._writing_remote[registration.key] = staged.request_id
        return match

    def _end(self, staged: Staged, now: float) -> None:
        if staged.match_key:
            self.finished.add((staged.match_key, base_request_id(staged.request_id)), now + self.registration_ttl_s)

    def _put_registration(self, registration: Registration) -> None:
        key = registration.key
        self.registrations[key] = registration
        self._reg_base.add(registration.request_id, key)
        if not registration.verified:
            self._unverified += 1

    def _pop_staged(self, rid: str) -> Staged:
        staged = self.staged.pop(rid)
        self._staged_base.remove(rid, rid)
        ids = self._staged_keys.get(staged.match_key)
        if ids is not None and rid in ids:
            ids.remove(rid)
            if not ids:
                del self._staged_keys[staged.match_key]
        return staged

    def _pop_registration(self, key: RegKey) -> Registration:
        registration = self.registrations.pop(key)
        self._reg_base.remove(registration.request_id, key)
        if not registration.verified:
            self._unverified -= 1
        return registration
