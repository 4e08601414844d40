"""ProducerTable admission: duplicates, registrations from senders P does not know yet
(kept, never matched until ``confirm``), squatters yielding to D's known agent, and the
caps (a verified registration needs a slot only to be stashed)."""

from __future__ import annotations

import pytest

from pushsvc.state.producer import ExpiryKind, ProducerTable, RegOutcome, RegResult, StageOutcome, StageResult

P_ID = "cmpl-abc-0-1a2b3c4d"
D_ID = "cmpl-abc-0-deadbeef"
OWNER = "decode-engine"
KEY = (OWNER, D_ID)
BLOCKS = [[7, 8, 9]]


# ---------------------------------------------------------------- unverified registrations


@pytest.mark.parametrize("match_key", ["", "k1"])
def test_unverified_registration_is_kept_but_never_matched(producer, push_reg, match_key: str) -> None:
    reg = push_reg(D_ID, match_key=match_key)
    assert producer.add_registration(reg, "stranger", now=1.0, verified=False) == RegResult(RegOutcome.UNVERIFIED)
    registration = producer.registrations[KEY]
    assert (registration.reg, registration.sender, registration.verified) == (reg, "stranger", False)
    assert (registration.registered_at, registration.expires_at) == (1.0, 6.0)  # the unverified TTL, 5 s
    assert producer.add_staged(P_ID, BLOCKS, now=2.0, match_key=match_key) == StageResult(StageOutcome.STASHED)
    assert producer.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}
    assert producer.unverified_from({"stranger", "someone"}) == [registration]
    assert producer.unverified_from({"someone"}) == []


def test_unverified_from_lists_only_unverified_registrations(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-a-0-aaaaaaaa"), "agent", now=0.0, verified=False)
    producer.add_registration(push_reg("cmpl-b-0-aaaaaaaa"), "agent", now=0.0)
    assert [r.request_id for r in producer.unverified_from({"agent"})] == ["cmpl-a-0-aaaaaaaa"]


@pytest.mark.parametrize(("d_id", "reg_key", "staged_key"),
                         [(D_ID, "", ""), (D_ID, "k1", "k1"), (P_ID, "k1", "k1"), (D_ID, "k1", "")])
def test_confirm_matches_the_waiting_blocks(producer, push_reg, d_id: str, reg_key: str, staged_key: str) -> None:
    producer.add_registration(push_reg(d_id, match_key=reg_key), "stranger", now=0.0, verified=False)
    producer.add_staged(P_ID, BLOCKS, now=1.0, match_key=staged_key)

    result = producer.confirm((OWNER, d_id), now=5.0)

    assert result is not None and result.outcome is RegOutcome.MATCHED and result.match is not None
    match = result.match
    assert (match.request_id, match.remote_request_id, match.matched_at) == (P_ID, d_id, 5.0)
    assert match.registration.verified and match.registration.sender == "stranger"
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}
    assert producer.unverified_from({"stranger"}) == []


def test_confirm_is_ambiguous_where_two_staged_requests_share_its_base(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=1.0)
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)

    result = producer.confirm(KEY, now=2.0)

    assert result is not None and result.outcome is RegOutcome.AMBIGUOUS and result.match is None
    assert [s.request_id for s in result.collided] == ["cmpl-abc-0-aaaaaaaa", "cmpl-abc-0-bbbbbbbb"]
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert producer.unverified_from({"stranger"}) == []


@pytest.mark.parametrize(("other_key", "outcome"), [("k2", RegOutcome.MATCHED), ("", RegOutcome.AMBIGUOUS)])
def test_confirm_where_the_key_rules_out_another_exchange(producer, push_reg, other_key: str,
                                                          outcome: RegOutcome) -> None:
    """Another exchange's request is no candidate; one without a key still is."""
    producer.add_registration(push_reg(D_ID, match_key="k1"), "stranger", now=0.0, verified=False)
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=1.0, match_key=other_key)
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0, match_key="k1")
    result = producer.confirm(KEY, now=2.0)
    assert result is not None and result.outcome is outcome
    if outcome is RegOutcome.MATCHED:
        assert result.match is not None and result.match.request_id == "cmpl-abc-0-bbbbbbbb"
        assert set(producer.staged) == {"cmpl-abc-0-aaaaaaaa"}
    else:
        assert len(result.collided) == 2 and not producer.staged


