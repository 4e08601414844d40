"""ProducerTable after the match: finishing, evicting, expiring, ended requests (kept by
match key and base id), per-owner cancellation and tombstones, peers going away, and the
views."""

from __future__ import annotations

import pytest

from pushsvc.state.ids import base_request_id
from pushsvc.state.producer import (
    Expired,
    ExpiryKind,
    ProducerTable,
    RegOutcome,
    RegResult,
    StageOutcome,
    StageResult,
)

P_ID = "cmpl-abc-0-1a2b3c4d"
D_ID = "cmpl-abc-0-deadbeef"
OWNER = "decode-engine"
OTHER = "decode-b"
BLOCKS = [[7, 8, 9]]
NOT_CLAIMED = "lease expired: no registration"
NEVER_CAME = "registration expired after 10.0s: P's blocks never came"
ENDED = ("k1", base_request_id(P_ID))  # what an ended P request P_ID under key k1 leaves behind


def writing(table: ProducerTable, push_reg, d_id: str = D_ID, p_id: str = P_ID, owner: str = OWNER,
            reg_key: str = "", staged_key: str = "", now: float = 0.0):
    """A registration and P's blocks matched: the WRITE is in flight."""
    table.add_registration(push_reg(d_id, decode_engine_id=owner, match_key=reg_key), "d", now)
    match = table.add_staged(p_id, BLOCKS, now, match_key=staged_key).match
    assert match is not None
    return match


# ---------------------------------------------------------------- finish


def test_finish_returns_match_and_forgets_it(producer, push_reg) -> None:
    match = writing(producer, push_reg)
    assert producer.finish(P_ID, now=1.0) is match
    assert not producer.writing
    assert not producer.busy
    assert producer.finish(P_ID, now=1.0) is None


def test_finish_of_unknown_or_unmatched_request_is_a_no_op(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    producer.add_registration(push_reg("cmpl-other-0-deadbeef"), "d", now=0.0)
    assert producer.finish(P_ID, now=1.0) is None
    assert producer.finish("cmpl-other-0-deadbeef", now=1.0) is None  # D ids are not keys of writing
    assert producer.finish("nope", now=1.0) is None
    assert producer.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}
    assert len(producer.finished) == 0  # nothing ended


def test_finish_frees_remote_id_for_a_later_registration(producer, push_reg) -> None:
    writing(producer, push_reg)
    assert producer.add_registration(push_reg(D_ID), "d", now=1.0).outcome is RegOutcome.DUPLICATE
    producer.finish(P_ID, now=1.5)
    assert producer.add_registration(push_reg(D_ID), "d", now=2.0) == RegResult(RegOutcome.STASHED)
    assert producer.registrations[(OWNER, D_ID)].expires_at == 12.0


def test_finish_frees_local_id_for_new_blocks(producer, push_reg) -> None:
    writing(producer, push_reg)
    producer.finish(P_ID, now=0.5)
    assert producer.add_staged(P_ID, BLOCKS, now=1.0) == StageResult(StageOutcome.STASHED)


def test_finish_only_frees_its_own_remote_id(producer, push_reg) -> None:
    writing(producer, push_reg, "cmpl-a-0-deadbeef", "cmpl-a-0-11111111")
    writing(producer, push_reg, "cmpl-b-0-deadbeef", "cmpl-b-0-11111111")
    producer.finish("cmpl-a-0-11111111", now=1.0)
    assert producer.add_registration(push_reg("cmpl-b-0-deadbeef"), "d", now=1.0).outcome is RegOutcome.DUPLICATE
    assert producer.add_registration(push_reg("cmpl-a-0-deadbeef"), "d", now=1.0).outcome is RegOutcome.STASHED


def test_a_write_in_flight_holds_its_id_per_owner(producer, push_reg) -> None:
    writing(producer, push_reg)
    assert producer.add_registration(push_reg(D_ID, decode_engine_id=OTHER), "d1", now=1.0).outcome \
        is RegOutcome.STASHED


# ---------------------------------------------------------------- ended requests


@pytest.mark.parametrize(("reg_key", "staged_key", "ended"), [("k1", "k1", True), ("", "k1", True),
                                                              ("k1", "", False)])
