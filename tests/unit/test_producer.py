"""ProducerTable: D registrations meet P's finished blocks, in either order."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from pushsvc.state.ids import base_request_id
from pushsvc.state.producer import (
    Expired,
    Match,
    ProducerTable,
    RegOutcome,
    StageOutcome,
)

LEASE = 30.0
TTL = 10.0

P_ID = "cmpl-abc-0-1a2b3c4d"  # P's id for the request
D_ID = "cmpl-abc-0-deadbeef"  # D's id for the same request: same base, other suffix
BLOCKS = [[7, 8, 9]]


@pytest.fixture
def table() -> ProducerTable:
    return ProducerTable(lease_s=LEASE, registration_ttl_s=TTL)


def only_match(table: ProducerTable) -> Match:
    assert len(table.writing) == 1
    return next(iter(table.writing.values()))


# ---------------------------------------------------------------- either order


def test_registration_first_then_blocks(table, push_reg) -> None:
    reg = push_reg(D_ID, local_block_ids=[[0, 1, 2]])
    assert table.add_registration(reg, "d-agent-0", now=1.0) == (RegOutcome.STASHED, None)
    assert table.sizes() == {"p_registrations": 1, "p_staged": 0, "p_writing": 0}
    assert not table.busy

    outcome, match = table.add_staged(P_ID, BLOCKS, now=3.0)

    assert outcome is StageOutcome.MATCHED
    assert match is not None
    assert match.request_id == P_ID
    assert match.remote_request_id == D_ID
    assert match.block_ids == BLOCKS
    assert match.registration.reg is reg
    assert match.registration.sender == "d-agent-0"
    assert match.matched_at == 3.0
    assert table.writing == {P_ID: match}
    assert table.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}
    assert table.busy


def test_blocks_first_then_registration(table, push_reg) -> None:
    assert table.add_staged(P_ID, BLOCKS, now=1.0) == (StageOutcome.STASHED, None)
    assert table.sizes() == {"p_registrations": 0, "p_staged": 1, "p_writing": 0}
    assert table.busy

    reg = push_reg(D_ID)
    outcome, match = table.add_registration(reg, "d-agent-1", now=4.0)

    assert outcome is RegOutcome.MATCHED
    assert match is not None
    assert (match.request_id, match.remote_request_id) == (P_ID, D_ID)
    assert match.block_ids == BLOCKS
    assert match.registration.reg is reg
    assert match.registration.sender == "d-agent-1"
    assert match.matched_at == 4.0
    assert table.writing == {P_ID: match}
    assert table.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}


@pytest.mark.parametrize("registration_first", [True, False])
def test_identical_ids_match_exactly(table, push_reg, registration_first: bool) -> None:
    """With id randomisation disabled both legs carry the same id."""
    rid = "cmpl-abc-0"
    if registration_first:
        table.add_registration(push_reg(rid), "d", now=0.0)
        outcome, match = table.add_staged(rid, BLOCKS, now=0.0)
    else:
        table.add_staged(rid, BLOCKS, now=0.0)
        outcome, match = table.add_registration(push_reg(rid), "d", now=0.0)
    assert outcome.value == "matched"
    assert match is not None and match.request_id == match.remote_request_id == rid


@pytest.mark.parametrize("registration_first", [True, False])
def test_ids_differing_only_by_random_suffix_match(table, push_reg, registration_first: bool) -> None:
    if registration_first:
        table.add_registration(push_reg("cmpl-abc-0-deadbeef"), "d", now=0.0)
        outcome, match = table.add_staged("cmpl-abc-0-1a2b3c4d", BLOCKS, now=0.0)
    else:
        table.add_staged("cmpl-abc-0-1a2b3c4d", BLOCKS, now=0.0)
        outcome, match = table.add_registration(push_reg("cmpl-abc-0-deadbeef"), "d", now=0.0)
    assert outcome.value == "matched"
    assert match is not None
    assert (match.request_id, match.remote_request_id) == ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0-deadbeef")


@pytest.mark.parametrize("registration_first", [True, False])
def test_randomised_id_matches_unrandomised_peer(table, push_reg, registration_first: bool) -> None:
    """One engine randomises, the other does not: the base id still pairs them."""
    if registration_first:
        table.add_registration(push_reg("cmpl-abc-0"), "d", now=0.0)
        outcome, _ = table.add_staged("cmpl-abc-0-1a2b3c4d", BLOCKS, now=0.0)
    else:
        table.add_staged("cmpl-abc-0-1a2b3c4d", BLOCKS, now=0.0)
        outcome, _ = table.add_registration(push_reg("cmpl-abc-0"), "d", now=0.0)
    assert outcome.value == "matched"


@pytest.mark.parametrize("registration_first", [True, False])
def test_multi_prompt_sub_requests_do_not_cross_match(table, push_reg, registration_first: bool) -> None:
    if registration_first:
        r = table.add_registration(push_reg("cmpl-abc-0-deadbeef"), "d", now=0.0)
        s = table.add_staged("cmpl-abc-1-1a2b3c4d", BLOCKS, now=0.0)
    else:
        s = table.add_staged("cmpl-abc-1-1a2b3c4d", BLOCKS, now=0.0)
        r = table.add_registration(push_reg("cmpl-abc-0-deadbeef"), "d", now=0.0)
    assert r == (RegOutcome.STASHED, None)
    assert s == (StageOutcome.STASHED, None)
    assert not table.writing

    # Each sub-request still finds its own partner.
    _, m1 = table.add_staged("cmpl-abc-0-1a2b3c4d", [[1]], now=1.0)
    _, m0 = table.add_registration(push_reg("cmpl-abc-1-deadbeef"), "d", now=1.0)
    assert m1 is not None and (m1.request_id, m1.remote_request_id) == ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0-deadbeef")
    assert m0 is not None and (m0.request_id, m0.remote_request_id) == ("cmpl-abc-1-1a2b3c4d", "cmpl-abc-1-deadbeef")
    assert table.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 2}


def test_unrelated_ids_do_not_match(table, push_reg) -> None:
    table.add_registration(push_reg("cmpl-xyz-0-deadbeef"), "d", now=0.0)
    assert table.add_staged("cmpl-abc-0-deadbeef", BLOCKS, now=0.0) == (StageOutcome.STASHED, None)
    assert table.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}


# ---------------------------------------------------------------- preference among candidates


def test_registration_prefers_exact_staged_id_over_older_base_match(table, push_reg) -> None:
    table.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0)
    table.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)
    _, match = table.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d", now=2.0)
    assert match is not None
    assert match.request_id == "cmpl-abc-0-bbbbbbbb"
    assert match.block_ids == [[2]]
    assert set(table.staged) == {"cmpl-abc-0-aaaaaaaa"}


def test_blocks_prefer_exact_registration_over_older_base_match(table, push_reg) -> None:
    table.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d0", now=0.0)
    table.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d1", now=1.0)
    _, match = table.add_staged("cmpl-abc-0-bbbbbbbb", BLOCKS, now=2.0)
    assert match is not None
    assert match.remote_request_id == "cmpl-abc-0-bbbbbbbb"
    assert match.registration.sender == "d1"
    assert set(table.registrations) == {"cmpl-abc-0-aaaaaaaa"}


def test_base_match_takes_oldest_staged_first(table, push_reg) -> None:
    table.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0)
    table.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)
    _, first = table.add_registration(push_reg("cmpl-abc-0-cccccccc"), "d", now=2.0)
    _, second = table.add_registration(push_reg("cmpl-abc-0-dddddddd"), "d", now=2.0)
    assert first is not None and first.request_id == "cmpl-abc-0-aaaaaaaa"
    assert second is not None and second.request_id == "cmpl-abc-0-bbbbbbbb"
    assert not table.staged


def test_base_match_takes_oldest_registration_first(table, push_reg) -> None:
    table.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d0", now=0.0)
    table.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d1", now=1.0)
    _, first = table.add_staged("cmpl-abc-0-cccccccc", [[1]], now=2.0)
    _, second = table.add_staged("cmpl-abc-0-dddddddd", [[2]], now=2.0)
    assert first is not None and first.remote_request_id == "cmpl-abc-0-aaaaaaaa"
    assert second is not None and second.remote_request_id == "cmpl-abc-0-bbbbbbbb"
    assert not table.registrations


def test_base_match_skips_evicted_candidate(table, push_reg) -> None:
    table.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0)
    table.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)
    assert table.evict("cmpl-abc-0-aaaaaaaa")
    _, match = table.add_registration(push_reg("cmpl-abc-0-cccccccc"), "d", now=2.0)
    assert match is not None and match.request_id == "cmpl-abc-0-bbbbbbbb"


def test_registration_is_not_rematched_against_a_request_already_writing(table, push_reg) -> None:
    table.add_staged("cmpl-abc-0-aaaaaaaa", BLOCKS, now=0.0)
    table.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d", now=0.0)
    # A second D registration whose id equals P's id: P's blocks are taken already.
    assert table.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d", now=1.0) == (RegOutcome.STASHED, None)
    assert only_match(table).remote_request_id == "cmpl-abc-0-bbbbbbbb"


# ---------------------------------------------------------------- duplicates


def test_duplicate_registration_while_stashed_is_ignored(table, push_reg) -> None:
    first = push_reg(D_ID, local_block_ids=[[1]])
    table.add_registration(first, "d-agent-0", now=0.0)
    again = push_reg(D_ID, local_block_ids=[[2]])
    assert table.add_registration(again, "d-agent-1", now=5.0) == (RegOutcome.DUPLICATE, None)

    kept = table.registrations[D_ID]
    assert kept.reg is first
    assert kept.sender == "d-agent-0"
    assert kept.expires_at == TTL  # a duplicate does not extend the TTL
    assert table.sizes()["p_registrations"] == 1
    # The surviving registration is the one that gets matched.
    _, match = table.add_staged(P_ID, BLOCKS, now=6.0)
    assert match is not None and match.registration.reg is first


def test_duplicate_registration_while_writing_is_ignored(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    _, match = table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.add_registration(push_reg(D_ID), "d", now=1.0) == (RegOutcome.DUPLICATE, None)
    assert not table.registrations
    assert table.writing == {P_ID: match}


def test_duplicate_registration_while_writing_does_not_match_new_blocks(table, push_reg) -> None:
    """A re-sent PUSH_REG must not pair D's blocks with a second P request."""
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    table.add_staged(P_ID, BLOCKS, now=0.0)
    table.add_staged("cmpl-abc-0-cccccccc", [[1]], now=1.0)
    assert table.add_registration(push_reg(D_ID), "d", now=2.0) == (RegOutcome.DUPLICATE, None)
    assert set(table.staged) == {"cmpl-abc-0-cccccccc"}
    assert set(table.writing) == {P_ID}