def test_confirm_without_blocks_stashes_it_for_the_ttl_counted_from_its_arrival(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "stranger", now=1.0, verified=False)
    assert producer.confirm(KEY, now=4.0) == RegResult(RegOutcome.STASHED)
    registration = producer.registrations[KEY]
    assert registration.verified
    assert (registration.registered_at, registration.expires_at) == (1.0, 11.0)
    assert producer.expire(6.0) == []  # past the unverified TTL: it no longer applies
    match = producer.add_staged(P_ID, BLOCKS, now=7.0).match
    assert match is not None and match.registration is registration


def test_confirm_of_an_unknown_or_verified_registration_is_none(producer, push_reg) -> None:
    assert producer.confirm(KEY, now=0.0) is None
    producer.add_registration(push_reg(D_ID), "d", now=0.0)
    assert producer.confirm(KEY, now=1.0) is None
    assert producer.confirm(("decode-b", D_ID), now=1.0) is None
    assert list(producer.registrations) == [KEY]
    registration = producer.registrations[KEY]
    assert (registration.verified, registration.expires_at) == (True, 10.0)  # untouched


def test_confirm_after_its_p_request_ended_is_finished(producer, push_reg) -> None:
    """The rule for an arrival holds for a confirmed one: P's request (this key, this base
    id) ended while the sender was checked, so nothing will ever be written for it."""
    producer.add_registration(push_reg(D_ID, match_key="k1"), "stranger", now=0.0, verified=False)
    producer.add_registration(push_reg("cmpl-abc-1-deadbeef", match_key="k1"), "stranger", now=0.0, verified=False)
    producer.add_staged(P_ID, BLOCKS, now=1.0, match_key="k1")  # not matched: unverified
    assert producer.evict(P_ID, now=2.0) is not None  # ends (k1, cmpl-abc-0)
    fresh = producer.add_registration(push_reg(D_ID, decode_engine_id="decode-b", match_key="k1"), "d-b", now=2.5)
    assert fresh == RegResult(RegOutcome.FINISHED)
    assert producer.confirm(KEY, now=3.0) == RegResult(RegOutcome.FINISHED)
    # The exchange's other sub-request did not end: it waits for its own blocks.
    assert producer.confirm((OWNER, "cmpl-abc-1-deadbeef"), now=3.0) == RegResult(RegOutcome.STASHED)
    assert list(producer.registrations) == [(OWNER, "cmpl-abc-1-deadbeef")]


def test_unverified_registration_expires_because_its_sender_never_checked_out(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    assert producer.expire(4.999) == []
    (expired,) = producer.expire(5.0)
    assert (expired.request_id, expired.kind, expired.sender, expired.owner) == (
        D_ID, ExpiryKind.REGISTRATION, "stranger", OWNER)
    assert producer.unverified_from({"stranger"}) == []
    # The reason names the wait it ran out of: the unverified TTL, not the registration TTL.
    assert expired.reason == "registration expired after 5.0s: its sender was never announced"


@pytest.mark.parametrize(("ttl", "unverified_ttl", "waited"), [(10.0, 5.0, 5.0), (3.0, 5.0, 3.0), (10.0, 2.5, 2.5)])
def test_an_expiry_names_how_long_the_registration_waited(push_reg, ttl: float, unverified_ttl: float,
                                                          waited: float) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=ttl, unverified_ttl_s=unverified_ttl)
    table.add_registration(push_reg(D_ID), "stranger", now=100.5, verified=False)
    table.add_registration(push_reg("cmpl-late-0-deadbeef"), "stranger", now=100.5, verified=False)
    table.confirm((OWNER, "cmpl-late-0-deadbeef"), now=101.0)  # then waits the full TTL, from its arrival
    expired = table.expire(1e9)
    assert [e.reason for e in expired] == [
        f"registration expired after {waited}s: its sender was never announced",
        f"registration expired after {ttl}s: P's blocks never came"]


