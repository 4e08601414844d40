"""ProducerTable against a reference model: random sequences of registrations (owners,
match keys, unverified senders, releases), P blocks, confirmations, cancellations,
finishes, evictions, drops and expiries, with the matching invariants checked after
every step."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from pushsvc.protocol.notif import PushReg
from pushsvc.state.ids import base_request_id
from pushsvc.state.producer import (
    ExpiryKind,
    Match,
    ProducerTable,
    RegKey,
    RegOutcome,
    RegResult,
    StageOutcome,
    StageResult,
)

LEASE = 30.0
TTL = 10.0
UNVERIFIED_TTL = 5.0

# Few ids, so that exact ids, base ids and keys collide often.
PREFIXES = ["cmpl-a-0", "cmpl-a-1"]
SUFFIXES = ["", "-aaaaaaaa", "-bbbbbbbb", "-cccccccc"]
ALL_IDS = [p + s for p in PREFIXES for s in SUFFIXES]
IDS = st.sampled_from(ALL_IDS)
OWNERS = st.sampled_from(["d-eng-0", "d-eng-1"])
KEYS = st.sampled_from(["", "", "k1", "k2"])  # unkeyed as often as keyed
ALL_SENDERS = ["agent-0", "agent-1", "agent-2"]
SENDERS = st.sampled_from(ALL_SENDERS)
RELEASE = st.sampled_from([False, False, False, True])  # D's request ended unscheduled: no blocks
NO_BLOCKS = st.sampled_from([[], [[]]])
MOSTLY = st.sampled_from([True, True, True, False])

T = TypeVar("T")

UNBOUNDED = {"max_registrations": 1 << 16, "max_unverified": 1 << 12, "max_tombstones": 1 << 16,
             "max_staged": 1 << 16}
TIGHT = {"max_registrations": 3, "max_unverified": 1, "max_tombstones": 2, "max_staged": 2}


@dataclass
class ModelReg:
    reg: PushReg
    sender: str
    registered_at: float
    expires_at: float
    verified: bool

    @property
    def rid(self) -> str:
        return self.reg.request_id

    @property
    def match_key(self) -> str:
        return self.reg.match_key

    @property
    def release(self) -> bool:
        return not any(self.reg.local_block_ids)


@dataclass
class ModelStaged:
    blocks: list[list[int]]
    match_key: str
    staged_at: float
    lease: float


@dataclass
class ModelWrite:
    reg_key: RegKey
    staged_key: str
    reg_match_key: str
    # A keyed release's match: several may share its registration, so none is indexed
    # by it (a DUPLICATE or a cancel of that D id does not see them).
    keyed_release: bool = False


def same_exchange(a_key: str, b_key: str) -> bool:
    """Keys filter: entries of two exchanges (both keyed, keys unequal) never pair."""
    return not (a_key and b_key) or a_key == b_key


def pairable(pid: str, staged_key: str, rid: str, reg_key: str) -> bool:
    """Ids pair: one exchange (as far as keys tell) and one base id."""
    return same_exchange(staged_key, reg_key) and base_request_id(pid) == base_request_id(rid)


def pick(candidates: dict[T, str], request_id: str) -> tuple[T | None, list[T]]:
    """Among ``candidates`` (candidate -> its request id, each pairable with the arrival),
    the exact ids decide if there are any, else all of them; more than one is ambiguous."""
    exact = [c for c, rid in candidates.items() if rid == request_id]
    level = exact or list(candidates)
    if len(level) == 1:
        return level[0], []
    return None, level


class ProducerMachine(RuleBasedStateMachine):
    def __init__(self, make_reg, caps: dict[str, int]) -> None:
        super().__init__()
        self.make_reg = make_reg
        self.caps = caps
        self.table = ProducerTable(lease_s=LEASE, registration_ttl_s=TTL, unverified_ttl_s=UNVERIFIED_TTL, **caps)
        self.now = 0.0
        self.serial = 0
        # Reference model; dict order is arrival order, as in the table.
        self.regs: dict[RegKey, ModelReg] = {}
        self.staged: dict[str, ModelStaged] = {}
        self.writing: dict[str, ModelWrite] = {}
        self.cancelled: OrderedDict[RegKey, float] = OrderedDict()
        self.finished: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.released: OrderedDict[str, float] = OrderedDict()

    # ------------------------------------------------------------ model helpers

    def _remember(self, memory: OrderedDict, key, until: float) -> None:
        memory[key] = until
        memory.move_to_end(key)
        while len(memory) > self.caps["max_tombstones"]:
            memory.popitem(last=False)

    def _end(self, staged_key: str, pid: str) -> None:
        """P's request ``pid`` ended: remembered by its exchange and base id."""
        if staged_key:
            self._remember(self.finished, (staged_key, base_request_id(pid)), self.now + TTL)

    @staticmethod
    def _among(data: st.DataObject, fit: list[str]) -> str:
        """Mostly one of ``fit`` (else most steps would hit nothing), now and then any id."""
        if fit and data.draw(MOSTLY, label="fit"):
            return data.draw(st.sampled_from(fit), label="pid")
        return data.draw(IDS, label="pid")

    def _writing_under(self, k: RegKey) -> str | None:
        return next((p for p, w in self.writing.items() if not w.keyed_release and w.reg_key == k), None)

    def _check_match(self, match: Match | None, pid: str, blocks: list[list[int]], reg: ModelReg) -> None:
        assert match is not None
        assert (match.request_id, match.remote_request_id) == (pid, reg.rid)
        assert match.registration.reg is reg.reg and match.registration.sender == reg.sender
        assert match.registration.verified
        assert match.block_ids == blocks
        assert match.matched_at == self.now

    def _place(self, k: RegKey, reg: ModelReg, got: RegResult) -> None:
        """The model of placing a verified registration, checked against ``got``."""
        if reg.release and reg.match_key:
            self._remember(self.released, reg.match_key, self.now + TTL)
            pids = [p for p, s in self.staged.items() if s.match_key == reg.match_key]
            if not pids:
                assert got == RegResult(RegOutcome.RELEASED)
                return
            assert got.outcome is RegOutcome.MATCHED and got.collided == ()
            assert [m.request_id for m in got.matches] == pids and got.match is got.matches[0]
            for pid, match in zip(pids, got.matches, strict=True):
                self._check_match(match, pid, self.staged[pid].blocks, reg)
                self.writing[pid] = ModelWrite(k, self.staged.pop(pid).match_key, reg.match_key, keyed_release=True)
            return
        found, collided = pick({p: p for p, s in self.staged.items()
                                if pairable(p, s.match_key, reg.rid, reg.match_key)}, reg.rid)
        if collided:
            assert got.outcome is RegOutcome.AMBIGUOUS and got.matches == ()
            assert [s.request_id for s in got.collided] == collided
            for pid in collided:
                self._end(self.staged.pop(pid).match_key, pid)
        elif found is not None:
            assert got.outcome is RegOutcome.MATCHED and got.collided == () and len(got.matches) == 1
            self._check_match(got.match, found, self.staged[found].blocks, reg)
            self.writing[found] = ModelWrite(k, self.staged.pop(found).match_key, reg.match_key)
        elif reg.release:  # without a key: nothing ties it to P blocks that come later
            assert got == RegResult(RegOutcome.RELEASED)
        elif reg.match_key and (reg.match_key, base_request_id(reg.rid)) in self.finished:
            assert got == RegResult(RegOutcome.FINISHED)
        elif len(self.regs) >= self.caps["max_registrations"]:
            assert got == RegResult(RegOutcome.FULL)
        else:
            assert got == RegResult(RegOutcome.STASHED)
            self.regs[k] = reg

    # ------------------------------------------------------------ rules

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 5.0, 10.0, 30.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(owner=OWNERS, rid=IDS, key=KEYS, sender=SENDERS, verified=st.booleans(), release=RELEASE,
          no_blocks=NO_BLOCKS)
    def add_registration(self, owner: str, rid: str, key: str, sender: str, verified: bool, release: bool,
                         no_blocks: list[list[int]]) -> None:
        self.serial += 1
        blocks = no_blocks if release else [[self.serial]]
        reg = self.make_reg(rid, decode_engine_id=owner, match_key=key, local_block_ids=blocks)
        got = self.table.add_registration(reg, sender, self.now, verified=verified)
        k = (owner, rid)
        if k in self.cancelled:
            assert got == RegResult(RegOutcome.CANCELLED)
            return
        held = self.regs.get(k)
        if held is not None and verified and not held.verified:
            del self.regs[k]  # a squatter on its (owner, id) yields
        elif held is not None or self._writing_under(k) is not None:
            assert got == RegResult(RegOutcome.DUPLICATE)
            return
        if not verified:
            unverified = sum(not r.verified for r in self.regs.values())
            if unverified >= self.caps["max_unverified"] or len(self.regs) >= self.caps["max_registrations"]:
                assert got == RegResult(RegOutcome.FULL)
                return
            assert got == RegResult(RegOutcome.UNVERIFIED)
            self.regs[k] = ModelReg(reg, sender, self.now, self.now + min(TTL, UNVERIFIED_TTL), False)
            return
        self._place(k, ModelReg(reg, sender, self.now, self.now + TTL, True), got)

    @rule(data=st.data(), owner=OWNERS, rid=IDS)
    def confirm(self, data: st.DataObject, owner: str, rid: str) -> None:
        waiting = [k for k, r in self.regs.items() if not r.verified]
        k = data.draw(st.sampled_from(waiting)) if waiting and data.draw(st.booleans()) else (owner, rid)
        reg = self.regs.get(k)
        got = self.table.confirm(k, self.now)
        if reg is None or reg.verified:
            assert got is None
            return
        assert got is not None
        del self.regs[k]
        reg.verified = True
        reg.expires_at = reg.registered_at + TTL
        self._place(k, reg, got)

    @rule(data=st.data(), key=KEYS)
    def add_staged(self, data: st.DataObject, key: str) -> None:
        pid = self._among(data, [p for p in ALL_IDS if p not in self.staged and p not in self.writing])
        self.serial += 1
        blocks = [[self.serial]]
        got = self.table.add_staged(pid, blocks, self.now, match_key=key)
        if pid in self.staged or pid in self.writing:
            assert got == StageResult(StageOutcome.DUPLICATE)
            return
        if key and key in self.released:
            assert got == StageResult(StageOutcome.RELEASED)
            self._end(key, pid)
            return
        found, collided = pick({k: r.rid for k, r in self.regs.items()
                                if r.verified and pairable(pid, key, r.rid, r.match_key)}, pid)
        if collided:
            assert got.outcome is StageOutcome.AMBIGUOUS and got.match is None
            assert [r.key for r in got.collided] == collided
            for k in collided:
                del self.regs[k]
            self._end(key, pid)
        elif found is None and len(self.staged) >= self.caps["max_staged"]:
            assert got == StageResult(StageOutcome.FULL)  # it would wait, and no place is free
            self._end(key, pid)
        elif found is None:
            assert got == StageResult(StageOutcome.STASHED)
            self.staged[pid] = ModelStaged(blocks, key, self.now, self.now + LEASE)
        else:
            assert got.outcome is StageOutcome.MATCHED and got.collided == ()
            reg = self.regs.pop(found)
            self._check_match(got.match, pid, blocks, reg)
            assert got.match is not None and got.match.block_ids is blocks
            self.writing[pid] = ModelWrite(found, key, reg.match_key)

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        pid = self._among(data, list(self.writing))
        write = self.writing.get(pid)
        if write is not None and write.keyed_release and self._writing_under(write.reg_key) is not None:
            # Not modelled: settling a release's match drops the index entry of another
            # WRITE under its D id (test_finishing_a_release_keeps_another_write_under_its_d_id).
            return
        match = self.table.finish(pid, self.now)
        write = self.writing.pop(pid, None)
        if write is None:
            assert match is None
            return
        assert match is not None and (match.request_id, match.registration.key) == (pid, write.reg_key)
        self._end(write.staged_key, pid)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        pid = self._among(data, list(self.staged))
        got = self.table.evict(pid, self.now)
        staged = self.staged.pop(pid, None)
        if staged is None:
            assert got is None
            return
        assert got is not None and (got.request_id, got.block_ids) == (pid, staged.blocks)
        self._end(staged.match_key, pid)

    @rule(owner=OWNERS, rid=IDS)
    def cancel_registration(self, owner: str, rid: str) -> None:
        k = (owner, rid)
        got = self.table.cancel_registration(owner, rid, self.now)
        self._remember(self.cancelled, k, self.now + TTL)
        if k in self.regs:
            del self.regs[k]
            assert got is None
            return
        local = self._writing_under(k)
        if local is None:
            assert got is None
        else:
            assert got is self.table.writing[local] and got.registration.key == k

    @rule()
    def expire(self) -> None:
        got = self.table.expire(self.now)
        leases = [p for p, s in self.staged.items() if s.lease <= self.now]
        regs = [k for k, r in self.regs.items() if r.expires_at <= self.now]
        assert [e.request_id for e in got if e.kind is ExpiryKind.LEASE] == leases
        assert [(e.owner, e.request_id) for e in got if e.kind is ExpiryKind.REGISTRATION] == regs
        assert len(got) == len(leases) + len(regs)
        for e in got:
            if e.kind is ExpiryKind.LEASE:
                assert (e.sender, e.owner, e.reason) == ("", "", "lease expired: no registration")
                self._end(self.staged.pop(e.request_id).match_key, e.request_id)
            else:
                reg = self.regs.pop((e.owner, e.request_id))
                assert e.sender == reg.sender
                # The reason names the wait it ran out of.
                waited, why = ((TTL, "P's blocks never came") if reg.verified
                               else (min(TTL, UNVERIFIED_TTL), "its sender was never announced"))
                assert e.reason == f"registration expired after {waited}s: {why}"
        for memory in (self.cancelled, self.finished, self.released):
            for key in [k for k, t in memory.items() if t <= self.now]:
                del memory[key]

    @rule(senders=st.sets(SENDERS, max_size=2))
    def drop_registrations_from(self, senders: set[str]) -> None:
        gone = self.table.drop_registrations_from(senders)
        want = [k for k, r in self.regs.items() if r.sender in senders]
        assert [g.key for g in gone] == want
        for k in want:
            del self.regs[k]

    @rule(owner=OWNERS)
    def drop_unverified(self, owner: str) -> None:
        gone = self.table.drop_unverified(owner)
        want = [k for k, r in self.regs.items() if not r.verified and k[0] == owner]
        assert [g.key for g in gone] == want
        for k in want:
            del self.regs[k]

    @rule(owner=OWNERS, rid=IDS, key=KEYS)
    def counterpart(self, owner: str, rid: str, key: str) -> None:
        reg = self.make_reg(rid, decode_engine_id=owner, match_key=key)
        found, _ = pick({p: p for p, s in self.staged.items() if pairable(p, s.match_key, rid, key)}, rid)
        got = self.table.counterpart(reg)
        assert got is (None if found is None else self.table.staged[found])
        assert self.table.awaiting(rid, key) is got  # what D's RegSent names (side channel 1.9)

    @rule(owner=OWNERS, rid=IDS)
    def drop_registration(self, owner: str, rid: str) -> None:
        got = self.table.drop_registration((owner, rid))
        want = self.regs.pop((owner, rid), None)
        assert (got is None) == (want is None)
        if want is not None:
            assert got is not None and got.reg is want.reg

    # ------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_model(self) -> None:
        t = self.table
        assert list(t.registrations) == list(self.regs)
        assert list(t.staged) == list(self.staged)
        assert list(t.writing) == list(self.writing)
        for pid, want in self.writing.items():
            m = t.writing[pid]
            assert (m.registration.key, m.staged.match_key, m.registration.match_key) == (
                want.reg_key, want.staged_key, want.reg_match_key)
            assert m.registration.release or not want.keyed_release
        for k, want in self.regs.items():
            got = t.registrations[k]
            assert got.reg is want.reg and got.key == k
            assert (got.sender, got.registered_at, got.expires_at, got.verified) == (
                want.sender, want.registered_at, want.expires_at, want.verified)
        for pid, want in self.staged.items():
            got = t.staged[pid]
            assert (got.request_id, got.block_ids, got.match_key, got.staged_at, got.lease_expires_at) == (
                pid, want.blocks, want.match_key, want.staged_at, want.lease)
        assert list(t.cancelled._until.items()) == list(self.cancelled.items())
        assert list(t.finished._until.items()) == list(self.finished.items())
        assert list(t.released._until.items()) == list(self.released.items())

    @invariant()
    def no_request_in_two_tables(self) -> None:
        t = self.table
        assert not set(t.staged) & set(t.writing)
        remote = [m.registration.key for m in t.writing.values()
                  if not (m.registration.release and m.registration.match_key)]
        assert len(remote) == len(set(remote)), "one D registration written by two P requests"
        assert not set(t.registrations) & set(remote)

    @invariant()
    def matched_pairs_never_cross_exchanges(self) -> None:
        for pid, m in self.table.writing.items():
            assert m.request_id == pid and m.registration.verified
            assert same_exchange(m.staged.match_key, m.registration.match_key), (pid, m.remote_request_id)

    @invariant()
    def matched_pairs_share_an_id_unless_a_keyed_release(self) -> None:
        for pid, m in self.table.writing.items():
            if m.registration.release and m.registration.match_key:
                assert m.staged.match_key == m.registration.match_key
            else:
                assert base_request_id(pid) == base_request_id(m.remote_request_id), (pid, m.remote_request_id)

    @invariant()
    def nothing_pairable_left_unmatched(self) -> None:
        """A staged request and a verified registration that the rule pairs would have
        been paired (or refused as ambiguous, with both dropped); a keyed release leaves
        nothing of its exchange staged. Only unverified registrations wait beside their
        blocks."""
        t = self.table
        verified = [r for r in t.registrations.values() if r.verified]
        assert not [r.key for r in verified if r.release], "a release is kept only while unverified"
        for pid, s in t.staged.items():
            assert s.match_key not in t.released, pid
            for r in verified:
                assert not pairable(pid, s.match_key, r.request_id, r.match_key), (pid, r.key)

    @invariant()
    def indexes_consistent_with_dicts(self) -> None:
        t = self.table
        reg_base: dict[str, list[RegKey]] = {}
        for k, r in t.registrations.items():  # insertion order == index order
            reg_base.setdefault(base_request_id(r.request_id), []).append(k)
        staged_base: dict[str, list[str]] = {}
        staged_keys: dict[str, list[str]] = {}
        for pid, s in t.staged.items():
            staged_base.setdefault(base_request_id(pid), []).append(pid)
            if s.match_key:
                staged_keys.setdefault(s.match_key, []).append(pid)
        assert t._reg_base._map == reg_base and len(t._reg_base) == len(reg_base)
        assert t._staged_base._map == staged_base and len(t._staged_base) == len(staged_base)
        assert t._staged_keys == staged_keys
        assert t._writing_remote == {w.reg_key: p for p, w in self.writing.items() if not w.keyed_release}
        assert t._unverified == sum(not r.verified for r in t.registrations.values())

    @invariant()
    def bounded(self) -> None:
        t = self.table
        assert len(t.registrations) <= self.caps["max_registrations"]
        assert t._unverified <= self.caps["max_unverified"]
        for memory in (t.cancelled, t.finished, t.released):
            assert len(memory) <= self.caps["max_tombstones"]

    @invariant()
    def views_agree(self) -> None:
        t = self.table
        assert t.sizes() == {
            "p_registrations": len(self.regs),
            "p_staged": len(self.staged),
            "p_writing": len(self.writing),
        }
        assert t.busy == bool(self.staged or self.writing)
        for pid in ALL_IDS:
            assert t.tracks(pid) == (pid in self.staged or pid in self.writing)
        assert t.unverified_from(set(ALL_SENDERS)) == [t.registrations[k] for k, r in self.regs.items()
                                                       if not r.verified]


@pytest.mark.parametrize("caps", [UNBOUNDED, TIGHT], ids=["unbounded", "tight"])
def test_producer_table_state_machine(push_reg, caps: dict[str, int]) -> None:
    run_state_machine_as_test(
        lambda: ProducerMachine(push_reg, caps),
        settings=settings(max_examples=400, stateful_step_count=80, deadline=None),
    )