def test_a_finished_write_ends_its_p_request_by_key_and_base_id(producer, push_reg, reg_key: str,
                                                               staged_key: str, ended: bool) -> None:
    """P's own key names the exchange its request ended in; without one nothing is kept."""
    writing(producer, push_reg, reg_key=reg_key, staged_key=staged_key)
    producer.finish(P_ID, now=1.0)
    assert (ENDED in producer.finished) is ended
    for owner in (OWNER, OTHER):  # a retry of that request's registration, from anyone
        late = producer.add_registration(push_reg("cmpl-abc-0-eeeeeeee", decode_engine_id=owner, match_key="k1"),
                                         "d", now=2.0)
        assert late.outcome is (RegOutcome.FINISHED if ended else RegOutcome.STASHED)
    assert bool(producer.registrations) is not ended
    for other in (push_reg("cmpl-abc-1-deadbeef", match_key="k1"),  # another sub-request of the exchange
                  push_reg("cmpl-abc-0-ffffffff", match_key="k2"),  # another exchange under that base id
                  push_reg("cmpl-abc-0-0000000f")):  # no key: nothing names its exchange
        assert producer.add_registration(other, "d", now=2.0).outcome is RegOutcome.STASHED


def test_a_request_is_not_ended_while_its_write_is_in_flight(producer, push_reg) -> None:
    writing(producer, push_reg, reg_key="k1", staged_key="k1")
    assert ENDED not in producer.finished
    producer.finish(P_ID, now=1.0)
    assert ENDED in producer.finished and len(producer.finished) == 1


def test_a_counterpart_comes_before_an_ended_request(producer, push_reg) -> None:
    """P retried the request under the same base id: D's registration pairs with the new
    blocks instead of being answered as ended."""
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    producer.evict(P_ID, now=1.0)
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=2.0, match_key="k1")
    result = producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=3.0)
    assert result.outcome is RegOutcome.MATCHED and result.match is not None
    assert result.match.request_id == "cmpl-abc-0-aaaaaaaa"


def test_an_unkeyed_p_request_leaves_nothing_ended(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0)
    producer.evict(P_ID, now=1.0)
    assert len(producer.finished) == 0
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=2.0) == RegResult(RegOutcome.STASHED)


def test_evicted_blocks_end_their_request(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    producer.evict(P_ID, now=1.0)
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=2.0) == RegResult(RegOutcome.FINISHED)


def test_expired_lease_ends_its_request(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    assert producer.expire(30.0) == [Expired(P_ID, ExpiryKind.LEASE, NOT_CLAIMED)]
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=31.0) == RegResult(RegOutcome.FINISHED)


def test_ended_requests_are_forgotten_a_registration_ttl_later(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    producer.evict(P_ID, now=5.0)  # remembered until 15
    producer.expire(14.999)
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=14.999).outcome is RegOutcome.FINISHED
    producer.expire(15.0)
    assert ENDED not in producer.finished
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=15.0).outcome is RegOutcome.STASHED


def test_only_the_newest_ended_requests_are_kept(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_tombstones=2)
    for i, key in enumerate(("k1", "k2", "k3")):
        table.add_staged(f"cmpl-{key}-0-1a2b3c4d", BLOCKS, now=float(i), match_key=key)
        table.evict(f"cmpl-{key}-0-1a2b3c4d", now=float(i))
    assert len(table.finished) == 2 and ("k1", "cmpl-k1-0") not in table.finished
    outcomes = {key: table.add_registration(push_reg(f"cmpl-{key}-0-deadbeef", match_key=key), "d", now=3.0).outcome
                for key in ("k1", "k2", "k3")}
    assert outcomes == {"k1": RegOutcome.STASHED, "k2": RegOutcome.FINISHED, "k3": RegOutcome.FINISHED}


def test_only_the_newest_released_keys_are_kept(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_tombstones=2)
    for key in ("k1", "k2", "k3"):
        dummy = push_reg(f"cmpl-{key}-0", local_block_ids=[], match_key=key)
        assert table.add_registration(dummy, "d", now=0.0).outcome is RegOutcome.RELEASED
    assert len(table.released) == 2
    outcomes = {key: table.add_staged(f"cmpl-p{key}-0", [[1]], now=1.0, match_key=key).outcome
                for key in ("k1", "k2", "k3")}
    assert outcomes == {"k1": StageOutcome.STASHED, "k2": StageOutcome.RELEASED, "k3": StageOutcome.RELEASED}


def test_a_cancelled_id_is_answered_cancelled_before_finished(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    producer.evict(P_ID, now=0.0)
    producer.cancel_registration(OWNER, D_ID, now=0.0)
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=1.0) == RegResult(RegOutcome.CANCELLED)