@pytest.mark.parametrize(("ttl", "unverified_ttl", "expires"), [(10.0, 5.0, 5.0), (10.0, 20.0, 10.0), (3.0, 5.0, 3.0)])
def test_an_unverified_registration_waits_the_shorter_ttl(push_reg, ttl: float, unverified_ttl: float,
                                                          expires: float) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=ttl, unverified_ttl_s=unverified_ttl)
    table.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    assert table.registrations[KEY].expires_at == expires


def test_drop_unverified_forgets_only_the_unverified_registrations_of_that_owner(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-a-0-deadbeef"), "x", now=0.0, verified=False)
    producer.add_registration(push_reg("cmpl-b-0-deadbeef"), "d", now=0.0)
    producer.add_registration(push_reg("cmpl-c-0-deadbeef", decode_engine_id="decode-b"), "x", now=0.0,
                              verified=False)
    gone = producer.drop_unverified(OWNER)
    assert [r.key for r in gone] == [(OWNER, "cmpl-a-0-deadbeef")]
    assert set(producer.registrations) == {(OWNER, "cmpl-b-0-deadbeef"), ("decode-b", "cmpl-c-0-deadbeef")}
    assert producer.drop_unverified(OWNER) == []
    assert repr(producer).endswith("unverified=1 tombstones=0>")


def test_drop_unverified_before_a_time_keeps_those_that_came_later(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-a-0-deadbeef"), "x", now=1.0, verified=False)
    producer.add_registration(push_reg("cmpl-b-0-deadbeef"), "x", now=2.0, verified=False)
    assert [r.key for r in producer.drop_unverified(OWNER, before=2.0)] == [(OWNER, "cmpl-a-0-deadbeef")]
    assert set(producer.registrations) == {(OWNER, "cmpl-b-0-deadbeef")}


# ---------------------------------------------------------------- counterpart


def test_counterpart_names_the_one_staged_request_a_registration_would_pair_with(producer, push_reg) -> None:
    assert producer.counterpart(push_reg(D_ID)) is None
    producer.add_staged(P_ID, BLOCKS, now=0.0)
    producer.add_staged("cmpl-xyz-0-1a2b3c4d", [[1]], now=0.0, match_key="k1")
    assert producer.counterpart(push_reg(D_ID)) is producer.staged[P_ID]
    assert producer.counterpart(push_reg("cmpl-xyz-0-deadbeef", match_key="k1")) is producer.staged[
        "cmpl-xyz-0-1a2b3c4d"]
    assert producer.counterpart(push_reg("cmpl-uvw-0-deadbeef", match_key="k1")) is None  # one key, another id
    assert producer.counterpart(push_reg(D_ID, match_key="k2")) is producer.staged[P_ID]  # P's side has no key
    assert producer.counterpart(push_reg("cmpl-xyz-0-deadbeef", match_key="k2")) is None  # both keyed, unequal
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[2]], now=0.0)
    assert producer.counterpart(push_reg(D_ID)) is None  # ambiguous: no one counterpart
    assert producer.counterpart(push_reg(P_ID)) is producer.staged[P_ID]  # the exact id decides
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 3, "p_writing": 0}  # nothing changed


# ---------------------------------------------------------------- squatters


def test_registration_from_a_known_agent_replaces_an_unverified_one(producer, push_reg) -> None:
    assert producer.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False).outcome \
        is RegOutcome.UNVERIFIED
    result = producer.add_registration(push_reg(D_ID), "d-agent", now=1.0)
    assert result == RegResult(RegOutcome.STASHED) and producer.registrations[KEY].sender == "d-agent"
    assert producer.registrations[KEY].verified and producer.unverified_from({"stranger"}) == []
    # ...but never the other way round, and a second unverified one is a duplicate.
    assert producer.add_registration(push_reg(D_ID), "stranger", now=2.0, verified=False).outcome \
        is RegOutcome.DUPLICATE
    assert producer.add_registration(push_reg(D_ID), "d-agent", now=2.0).outcome is RegOutcome.DUPLICATE
    result = producer.add_staged(P_ID, BLOCKS, now=3.0)
    assert result.outcome is StageOutcome.MATCHED and result.match is not None
    assert result.match.registration.sender == "d-agent"
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}