def test_duplicate_staged_blocks_are_ignored(table) -> None:
    table.add_staged(P_ID, [[1, 2]], now=0.0)
    assert table.add_staged(P_ID, [[3, 4]], now=5.0) == (StageOutcome.DUPLICATE, None)
    staged = table.staged[P_ID]
    assert staged.block_ids == [[1, 2]]
    assert staged.lease_expires_at == LEASE  # the lease is not renewed
    assert table.sizes()["p_staged"] == 1


def test_duplicate_staged_blocks_while_writing_are_ignored(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    _, match = table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.add_staged(P_ID, [[99]], now=1.0) == (StageOutcome.DUPLICATE, None)
    assert not table.staged
    assert table.writing == {P_ID: match}
    assert match.block_ids == BLOCKS


# ---------------------------------------------------------------- finish


def test_finish_returns_match_and_forgets_it(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    _, match = table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.finish(P_ID) is match
    assert not table.writing
    assert not table.busy
    assert table.finish(P_ID) is None


def test_finish_of_unknown_or_unmatched_request_is_a_no_op(table, push_reg) -> None:
    table.add_staged(P_ID, BLOCKS, now=0.0)
    table.add_registration(push_reg("cmpl-other-0-deadbeef"), "d", now=0.0)
    assert table.finish(P_ID) is None
    assert table.finish("cmpl-other-0-deadbeef") is None  # D ids are not keys of writing
    assert table.finish("nope") is None
    assert table.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}


def test_finish_frees_remote_id_for_a_later_registration(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.add_registration(push_reg(D_ID), "d", now=1.0)[0] is RegOutcome.DUPLICATE
    table.finish(P_ID)
    assert table.add_registration(push_reg(D_ID), "d", now=2.0) == (RegOutcome.STASHED, None)
    assert table.registrations[D_ID].expires_at == 2.0 + TTL


def test_finish_frees_local_id_for_new_blocks(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    table.add_staged(P_ID, BLOCKS, now=0.0)
    table.finish(P_ID)
    assert table.add_staged(P_ID, BLOCKS, now=1.0) == (StageOutcome.STASHED, None)


def test_finish_only_frees_its_own_remote_id(table, push_reg) -> None:
    table.add_registration(push_reg("cmpl-a-0-deadbeef"), "d", now=0.0)
    table.add_registration(push_reg("cmpl-b-0-deadbeef"), "d", now=0.0)
    table.add_staged("cmpl-a-0-11111111", BLOCKS, now=0.0)
    table.add_staged("cmpl-b-0-11111111", BLOCKS, now=0.0)
    table.finish("cmpl-a-0-11111111")
    assert table.add_registration(push_reg("cmpl-b-0-deadbeef"), "d", now=1.0)[0] is RegOutcome.DUPLICATE
    assert table.add_registration(push_reg("cmpl-a-0-deadbeef"), "d", now=1.0)[0] is RegOutcome.STASHED


# ---------------------------------------------------------------- evict


def test_evict_drops_staged_blocks(table, push_reg) -> None:
    table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.evict(P_ID) is True
    assert not table.staged
    assert not table.busy
    assert table.next_deadline() is None
    assert table.evict(P_ID) is False
    # Evicted blocks are not matched by a later registration, exactly or by base.
    assert table.add_registration(push_reg(P_ID), "d", now=1.0) == (RegOutcome.STASHED, None)
    assert table.add_registration(push_reg(D_ID), "d", now=1.0) == (RegOutcome.STASHED, None)


def test_writing_request_is_not_evictable(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    _, match = table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.evict(P_ID) is False
    assert table.writing == {P_ID: match}
    assert table.busy


def test_evict_unknown_request_and_registration_ids(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    assert table.evict("never-seen") is False
    assert table.evict(D_ID) is False  # evict names P requests; D's registration stays
    assert set(table.registrations) == {D_ID}


# ---------------------------------------------------------------- expiry


def test_unmatched_blocks_lease_expires_at_deadline(table, push_reg) -> None:
    table.add_staged(P_ID, BLOCKS, now=100.0)
    assert table.next_deadline() == 100.0 + LEASE
    assert table.expire(100.0 + LEASE - 0.001) == []
    assert P_ID in table.staged
    assert table.expire(100.0 + LEASE) == [Expired(P_ID, "lease")]
    assert not table.staged
    assert not table.busy
    assert table.expire(1e9) == []
    # Expired blocks are gone for good: a late registration waits on its own.
    assert table.add_registration(push_reg(D_ID), "d", now=200.0) == (RegOutcome.STASHED, None)


def test_lease_expiry_is_reported_without_sender(table) -> None:
    table.add_staged(P_ID, BLOCKS, now=0.0)
    (expired,) = table.expire(LEASE + 1)
    assert (expired.request_id, expired.kind, expired.sender) == (P_ID, "lease", "")


def test_registration_ttl_expires_at_deadline(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d-agent-3", now=50.0)
    assert table.next_deadline() == 50.0 + TTL
    assert table.expire(50.0 + TTL - 0.001) == []
    assert table.expire(50.0 + TTL) == [Expired(D_ID, "registration", "d-agent-3")]
    assert not table.registrations
    assert table.add_staged(P_ID, BLOCKS, now=61.0) == (StageOutcome.STASHED, None)


def test_expire_reports_both_kinds_and_keeps_the_rest(table, push_reg) -> None:
    table.add_staged("cmpl-s1-0-aaaaaaaa", BLOCKS, now=0.0)  # lease until 30
    table.add_staged("cmpl-s2-0-aaaaaaaa", BLOCKS, now=20.0)  # lease until 50
    table.add_registration(push_reg("cmpl-r1-0-aaaaaaaa"), "d0", now=15.0)  # until 25
    table.add_registration(push_reg("cmpl-r2-0-aaaaaaaa"), "d1", now=25.0)  # until 35
    expired = table.expire(30.0)
    assert set(expired) == {
        Expired("cmpl-s1-0-aaaaaaaa", "lease"),
        Expired("cmpl-r1-0-aaaaaaaa", "registration", "d0"),
    }
    assert len(expired) == 2
    assert set(table.staged) == {"cmpl-s2-0-aaaaaaaa"}
    assert set(table.registrations) == {"cmpl-r2-0-aaaaaaaa"}
    assert table.next_deadline() == 35.0


def test_expire_never_reaps_a_write_in_flight(table, push_reg) -> None:
    table.add_staged(P_ID, BLOCKS, now=0.0)
    _, match = table.add_registration(push_reg(D_ID), "d", now=1.0)
    assert table.expire(1e12) == []
    assert table.writing == {P_ID: match}
    assert table.next_deadline() is None
    assert table.busy


def test_expired_registration_index_is_cleared(table, push_reg) -> None:
    """After a base-indexed registration expires, a new one with the same base is used."""
    table.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "old", now=0.0)
    table.expire(TTL)
    table.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "new", now=TTL)
    _, match = table.add_staged(P_ID, BLOCKS, now=TTL)
    assert match is not None and match.registration.sender == "new"


# ---------------------------------------------------------------- peers going away


def test_drop_registrations_from_departed_agents(table, push_reg) -> None:
    r0 = push_reg("cmpl-a-0-aaaaaaaa")
    table.add_registration(r0, "peer1-agent0", now=0.0)
    table.add_registration(push_reg("cmpl-b-0-aaaaaaaa"), "peer2-agent0", now=0.0)
    r2 = push_reg("cmpl-c-0-aaaaaaaa")
    table.add_registration(r2, "peer1-agent1", now=0.0)
    table.add_staged("cmpl-x-0-11111111", BLOCKS, now=0.0)

    gone = table.drop_registrations_from({"peer1-agent0", "peer1-agent1"})

    assert {g.reg.request_id for g in gone} == {"cmpl-a-0-aaaaaaaa", "cmpl-c-0-aaaaaaaa"}
    assert {g.sender for g in gone} == {"peer1-agent0", "peer1-agent1"}
    assert set(table.registrations) == {"cmpl-b-0-aaaaaaaa"}
    assert set(table.staged) == {"cmpl-x-0-11111111"}
    # Dropped registrations no longer match by base id.
    assert table.add_staged("cmpl-a-0-11111111", BLOCKS, now=1.0) == (StageOutcome.STASHED, None)


def test_drop_registrations_leaves_writes_in_flight(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "peer1", now=0.0)
    _, match = table.add_staged(P_ID, BLOCKS, now=0.0)
    assert table.drop_registrations_from({"peer1"}) == []
    assert table.writing == {P_ID: match}


def test_drop_registrations_from_nobody(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "peer1", now=0.0)
    assert table.drop_registrations_from(set()) == []
    assert table.drop_registrations_from({"peer2"}) == []
    assert set(table.registrations) == {D_ID}


# ---------------------------------------------------------------- views


def test_empty_table_views(table) -> None:
    assert table.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert not table.busy
    assert table.next_deadline() is None
    assert table.expire(1e9) == []


def test_registrations_alone_do_not_make_the_table_busy(table, push_reg) -> None:
    table.add_registration(push_reg(D_ID), "d", now=0.0)
    assert not table.busy
    assert table.next_deadline() == TTL


def test_next_deadline_is_earliest_of_leases_and_registrations(table, push_reg) -> None:
    table.add_staged("cmpl-s-0-aaaaaaaa", BLOCKS, now=0.0)  # 30
    assert table.next_deadline() == 30.0
    table.add_registration(push_reg("cmpl-r-0-aaaaaaaa"), "d", now=5.0)  # 15
    assert table.next_deadline() == 15.0
    table.add_staged("cmpl-t-0-aaaaaaaa", BLOCKS, now=-20.0)  # 10
    assert table.next_deadline() == 10.0


def test_repr_shows_sizes(table, push_reg) -> None:
    table.add_staged(P_ID, BLOCKS, now=0.0)
    text = repr(table)
    assert text.startswith("<ProducerTable ")
    assert "'p_staged': 1" in text


# ---------------------------------------------------------------- state machine


PREFIXES = ["cmpl-a-0", "cmpl-a-1", "cmpl-b-0"]
SUFFIXES = ["", "-aaaaaaaa", "-bbbbbbbb", "-cccccccc"]
IDS = st.sampled_from([p + s for p in PREFIXES for s in SUFFIXES])
SENDERS = st.sampled_from(["agent-0", "agent-1", "agent-2"])


class ProducerMachine(RuleBasedStateMachine):
    """Drives ProducerTable against a small reference model of the matching rules."""

    def __init__(self, make_reg) -> None:
        super().__init__()
        self.make_reg = make_reg
        self.table = ProducerTable(lease_s=LEASE, registration_ttl_s=TTL)
        self.now = 0.0
        # Reference model: dicts keep insertion order, which is the base-match order.
        self.regs: dict[str, tuple[str, float]] = {}  # D id -> (sender, expires_at)
        self.staged: dict[str, tuple[list[list[int]], float]] = {}  # P id -> (blocks, lease end)
        self.writing: dict[str, str] = {}  # P id -> D id
        self.serial = 0

    def _oldest_with_base(self, ids, rid: str) -> str | None:
        base = base_request_id(rid)
        return next((i for i in ids if base_request_id(i) == base), None)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 5.0, 10.0, 30.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(rid=IDS, sender=SENDERS)
    def add_registration(self, rid: str, sender: str) -> None:
        reg = self.make_reg(rid)
        outcome, match = self.table.add_registration(reg, sender, self.now)
        if rid in self.regs or rid in self.writing.values():
            assert (outcome, match) == (RegOutcome.DUPLICATE, None)
            return
        local = rid if rid in self.staged else self._oldest_with_base(self.staged, rid)
        if local is None:
            assert (outcome, match) == (RegOutcome.STASHED, None)
            self.regs[rid] = (sender, self.now + TTL)
            return
        assert outcome is RegOutcome.MATCHED
        assert match is not None
        assert match.request_id == local
        assert match.registration.reg is reg
        assert match.registration.sender == sender
        assert match.block_ids == self.staged[local][0]
        assert match.matched_at == self.now
        del self.staged[local]
        self.writing[local] = rid

    @rule(rid=IDS)
    def add_staged(self, rid: str) -> None:
        self.serial += 1
        blocks = [[self.serial]]
        outcome, match = self.table.add_staged(rid, blocks, self.now)
        if rid in self.staged or rid in self.writing:
            assert (outcome, match) == (StageOutcome.DUPLICATE, None)
            return
        remote = rid if rid in self.regs else self._oldest_with_base(self.regs, rid)
        if remote is None:
            assert (outcome, match) == (StageOutcome.STASHED, None)
            self.staged[rid] = (blocks, self.now + LEASE)
            return
        assert outcome is StageOutcome.MATCHED
        assert match is not None
        assert match.request_id == rid
        assert match.remote_request_id == remote
        assert match.registration.sender == self.regs[remote][0]
        assert match.block_ids is blocks
        del self.regs[remote]
        self.writing[rid] = remote

    @rule(rid=IDS)
    def finish(self, rid: str) -> None:
        match = self.table.finish(rid)
        if rid in self.writing:
            assert match is not None
            assert (match.request_id, match.remote_request_id) == (rid, self.writing.pop(rid))
        else:
            assert match is None

    @rule(rid=IDS)
    def evict(self, rid: str) -> None:
        assert self.table.evict(rid) is (rid in self.staged)
        self.staged.pop(rid, None)

    @rule()
    def expire(self) -> None:
        got = self.table.expire(self.now)
        want = {Expired(r, "lease") for r, (_, t) in self.staged.items() if t <= self.now}
        want |= {Expired(r, "registration", s) for r, (s, t) in self.regs.items() if t <= self.now}
        assert len(got) == len(set(got))
        assert set(got) == want
        for e in want:
            (self.staged if e.kind == "lease" else self.regs).pop(e.request_id)

    @rule(senders=st.sets(SENDERS, max_size=2))
    def drop_registrations_from(self, senders: set[str]) -> None:
        gone = self.table.drop_registrations_from(senders)
        want = {r for r, (s, _) in self.regs.items() if s in senders}
        assert sorted(g.reg.request_id for g in gone) == sorted(want)
        for r in want:
            del self.regs[r]

    # ------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_model(self) -> None:
        t = self.table
        assert list(t.registrations) == list(self.regs)
        assert list(t.staged) == list(self.staged)
        assert {p: m.remote_request_id for p, m in t.writing.items()} == self.writing
        for rid, (sender, expires) in self.regs.items():
            assert t.registrations[rid].sender == sender
            assert t.registrations[rid].expires_at == expires
            assert t.registrations[rid].reg.request_id == rid
        for rid, (blocks, lease) in self.staged.items():
            assert t.staged[rid].block_ids == blocks
            assert t.staged[rid].lease_expires_at == lease
            assert t.staged[rid].request_id == rid

    @invariant()
    def no_request_in_two_tables(self) -> None:
        t = self.table
        assert not set(t.staged) & set(t.writing)
        remote_ids = [m.remote_request_id for m in t.writing.values()]
        assert len(remote_ids) == len(set(remote_ids))
        assert not set(t.registrations) & set(remote_ids)

    @invariant()
    def nothing_left_unmatched(self) -> None:
        """A staged request and a registration with one base id would have been paired."""
        t = self.table
        staged_bases = {base_request_id(r) for r in t.staged}
        reg_bases = {base_request_id(r) for r in t.registrations}
        assert not staged_bases & reg_bases

    @invariant()
    def matches_pair_equal_base_ids(self) -> None:
        for pid, match in self.table.writing.items():
            assert match.request_id == pid
            assert base_request_id(match.request_id) == base_request_id(match.remote_request_id)

    @invariant()
    def indices_consistent_with_dicts(self) -> None:
        t = self.table
        for index, keys in ((t._reg_index, t.registrations), (t._staged_index, t.staged)):
            by_base: dict[str, list[str]] = {}
            for rid in keys:  # insertion order == index order
                by_base.setdefault(base_request_id(rid), []).append(rid)
            assert index._map == by_base
            assert len(index) == len(by_base)
        assert t._writing_remote == {m.remote_request_id: pid for pid, m in t.writing.items()}

    @invariant()
    def views_agree(self) -> None:
        t = self.table
        assert t.sizes() == {
            "p_registrations": len(self.regs),
            "p_staged": len(self.staged),
            "p_writing": len(self.writing),
        }
        assert t.busy == bool(self.staged or self.writing)
        deadlines = [lease for _, lease in self.staged.values()] + [exp for _, exp in self.regs.values()]
        assert t.next_deadline() == (min(deadlines) if deadlines else None)


def test_producer_table_state_machine(push_reg) -> None:
    run_state_machine_as_test(
        lambda: ProducerMachine(push_reg),
        settings=settings(max_examples=200, stateful_step_count=50, deadline=None),
    )


# ---------------------------------------------------------------- cancellation


def test_cancel_of_a_stashed_registration_drops_it_and_tombstones_the_id(push_reg) -> None:
    t = ProducerTable(lease_s=10.0, registration_ttl_s=5.0)
    t.add_registration(push_reg(request_id="d1"), "agent-d", now=0.0)
    assert t.cancel_registration("d1", now=1.0) is None
    assert t.registrations == {}
    # A copy of the PUSH_REG that was still on the wire must not be stashed again.
    assert t.add_registration(push_reg(request_id="d1"), "agent-d", now=1.5) == (RegOutcome.CANCELLED, None)
    assert t.add_staged("d1", [[1]], now=2.0)[0] is StageOutcome.STASHED  # nothing to match
    t.expire(6.0)  # tombstone gone after the registration TTL
    assert "d1" not in t.cancelled


def test_cancel_of_a_registration_being_written_returns_the_match(push_reg) -> None:
    t = ProducerTable(lease_s=10.0, registration_ttl_s=5.0)
    t.add_staged("p1", [[1]], now=0.0)
    _, match = t.add_registration(push_reg(request_id="p1"), "agent-d", now=0.0)
    assert t.cancel_registration("p1", now=1.0) is match
    assert t.writing == {"p1": match}  # the caller settles the WRITE first
    assert t.finish("p1") is match


def test_cancel_of_an_unknown_registration_only_tombstones(push_reg) -> None:
    t = ProducerTable(lease_s=10.0, registration_ttl_s=5.0)
    assert t.cancel_registration("ghost", now=0.0) is None
    assert t.add_registration(push_reg(request_id="ghost"), "a", now=0.1)[0] is RegOutcome.CANCELLED


def test_tracks_staged_and_writing_requests_only(push_reg) -> None:
    table = ProducerTable(lease_s=LEASE, registration_ttl_s=TTL)
    table.add_staged("staged", [[1]], now=0.0)
    table.add_staged("writing", [[2]], now=0.0)
    table.add_registration(push_reg("writing"), "d-agent", now=0.0)
    table.add_registration(push_reg("only-registered"), "d-agent", now=0.0)
    assert table.tracks("staged") and table.tracks("writing")
    assert not table.tracks("only-registered") and not table.tracks("unknown")
    table.finish("writing")
    table.evict("staged")
    assert not table.tracks("staged") and not table.tracks("writing")


def test_registration_from_a_known_agent_replaces_an_unverified_one(push_reg) -> None:
    table = ProducerTable(lease_s=LEASE, registration_ttl_s=TTL)
    assert table.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)[0] is RegOutcome.STASHED
    outcome, match = table.add_registration(push_reg(D_ID), "d-agent", now=1.0)
    assert outcome is RegOutcome.STASHED and table.registrations[D_ID].sender == "d-agent"
    # ...but never the other way round, and a second unverified one is a duplicate.
    assert table.add_registration(push_reg(D_ID), "stranger", now=2.0, verified=False)[0] is RegOutcome.DUPLICATE
    assert table.add_registration(push_reg(D_ID), "d-agent", now=2.0)[0] is RegOutcome.DUPLICATE
    outcome, match = table.add_staged(P_ID, BLOCKS, now=3.0)
    assert outcome is StageOutcome.MATCHED and match.registration.sender == "d-agent"
    assert table.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}


def test_unverified_registration_replaced_before_its_blocks_are_staged_leaves_no_index(push_reg) -> None:
    table = ProducerTable(lease_s=LEASE, registration_ttl_s=TTL)
    table.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    table.add_registration(push_reg(D_ID), "d-agent", now=0.0)
    assert len(table._reg_index) == 1
    table.expire(TTL + 1)
    assert table.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0} and len(table._reg_index) == 0