def test_a_cancelled_release_releases_nothing(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    producer.cancel_registration(OWNER, "cmpl-dummy", now=0.0)
    dummy = push_reg("cmpl-dummy", local_block_ids=[], match_key="k1")
    assert producer.add_registration(dummy, "d", now=1.0) == RegResult(RegOutcome.CANCELLED)
    assert set(producer.staged) == {P_ID} and "k1" not in producer.released


# ---------------------------------------------------------------- evict


def test_evict_drops_staged_blocks(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0)
    staged = producer.staged[P_ID]
    assert producer.evict(P_ID, now=1.0) is staged
    assert not producer.staged
    assert not producer.busy
    assert producer.expire(1e9) == []  # nothing left to expire either
    assert producer.evict(P_ID, now=1.0) is None
    # Evicted blocks are not matched by a later registration, exactly or by base.
    assert producer.add_registration(push_reg(P_ID), "d", now=1.0) == RegResult(RegOutcome.STASHED)
    assert producer.add_registration(push_reg(D_ID), "d", now=1.0) == RegResult(RegOutcome.STASHED)


def test_writing_request_is_not_evictable(producer, push_reg) -> None:
    match = writing(producer, push_reg, staged_key="k1")
    assert producer.evict(P_ID, now=1.0) is None
    assert producer.writing == {P_ID: match}
    assert producer.busy
    assert len(producer.finished) == 0


def test_evict_unknown_request_and_registration_ids(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "d", now=0.0)
    assert producer.evict("never-seen", now=1.0) is None
    assert producer.evict(D_ID, now=1.0) is None  # evict names P requests; D's registration stays
    assert set(producer.registrations) == {(OWNER, D_ID)}


# ---------------------------------------------------------------- expiry


def test_unmatched_blocks_lease_expires_at_deadline(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=100.0)
    assert producer.staged[P_ID].lease_expires_at == 130.0
    assert producer.expire(130.0 - 0.001) == []
    assert P_ID in producer.staged
    (expired,) = producer.expire(130.0)
    assert expired == Expired(P_ID, ExpiryKind.LEASE, NOT_CLAIMED)
    assert (expired.sender, expired.owner) == ("", "")  # nobody on D to tell
    assert not producer.staged
    assert not producer.busy
    assert producer.expire(1e9) == []
    # Expired blocks are gone for good: a late registration waits on its own.
    assert producer.add_registration(push_reg(D_ID), "d", now=200.0) == RegResult(RegOutcome.STASHED)


def test_registration_ttl_expires_at_deadline(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "d-agent-3", now=50.0)
    assert producer.registrations[(OWNER, D_ID)].expires_at == 60.0
    assert producer.expire(60.0 - 0.001) == []
    assert producer.expire(60.0) == [Expired(D_ID, ExpiryKind.REGISTRATION, NEVER_CAME, "d-agent-3", OWNER)]
    assert not producer.registrations
    assert producer.add_staged(P_ID, BLOCKS, now=61.0) == StageResult(StageOutcome.STASHED)


def test_expire_reports_both_kinds_and_keeps_the_rest(producer, push_reg) -> None:
    producer.add_staged("cmpl-s1-0-aaaaaaaa", BLOCKS, now=0.0)  # lease until 30
    producer.add_staged("cmpl-s2-0-aaaaaaaa", BLOCKS, now=20.0)  # lease until 50
    producer.add_registration(push_reg("cmpl-r1-0-aaaaaaaa", decode_engine_id=OTHER), "d0", now=15.0)  # until 25
    producer.add_registration(push_reg("cmpl-r2-0-aaaaaaaa"), "d1", now=25.0)  # until 35
    expired = producer.expire(30.0)
    assert set(expired) == {
        Expired("cmpl-s1-0-aaaaaaaa", ExpiryKind.LEASE, NOT_CLAIMED),
        Expired("cmpl-r1-0-aaaaaaaa", ExpiryKind.REGISTRATION, NEVER_CAME, "d0", OTHER),
    }
    assert len(expired) == 2
    assert set(producer.staged) == {"cmpl-s2-0-aaaaaaaa"}
    assert set(producer.registrations) == {(OWNER, "cmpl-r2-0-aaaaaaaa")}
    assert producer.expire(34.999) == []
    assert [e.request_id for e in producer.expire(35.0)] == ["cmpl-r2-0-aaaaaaaa"]


def test_expire_never_reaps_a_write_in_flight(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="k1")
    match = producer.add_registration(push_reg(D_ID), "d", now=1.0).match
    assert producer.expire(1e12) == []
    assert producer.writing == {P_ID: match}
    assert producer.busy
    assert len(producer.finished) == 0


def test_expired_registration_index_is_cleared(producer, push_reg) -> None:
    """After a base-indexed registration expires, a new one with the same base is used."""
    producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "old", now=0.0)
    producer.expire(10.0)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "new", now=10.0)
    match = producer.add_staged(P_ID, BLOCKS, now=10.0).match
    assert match is not None and match.registration.sender == "new"