def test_unverified_registration_replaced_before_its_blocks_are_staged_leaves_no_index(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    producer.add_registration(push_reg(D_ID), "d-agent", now=0.0)
    assert len(producer._reg_base) == 1
    producer.expire(11.0)
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert len(producer._reg_base) == 0


SQUAT_KEY = ("intruder", "cmpl-abc-0-0badf00d")  # the exchange's key and base id, another owner and id


def test_a_squatter_under_a_match_key_never_takes_the_exchange(producer, push_reg) -> None:
    squat = push_reg(SQUAT_KEY[1], decode_engine_id=SQUAT_KEY[0], match_key="k1")
    assert producer.add_registration(squat, "stranger", now=0.0, verified=False).outcome is RegOutcome.UNVERIFIED
    real = push_reg(D_ID, match_key="k1")
    assert producer.add_registration(real, "d-agent", now=1.0) == RegResult(RegOutcome.STASHED)
    assert list(producer.registrations) == [SQUAT_KEY, KEY]  # kept apart: the key is no slot
    match = producer.add_staged(P_ID, BLOCKS, now=2.0, match_key="k1").match
    assert match is not None and match.registration.reg is real
    assert [e.request_id for e in producer.expire(5.0)] == [SQUAT_KEY[1]]  # it never checked out


def test_a_squatter_under_a_match_key_does_not_stop_waiting_blocks(producer, push_reg) -> None:
    squat = push_reg(SQUAT_KEY[1], decode_engine_id=SQUAT_KEY[0], match_key="k1")
    producer.add_registration(squat, "stranger", now=0.0, verified=False)
    producer.add_staged(P_ID, BLOCKS, now=0.5, match_key="k1")
    result = producer.add_registration(push_reg(D_ID, match_key="k1"), "d-agent", now=1.0)
    assert result.outcome is RegOutcome.MATCHED and result.match is not None
    assert result.match.registration.sender == "d-agent"
    assert list(producer.registrations) == [SQUAT_KEY] and not producer.registrations[SQUAT_KEY].verified


@pytest.mark.parametrize("holder_verified", [True, False])
def test_an_unverified_registration_under_a_held_match_key_changes_nothing(producer, push_reg,
                                                                          holder_verified: bool) -> None:
    producer.add_registration(push_reg(D_ID, match_key="k1"), "d-agent", now=0.0, verified=holder_verified)
    again = push_reg("cmpl-abc-0-0badf00d", decode_engine_id="decode-b", match_key="k1")
    assert producer.add_registration(again, "stranger", now=1.0, verified=False) == RegResult(RegOutcome.UNVERIFIED)
    assert list(producer.registrations) == [KEY, ("decode-b", "cmpl-abc-0-0badf00d")]
    assert producer.registrations[KEY].sender == "d-agent"
    assert producer.registrations[KEY].verified is holder_verified
    result = producer.add_staged(P_ID, BLOCKS, now=2.0, match_key="k1")  # the unverified are no candidates
    assert result.outcome is (StageOutcome.MATCHED if holder_verified else StageOutcome.STASHED)


# ---------------------------------------------------------------- caps


def test_registrations_beyond_the_cap_are_refused_as_full(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_registrations=2)
    table.add_registration(push_reg("cmpl-a-0-deadbeef"), "d", now=0.0)
    table.add_registration(push_reg("cmpl-b-0-deadbeef"), "d", now=0.0, verified=False)
    assert table.add_registration(push_reg("cmpl-c-0-deadbeef"), "d", now=1.0) == RegResult(RegOutcome.FULL)
    assert table.add_registration(push_reg("cmpl-d-0-deadbeef"), "d", now=1.0, verified=False) \
        == RegResult(RegOutcome.FULL)
    assert set(table.registrations) == {(OWNER, "cmpl-a-0-deadbeef"), (OWNER, "cmpl-b-0-deadbeef")}
    # A slot freed (by a match, a drop or an expiry) is taken again.
    assert table.add_staged("cmpl-a-0-1a2b3c4d", BLOCKS, now=2.0).outcome is StageOutcome.MATCHED
    assert table.add_registration(push_reg("cmpl-c-0-deadbeef"), "d", now=2.0).outcome is RegOutcome.STASHED
    table.expire(10.0)
    assert table.add_registration(push_reg("cmpl-d-0-deadbeef"), "d", now=10.0).outcome is RegOutcome.STASHED


def test_staged_requests_beyond_the_cap_are_refused_as_full(push_reg) -> None:
    """P's blocks bound nothing (requests share them through the prefix cache), so the
    staged requests waiting for D have a cap of their own; one that pairs at once needs no place."""
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_staged=2)
    assert table.add_staged("cmpl-a-0-1a2b3c4d", BLOCKS, now=0.0).outcome is StageOutcome.STASHED
    assert table.add_staged("cmpl-b-0-1a2b3c4d", BLOCKS, now=0.0).outcome is StageOutcome.STASHED
    assert table.add_staged("cmpl-c-0-1a2b3c4d", BLOCKS, now=0.0, match_key="kc") == StageResult(StageOutcome.FULL)
    assert set(table.staged) == {"cmpl-a-0-1a2b3c4d", "cmpl-b-0-1a2b3c4d"}
    # The refused request ended: D's registration of its exchange is answered at once.
    assert table.add_registration(push_reg("cmpl-c-0-deadbeef", match_key="kc"), "d", now=1.0) \
        == RegResult(RegOutcome.FINISHED)
    table.add_registration(push_reg("cmpl-d-0-deadbeef"), "d", now=1.0)
    assert table.add_staged("cmpl-d-0-1a2b3c4d", BLOCKS, now=1.0).outcome is StageOutcome.MATCHED
    # A place freed (by a match, an eviction or the lease) is taken again.
    table.evict("cmpl-a-0-1a2b3c4d", now=2.0)
    assert table.add_staged("cmpl-e-0-1a2b3c4d", BLOCKS, now=2.0).outcome is StageOutcome.STASHED
    assert table.add_staged("cmpl-f-0-1a2b3c4d", BLOCKS, now=2.0).outcome is StageOutcome.FULL
    table.expire(30.0)  # b's lease
    assert table.add_staged("cmpl-f-0-1a2b3c4d", BLOCKS, now=30.0).outcome is StageOutcome.STASHED


def test_unverified_registrations_have_a_cap_of_their_own(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_unverified=1)
    assert table.add_registration(push_reg("cmpl-a-0-deadbeef"), "x", now=0.0, verified=False).outcome \
        is RegOutcome.UNVERIFIED
    assert table.add_registration(push_reg("cmpl-b-0-deadbeef"), "x", now=0.0, verified=False) \
        == RegResult(RegOutcome.FULL)
    assert table.add_registration(push_reg("cmpl-b-0-deadbeef"), "d", now=0.0).outcome is RegOutcome.STASHED
    # Confirming the unverified one frees its place among the unverified.
    assert table.confirm((OWNER, "cmpl-a-0-deadbeef"), now=1.0) == RegResult(RegOutcome.STASHED)
    assert table.add_registration(push_reg("cmpl-c-0-deadbeef"), "x", now=1.0, verified=False).outcome \
        is RegOutcome.UNVERIFIED
    assert repr(table).endswith("unverified=1 tombstones=0>")


def test_a_squatter_replaced_at_the_cap_gives_its_slot_to_the_known_agent(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_registrations=1)
    table.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    assert table.add_registration(push_reg(D_ID), "d-agent", now=1.0) == RegResult(RegOutcome.STASHED)
    table.drop_registration(KEY)
    # Only a squatter on its own (owner, id) yields: one under its key keeps its slot.
    table.add_registration(push_reg("cmpl-fake-0-deadbeef", match_key="k1"), "stranger", now=2.0, verified=False)
    assert table.add_registration(push_reg(D_ID, match_key="k1"), "d-agent", now=3.0) == RegResult(RegOutcome.FULL)
    assert list(table.registrations) == [(OWNER, "cmpl-fake-0-deadbeef")]