# ---------------------------------------------------------------- cancellation


def test_cancel_of_a_stashed_registration_drops_it_and_tombstones_the_id(push_reg) -> None:
    t = ProducerTable(lease_s=10.0, registration_ttl_s=5.0)
    t.add_registration(push_reg(request_id="d1"), "agent-d", now=0.0)
    assert t.cancel_registration(OWNER, "d1", now=1.0) is None
    assert t.registrations == {}
    # A copy of the PUSH_REG that was still on the wire must not be stashed again.
    assert t.add_registration(push_reg(request_id="d1"), "agent-d", now=1.5) == RegResult(RegOutcome.CANCELLED)
    assert t.add_staged("d1", [[1]], now=2.0).outcome is StageOutcome.STASHED  # nothing to match
    t.expire(5.999)
    assert (OWNER, "d1") in t.cancelled
    t.expire(6.0)  # tombstone gone after the registration TTL
    assert (OWNER, "d1") not in t.cancelled
    assert t.add_registration(push_reg(request_id="d1"), "agent-d", now=6.0).outcome is RegOutcome.MATCHED


def test_cancel_of_a_registration_being_written_returns_the_match(push_reg) -> None:
    t = ProducerTable(lease_s=10.0, registration_ttl_s=5.0)
    t.add_staged("p1", [[1]], now=0.0)
    match = t.add_registration(push_reg(request_id="p1"), "agent-d", now=0.0).match
    assert t.cancel_registration(OWNER, "p1", now=1.0) is match
    assert t.writing == {"p1": match}  # the caller settles the WRITE first
    assert t.finish("p1", now=1.5) is match


def test_cancel_of_an_unknown_registration_only_tombstones(producer, push_reg) -> None:
    assert producer.cancel_registration(OWNER, "ghost", now=0.0) is None
    assert producer.add_registration(push_reg(request_id="ghost"), "a", now=0.1).outcome is RegOutcome.CANCELLED
    assert repr(producer).endswith("tombstones=1>")


def test_an_engine_cannot_cancel_another_engines_registration(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "d0", now=0.0)
    producer.add_registration(push_reg(D_ID, decode_engine_id=OTHER), "d1", now=0.0)
    assert producer.cancel_registration(OTHER, D_ID, now=1.0) is None
    assert list(producer.registrations) == [(OWNER, D_ID)]
    match = producer.add_staged(P_ID, BLOCKS, now=2.0).match
    assert match is not None and match.registration.sender == "d0"


def test_tombstones_are_per_owner(producer, push_reg) -> None:
    producer.cancel_registration(OTHER, D_ID, now=0.0)
    assert producer.add_registration(push_reg(D_ID), "d0", now=1.0) == RegResult(RegOutcome.STASHED)
    assert producer.add_registration(push_reg(D_ID, decode_engine_id=OTHER), "d1", now=1.0) \
        == RegResult(RegOutcome.CANCELLED)


def test_an_engine_cannot_cancel_a_write_for_another_engine(producer, push_reg) -> None:
    match = writing(producer, push_reg)
    assert producer.cancel_registration(OTHER, D_ID, now=1.0) is None
    assert producer.writing == {P_ID: match}
    assert producer.cancel_registration(OWNER, D_ID, now=1.0) is match


def test_only_the_newest_tombstones_are_kept(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_tombstones=2)
    for rid in ("d1", "d2", "d3"):
        table.cancel_registration(OWNER, rid, now=0.0)
    assert len(table.cancelled) == 2 and (OWNER, "d1") not in table.cancelled
    outcomes = [table.add_registration(push_reg(rid), "d", now=1.0).outcome for rid in ("d1", "d2", "d3")]
    assert outcomes == [RegOutcome.STASHED, RegOutcome.CANCELLED, RegOutcome.CANCELLED]


def test_a_cancel_repeated_renews_its_tombstone(push_reg) -> None:
    table = ProducerTable(lease_s=30.0, registration_ttl_s=10.0, max_tombstones=2)
    table.cancel_registration(OWNER, "d1", now=0.0)
    table.cancel_registration(OWNER, "d2", now=0.0)
    table.cancel_registration(OWNER, "d1", now=5.0)  # d1 is now the newest, until 15
    table.cancel_registration(OWNER, "d3", now=5.0)  # pushes out d2
    assert [k in table.cancelled for k in ((OWNER, "d1"), (OWNER, "d2"), (OWNER, "d3"))] == [True, False, True]
    table.expire(10.0)
    assert (OWNER, "d1") in table.cancelled


# ---------------------------------------------------------------- peers going away


def test_drop_registrations_from_departed_agents(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-a-0-aaaaaaaa"), "peer1-agent0", now=0.0)
    producer.add_registration(push_reg("cmpl-b-0-aaaaaaaa"), "peer2-agent0", now=0.0)
    producer.add_registration(push_reg("cmpl-c-0-aaaaaaaa", decode_engine_id=OTHER), "peer1-agent1", now=0.0,
                              verified=False)
    producer.add_staged("cmpl-x-0-11111111", BLOCKS, now=0.0)

    gone = producer.drop_registrations_from({"peer1-agent0", "peer1-agent1"})

    assert {g.request_id for g in gone} == {"cmpl-a-0-aaaaaaaa", "cmpl-c-0-aaaaaaaa"}
    assert {g.sender for g in gone} == {"peer1-agent0", "peer1-agent1"}
    assert set(producer.registrations) == {(OWNER, "cmpl-b-0-aaaaaaaa")}
    assert set(producer.staged) == {"cmpl-x-0-11111111"}
    assert repr(producer).endswith("unverified=0 tombstones=0>")
    # Dropped registrations no longer match by base id.
    assert producer.add_staged("cmpl-a-0-11111111", BLOCKS, now=1.0) == StageResult(StageOutcome.STASHED)


def test_drop_registrations_leaves_writes_in_flight(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "peer1", now=0.0)
    match = producer.add_staged(P_ID, BLOCKS, now=0.0).match
    assert producer.drop_registrations_from({"peer1"}) == []
    assert producer.writing == {P_ID: match}


def test_drop_registrations_from_nobody(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "peer1", now=0.0)
    assert producer.drop_registrations_from(set()) == []
    assert producer.drop_registrations_from({"peer2"}) == []
    assert set(producer.registrations) == {(OWNER, D_ID)}


def test_drop_registration_by_key(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID, match_key="k1"), "stranger", now=0.0, verified=False)
    registration = producer.registrations[(OWNER, D_ID)]
    assert producer.drop_registration((OTHER, D_ID)) is None
    assert producer.drop_registration((OWNER, D_ID)) is registration
    assert producer.drop_registration((OWNER, D_ID)) is None
    assert repr(producer).endswith("unverified=0 tombstones=0>")
    # Neither its id nor its key is held any more; a drop is no tombstone.
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=1.0).outcome is RegOutcome.STASHED


# ---------------------------------------------------------------- views


def test_empty_table_views(producer) -> None:
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert not producer.busy
    assert producer.expire(1e9) == []
    assert repr(producer) == ("<ProducerTable {'p_registrations': 0, 'p_staged': 0, 'p_writing': 0} "
                              "unverified=0 tombstones=0>")


def test_registrations_alone_do_not_make_the_table_busy(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID), "d", now=0.0)
    producer.add_registration(push_reg("cmpl-x-0-deadbeef"), "d", now=0.0, verified=False)
    assert not producer.busy


def test_repr_shows_sizes(producer, push_reg) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0)
    producer.add_registration(push_reg("cmpl-x-0-deadbeef"), "d", now=0.0, verified=False)
    text = repr(producer)
    assert text.startswith("<ProducerTable ")
    assert "'p_staged': 1" in text and "'p_registrations': 1" in text and "unverified=1" in text


def test_tracks_staged_and_writing_requests_only(producer, push_reg) -> None:
    producer.add_staged("staged", [[1]], now=0.0)
    producer.add_staged("writing", [[2]], now=0.0)
    producer.add_registration(push_reg("writing"), "d-agent", now=0.0)
    producer.add_registration(push_reg("only-registered"), "d-agent", now=0.0)
    assert producer.tracks("staged") and producer.tracks("writing")
    assert not producer.tracks("only-registered") and not producer.tracks("unknown")
    producer.finish("writing", now=1.0)
    producer.evict("staged", now=1.0)
    assert not producer.tracks("staged") and not producer.tracks("writing")