def test_confirm_at_the_cap_still_matches(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_registrations=1)
    table.add_registration(push_reg(D_ID), "stranger", now=0.0, verified=False)
    table.add_staged(P_ID, BLOCKS, now=1.0)
    result = table.confirm(KEY, now=2.0)
    assert result is not None and result.outcome is RegOutcome.MATCHED


def test_full_only_when_a_verified_registration_would_be_stashed(push_reg) -> None:
    """A registration that pairs (or is answered at once) takes no slot, so a full table
    still serves it; an unverified one is capped on arrival, blocks or not."""
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_registrations=1)
    table.add_registration(push_reg("cmpl-held-0-deadbeef"), "d", now=0.0)  # the one slot
    table.add_staged(P_ID, BLOCKS, now=0.0)
    table.add_staged("cmpl-b-0-1a2b3c4d", [[1]], now=0.0, match_key="kb")
    table.add_staged("cmpl-amb-0-aaaaaaaa", [[2]], now=0.0)
    table.add_staged("cmpl-amb-0-bbbbbbbb", [[3]], now=0.0)
    table.add_staged("cmpl-end-0-1a2b3c4d", [[4]], now=0.0, match_key="ke")
    table.evict("cmpl-end-0-1a2b3c4d", now=0.0)
    assert table.add_registration(push_reg(D_ID), "stranger", now=1.0, verified=False) == RegResult(RegOutcome.FULL)
    outcomes = [table.add_registration(reg, "d", now=1.0).outcome for reg in (
        push_reg(D_ID),  # its blocks are staged
        push_reg("cmpl-dummy", local_block_ids=[], match_key="kb"),  # a release of staged blocks
        push_reg("cmpl-dummy", local_block_ids=[], match_key="kc"),  # a release of nothing
        push_reg("cmpl-none-0-deadbeef", local_block_ids=[]),  # the same, without a key
        push_reg("cmpl-amb-0-deadbeef"),  # refused with its candidates
        push_reg("cmpl-end-0-deadbeef", match_key="ke"),  # its P request ended
        push_reg("cmpl-new-0-deadbeef"))]  # would wait: no slot
    assert outcomes == [RegOutcome.MATCHED, RegOutcome.MATCHED, RegOutcome.RELEASED, RegOutcome.RELEASED,
                        RegOutcome.AMBIGUOUS, RegOutcome.FINISHED, RegOutcome.FULL]
    assert list(table.registrations) == [(OWNER, "cmpl-held-0-deadbeef")]


def test_an_unverified_release_waits_for_its_sender(producer, push_reg) -> None:
    dummy = push_reg("cmpl-dummy", local_block_ids=[], match_key="kb")
    assert producer.add_registration(dummy, "stranger", now=0.0, verified=False) == RegResult(RegOutcome.UNVERIFIED)
    assert producer.add_staged("cmpl-b-0-1a2b3c4d", [[1]], now=1.0, match_key="kb").outcome is StageOutcome.STASHED
    assert "kb" not in producer.released
    result = producer.confirm((OWNER, "cmpl-dummy"), now=2.0)
    assert result is not None and result.outcome is RegOutcome.MATCHED
    assert [m.request_id for m in result.matches] == ["cmpl-b-0-1a2b3c4d"]
    assert not producer.registrations and "kb" in producer.released
    # Without a key it is kept while unverified too, and dropped on confirm if nothing waits.
    unkeyed = push_reg("cmpl-none-0-deadbeef", local_block_ids=[])
    assert producer.add_registration(unkeyed, "stranger", now=3.0, verified=False).outcome is RegOutcome.UNVERIFIED
    assert producer.confirm((OWNER, "cmpl-none-0-deadbeef"), now=4.0) == RegResult(RegOutcome.RELEASED)
    assert not producer.registrations and len(producer.released) == 1


# ---------------------------------------------------------------- duplicates


def test_duplicate_registration_while_stashed_is_ignored(producer, push_reg) -> None:
    first = push_reg(D_ID, local_block_ids=[[1]])
    producer.add_registration(first, "d-agent-0", now=0.0)
    again = push_reg(D_ID, local_block_ids=[[2]])
    assert producer.add_registration(again, "d-agent-1", now=5.0) == RegResult(RegOutcome.DUPLICATE)

    kept = producer.registrations[(OWNER, D_ID)]
    assert (kept.reg, kept.sender) == (first, "d-agent-0") and kept.reg is first
    assert kept.expires_at == 10.0  # a duplicate does not extend the TTL
    assert producer.sizes()["p_registrations"] == 1
    # The surviving registration is the one that gets matched.
    match = producer.add_staged(P_ID, BLOCKS, now=6.0).match
    assert match is not None and match.registration.reg is first


def test_one_id_from_two_engines_is_two_registrations(producer, push_reg) -> None:
    assert producer.add_registration(push_reg(D_ID), "d0", now=0.0).outcome is RegOutcome.STASHED
    assert producer.add_registration(push_reg(D_ID, decode_engine_id="decode-b"), "d1", now=0.0).outcome \
        is RegOutcome.STASHED
    assert {k: r.sender for k, r in producer.registrations.items()} == {(OWNER, D_ID): "d0", ("decode-b", D_ID): "d1"}


def test_duplicate_registration_while_writing_is_ignored(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "d", now=0.0)
    match = producer.add_staged(P_ID, BLOCKS, now=0.0).match
    assert producer.add_registration(push_reg(D_ID), "d", now=1.0) == RegResult(RegOutcome.DUPLICATE)
    assert not producer.registrations
    assert producer.writing == {P_ID: match}


def test_duplicate_registration_while_writing_does_not_match_new_blocks(producer, push_reg) -> None:
    """A re-sent PUSH_REG must not pair D's blocks with a second P request."""
    producer.add_registration(push_reg(D_ID), "d", now=0.0)
    producer.add_staged(P_ID, BLOCKS, now=0.0)
    producer.add_staged("cmpl-abc-0-cccccccc", [[1]], now=1.0)
    assert producer.add_registration(push_reg(D_ID), "d", now=2.0) == RegResult(RegOutcome.DUPLICATE)
    assert set(producer.staged) == {"cmpl-abc-0-cccccccc"}
    assert set(producer.writing) == {P_ID}


@pytest.mark.parametrize("owner", [OWNER, "decode-b"])
def test_registrations_under_one_match_key_are_sub_requests_not_duplicates(producer, push_reg, owner: str) -> None:
    first = push_reg(D_ID, match_key="k1")
    producer.add_registration(first, "d0", now=0.0)
    second = push_reg("cmpl-xyz-0-deadbeef", decode_engine_id=owner, match_key="k1")
    assert producer.add_registration(second, "d1", now=1.0) == RegResult(RegOutcome.STASHED)
    assert list(producer.registrations) == [(OWNER, D_ID), (owner, "cmpl-xyz-0-deadbeef")]
    assert producer.add_staged("cmpl-uvw-0-1a2b3c4d", BLOCKS, now=2.0, match_key="k1").outcome \
        is StageOutcome.STASHED  # neither one's id
    match = producer.add_staged("cmpl-xyz-0-1a2b3c4d", BLOCKS, now=2.0, match_key="k1").match
    assert match is not None and match.registration.reg is second
    match = producer.add_staged(P_ID, BLOCKS, now=2.0, match_key="k1").match
    assert match is not None and match.registration.reg is first


def test_duplicate_staged_blocks_are_ignored(producer) -> None:
    producer.add_staged(P_ID, [[1, 2]], now=0.0)
    assert producer.add_staged(P_ID, [[3, 4]], now=5.0, match_key="k1") == StageResult(StageOutcome.DUPLICATE)
    staged = producer.staged[P_ID]
    assert (staged.block_ids, staged.match_key) == ([[1, 2]], "")
    assert staged.lease_expires_at == 30.0  # the lease is not renewed
    assert producer.sizes()["p_staged"] == 1


def test_duplicate_staged_blocks_while_writing_are_ignored(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "d", now=0.0)
    match = producer.add_staged(P_ID, BLOCKS, now=0.0).match
    assert producer.add_staged(P_ID, [[99]], now=1.0) == StageResult(StageOutcome.DUPLICATE)
    assert not producer.staged
    assert producer.writing == {P_ID: match}
    assert match is not None and match.block_ids == BLOCKS
