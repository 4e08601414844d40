"""ProducerTable matching: a D registration meets P's finished blocks, in either order. Ids
pair them (the exact id, then the base id); match keys only keep exchanges apart. Also
ambiguity, and releases (registrations with no blocks)."""

from __future__ import annotations

import pytest

from pushsvc.protocol.notif import PushReg
from pushsvc.state.ids import base_request_id
from pushsvc.state.producer import Match, ProducerTable, RegOutcome, RegResult, StageOutcome, StageResult

P_ID = "cmpl-abc-0-1a2b3c4d"  # P's id for the request
D_ID = "cmpl-abc-0-deadbeef"  # D's id for the same request: same base, other suffix
OWNER = "decode-engine"  # the D engine ``push_reg`` names unless told otherwise
BLOCKS = [[7, 8, 9]]


def only_match(table: ProducerTable) -> Match:
    assert len(table.writing) == 1
    return next(iter(table.writing.values()))


def second_arrival(table, reg, staged_id: str, registration_first: bool, *, staged_key: str = "",
                   sender: str = "d") -> RegResult | StageResult:
    """Deliver ``reg`` and P's blocks of ``staged_id`` in the given order; the first must
    be stashed, the second's result is returned."""
    if registration_first:
        assert table.add_registration(reg, sender, now=0.0) == RegResult(RegOutcome.STASHED)
        return table.add_staged(staged_id, BLOCKS, now=0.0, match_key=staged_key)
    assert table.add_staged(staged_id, BLOCKS, now=0.0, match_key=staged_key) == StageResult(StageOutcome.STASHED)
    return table.add_registration(reg, sender, now=0.0)


# ---------------------------------------------------------------- either order


def test_registration_first_then_blocks(producer, push_reg) -> None:
    reg = push_reg(D_ID, local_block_ids=[[0, 1, 2]])
    assert producer.add_registration(reg, "d-agent-0", now=1.0) == RegResult(RegOutcome.STASHED)
    registration = producer.registrations[(OWNER, D_ID)]
    assert (registration.key, registration.request_id, registration.match_key) == ((OWNER, D_ID), D_ID, "")
    assert (registration.registered_at, registration.expires_at, registration.verified) == (1.0, 11.0, True)
    assert producer.sizes() == {"p_registrations": 1, "p_staged": 0, "p_writing": 0}
    assert not producer.busy

    result = producer.add_staged(P_ID, BLOCKS, now=3.0)

    assert (result.outcome, result.collided) == (StageOutcome.MATCHED, ())
    match = result.match
    assert match is not None
    assert (match.request_id, match.remote_request_id, match.block_ids) == (P_ID, D_ID, BLOCKS)
    assert match.registration is registration and match.registration.reg is reg
    assert match.registration.sender == "d-agent-0"
    assert (match.staged.request_id, match.staged.staged_at, match.staged.lease_expires_at) == (P_ID, 3.0, 33.0)
    assert match.matched_at == 3.0
    assert producer.writing == {P_ID: match}
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}
    assert producer.busy


def test_blocks_first_then_registration(producer, push_reg) -> None:
    assert producer.add_staged(P_ID, BLOCKS, now=1.0) == StageResult(StageOutcome.STASHED)
    staged = producer.staged[P_ID]
    assert (staged.block_ids, staged.match_key, staged.staged_at, staged.lease_expires_at) == (BLOCKS, "", 1.0, 31.0)
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 1, "p_writing": 0}
    assert producer.busy

    reg = push_reg(D_ID)
    result = producer.add_registration(reg, "d-agent-1", now=4.0)

    assert (result.outcome, result.collided) == (RegOutcome.MATCHED, ())
    match = result.match
    assert match is not None and match.staged is staged
    assert (match.request_id, match.remote_request_id, match.block_ids) == (P_ID, D_ID, BLOCKS)
    assert match.registration.reg is reg and match.registration.sender == "d-agent-1"
    assert match.registration.registered_at == match.matched_at == 4.0
    assert producer.writing == {P_ID: match}
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 1}


@pytest.mark.parametrize("registration_first", [True, False])
@pytest.mark.parametrize(
    ("d_id", "p_id"),
    [
        ("cmpl-abc-0", "cmpl-abc-0"),  # id randomisation off: both legs carry one id
        ("cmpl-abc-0-deadbeef", "cmpl-abc-0-1a2b3c4d"),  # only the random suffixes differ
        ("cmpl-abc-0", "cmpl-abc-0-1a2b3c4d"),  # one engine randomises, the other does not
        ("cmpl-abc-0-deadbeef", "cmpl-abc-0"),
    ],
)
def test_ids_with_one_base_match(producer, push_reg, registration_first: bool, d_id: str, p_id: str) -> None:
    result = second_arrival(producer, push_reg(d_id), p_id, registration_first)
    assert result.outcome.value == "matched"
    assert result.match is not None and (result.match.request_id, result.match.remote_request_id) == (p_id, d_id)


@pytest.mark.parametrize("registration_first", [True, False])
def test_multi_prompt_sub_requests_do_not_cross_match(producer, push_reg, registration_first: bool) -> None:
    if registration_first:
        r = producer.add_registration(push_reg("cmpl-abc-0-deadbeef"), "d", now=0.0)
        s = producer.add_staged("cmpl-abc-1-1a2b3c4d", BLOCKS, now=0.0)
    else:
        s = producer.add_staged("cmpl-abc-1-1a2b3c4d", BLOCKS, now=0.0)
        r = producer.add_registration(push_reg("cmpl-abc-0-deadbeef"), "d", now=0.0)
    assert r == RegResult(RegOutcome.STASHED)
    assert s == StageResult(StageOutcome.STASHED)
    assert not producer.writing

    # Each sub-request still finds its own partner.
    m1 = producer.add_staged("cmpl-abc-0-1a2b3c4d", [[1]], now=1.0).match
    m0 = producer.add_registration(push_reg("cmpl-abc-1-deadbeef"), "d", now=1.0).match
    assert m1 is not None and (m1.request_id, m1.remote_request_id) == ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0-deadbeef")
    assert m0 is not None and (m0.request_id, m0.remote_request_id) == ("cmpl-abc-1-1a2b3c4d", "cmpl-abc-1-deadbeef")
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 2}


def test_unrelated_ids_do_not_match(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-xyz-0-deadbeef"), "d", now=0.0)
    assert producer.add_staged("cmpl-abc-0-deadbeef", BLOCKS, now=0.0) == StageResult(StageOutcome.STASHED)
    assert producer.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}


# ---------------------------------------------------------------- match keys filter, ids pair


@pytest.mark.parametrize("registration_first", [True, False])
@pytest.mark.parametrize("d_id", [P_ID, D_ID])  # the exact id, or only the base id
def test_equal_match_keys_pair_by_their_ids(producer, push_reg, registration_first: bool, d_id: str) -> None:
    result = second_arrival(producer, push_reg(d_id, match_key="k1"), P_ID, registration_first, staged_key="k1")
    assert result.outcome.value == "matched"
    assert result.match is not None and (result.match.request_id, result.match.remote_request_id) == (P_ID, d_id)
    assert result.match.staged.match_key == result.match.registration.match_key == "k1"


@pytest.mark.parametrize("registration_first", [True, False])
def test_equal_match_keys_do_not_pair_unrelated_ids(producer, push_reg, registration_first: bool) -> None:
    """A key only keeps exchanges apart: within one, the ids still decide."""
    reg = push_reg("cmpl-xyz-0-deadbeef", match_key="k1")
    second = second_arrival(producer, reg, "cmpl-abc-7-1a2b3c4d", registration_first, staged_key="k1")
    assert second.outcome.value == "stashed"
    assert producer.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}


@pytest.mark.parametrize("registration_first", [True, False])
@pytest.mark.parametrize("d_id", [P_ID, D_ID])
def test_different_match_keys_never_pair_even_with_one_id(producer, push_reg, registration_first: bool,
                                                        d_id: str) -> None:
    second = second_arrival(producer, push_reg(d_id, match_key="k1"), P_ID, registration_first, staged_key="k2")
    assert second.outcome.value == "stashed"
    assert producer.sizes() == {"p_registrations": 1, "p_staged": 1, "p_writing": 0}


@pytest.mark.parametrize("registration_first", [True, False])
@pytest.mark.parametrize(("reg_key", "staged_key"), [("k1", ""), ("", "k1")])
def test_a_key_on_one_side_only_leaves_the_ids_to_decide(producer, push_reg, registration_first: bool,
                                                         reg_key: str, staged_key: str) -> None:
    result = second_arrival(producer, push_reg(D_ID, match_key=reg_key), P_ID, registration_first,
                            staged_key=staged_key)
    assert result.outcome.value == "matched"
    # ...and only the ids: an unrelated id does not pair, key or no key.
    second = second_arrival(producer, push_reg("cmpl-xyz-0-deadbeef", match_key=reg_key), "cmpl-uvw-0-1a2b3c4d",
                            registration_first, staged_key=staged_key)
    assert second.outcome.value == "stashed"


def test_another_exchanges_key_rules_out_even_the_exact_staged_id(producer, push_reg) -> None:
    producer.add_staged(D_ID, [[1]], now=0.0, match_key="k2")  # D's very id, another exchange
    producer.add_staged("cmpl-xyz-0-1a2b3c4d", [[2]], now=0.0, match_key="k1")  # D's exchange, another id
    assert producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=1.0) == RegResult(RegOutcome.STASHED)
    assert set(producer.staged) == {D_ID, "cmpl-xyz-0-1a2b3c4d"}
    result = producer.add_staged(P_ID, BLOCKS, now=2.0, match_key="k1")  # its own P request comes
    assert result.outcome is StageOutcome.MATCHED and result.match is not None
    assert result.match.remote_request_id == D_ID
    assert set(producer.staged) == {D_ID, "cmpl-xyz-0-1a2b3c4d"}


def test_another_exchanges_key_rules_out_even_the_exact_registered_id(producer, push_reg) -> None:
    producer.add_registration(push_reg(P_ID, match_key="k2"), "d0", now=0.0)
    producer.add_registration(push_reg("cmpl-xyz-0-deadbeef", match_key="k1"), "d1", now=0.0)
    assert producer.add_staged(P_ID, BLOCKS, now=1.0, match_key="k1") == StageResult(StageOutcome.STASHED)
    assert set(producer.registrations) == {(OWNER, P_ID), (OWNER, "cmpl-xyz-0-deadbeef")}
    result = producer.add_registration(push_reg(D_ID, match_key="k1"), "d2", now=2.0)
    assert result.outcome is RegOutcome.MATCHED and result.match is not None
    assert (result.match.request_id, result.match.registration.sender) == (P_ID, "d2")


def test_match_keys_tell_apart_registrations_that_share_a_base_id(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa", match_key="k1"), "d0", now=0.0)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb", match_key="k2"), "d1", now=0.0)
    result = producer.add_staged(P_ID, BLOCKS, now=1.0, match_key="k2")
    assert result.outcome is StageOutcome.MATCHED and result.match is not None
    assert result.match.remote_request_id == "cmpl-abc-0-bbbbbbbb"
    assert set(producer.registrations) == {(OWNER, "cmpl-abc-0-aaaaaaaa")}


def test_match_keys_tell_apart_staged_requests_that_share_a_base_id(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0, match_key="k1")
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=0.0, match_key="k2")
    result = producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=1.0)
    assert result.outcome is RegOutcome.MATCHED and result.match is not None
    assert (result.match.request_id, result.match.block_ids) == ("cmpl-abc-0-aaaaaaaa", [[1]])
    assert set(producer.staged) == {"cmpl-abc-0-bbbbbbbb"}


def test_two_staged_requests_under_one_match_key_do_not_cross(producer, push_reg) -> None:
    """A batch of prompts sent through the proxy is one exchange, one match key, several
    sub-requests: D's sub-request 0 must not be written P's KV of sub-request 1."""
    producer.add_staged("cmpl-abc-0-1a2b3c4d", [[1]], now=0.0, match_key="k1")
    producer.add_staged("cmpl-abc-1-1a2b3c4d", [[2]], now=0.0, match_key="k1")
    result = producer.add_registration(push_reg("cmpl-abc-0-deadbeef", match_key="k1"), "d", now=1.0)
    assert result.match is not None, "D's sub-request 0 was not paired with P's"
    assert (result.match.request_id, result.match.block_ids) == ("cmpl-abc-0-1a2b3c4d", [[1]])
    assert set(producer.staged) == {"cmpl-abc-1-1a2b3c4d"}


@pytest.mark.parametrize("registration_first", [True, False])
def test_sub_requests_of_one_exchange_pair_by_their_ids(producer, push_reg, registration_first: bool) -> None:
    p_ids = ["cmpl-x-0-1a2b3c4d", "cmpl-x-1-1a2b3c4d"]
    regs = [push_reg("cmpl-x-1-deadbeef", match_key="kx"), push_reg("cmpl-x-0-deadbeef", match_key="kx")]
    if registration_first:
        results = [producer.add_registration(r, "d", now=0.0) for r in regs]
        results += [producer.add_staged(p, [[i]], now=1.0, match_key="kx") for i, p in enumerate(p_ids)]
    else:
        results = [producer.add_staged(p, [[i]], now=0.0, match_key="kx") for i, p in enumerate(p_ids)]
        results += [producer.add_registration(r, "d", now=1.0) for r in regs]
    assert [r.outcome.value for r in results] == ["stashed", "stashed", "matched", "matched"]
    assert {p: (m.remote_request_id, m.block_ids) for p, m in producer.writing.items()} == {
        "cmpl-x-0-1a2b3c4d": ("cmpl-x-0-deadbeef", [[0]]), "cmpl-x-1-1a2b3c4d": ("cmpl-x-1-deadbeef", [[1]])}
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 2}


# ---------------------------------------------------------------- preference and ambiguity


def test_registration_prefers_exact_staged_id_over_another_base_match(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0)
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)
    match = producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d", now=2.0).match
    assert match is not None
    assert (match.request_id, match.block_ids) == ("cmpl-abc-0-bbbbbbbb", [[2]])
    assert set(producer.staged) == {"cmpl-abc-0-aaaaaaaa"}


def test_blocks_prefer_exact_registration_over_another_base_match(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d0", now=0.0)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d1", now=1.0)
    match = producer.add_staged("cmpl-abc-0-bbbbbbbb", BLOCKS, now=2.0).match
    assert match is not None
    assert (match.remote_request_id, match.registration.sender) == ("cmpl-abc-0-bbbbbbbb", "d1")
    assert set(producer.registrations) == {(OWNER, "cmpl-abc-0-aaaaaaaa")}


def test_registration_sharing_a_base_id_with_two_staged_requests_is_ambiguous(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0)
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)
    both = tuple(producer.staged.values())

    result = producer.add_registration(push_reg("cmpl-abc-0-cccccccc"), "d", now=2.0)

    assert result.outcome is RegOutcome.AMBIGUOUS and result.match is None
    assert len(result.collided) == 2 and all(a is b for a, b in zip(result.collided, both, strict=True))
    # Nothing is paired, and neither the arrival nor the candidates stay to pair later.
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert producer.add_registration(push_reg("cmpl-abc-0-dddddddd"), "d", now=2.0) == RegResult(RegOutcome.STASHED)


def test_blocks_sharing_a_base_id_with_two_registrations_are_ambiguous(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d0", now=0.0)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb", decode_engine_id="decode-b"), "d1", now=1.0)
    both = tuple(producer.registrations.values())

    result = producer.add_staged("cmpl-abc-0-cccccccc", [[1]], now=2.0)

    assert result.outcome is StageOutcome.AMBIGUOUS and result.match is None
    assert len(result.collided) == 2 and all(a is b for a, b in zip(result.collided, both, strict=True))
    assert {r.sender for r in result.collided} == {"d0", "d1"}
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert producer.add_staged("cmpl-abc-0-dddddddd", [[2]], now=2.0) == StageResult(StageOutcome.STASHED)


def test_one_id_registered_by_two_engines_is_ambiguous_for_its_blocks(producer, push_reg) -> None:
    producer.add_registration(push_reg(P_ID), "d0", now=0.0)
    producer.add_registration(push_reg(P_ID, decode_engine_id="decode-b"), "d1", now=0.0)
    assert set(producer.registrations) == {(OWNER, P_ID), ("decode-b", P_ID)}
    result = producer.add_staged(P_ID, BLOCKS, now=1.0)
    assert result.outcome is StageOutcome.AMBIGUOUS
    assert {r.key for r in result.collided} == {(OWNER, P_ID), ("decode-b", P_ID)}
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}


@pytest.mark.parametrize("keyed_arrival", [False, True])
def test_ambiguous_blocks_end_their_own_request(producer, push_reg, keyed_arrival: bool) -> None:
    producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d0", now=0.0)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d1", now=0.0)
    key = "k1" if keyed_arrival else ""
    assert producer.add_staged(P_ID, BLOCKS, now=1.0, match_key=key).outcome is StageOutcome.AMBIGUOUS
    late = producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=2.0)
    assert late.outcome is (RegOutcome.FINISHED if keyed_arrival else RegOutcome.STASHED)
    # Only that request of the exchange ended: another sub-request of it still waits.
    other = producer.add_registration(push_reg("cmpl-abc-1-deadbeef", match_key="k1"), "d", now=2.0)
    assert other.outcome is RegOutcome.STASHED


def test_ambiguous_registration_ends_the_staged_it_collided_with(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0, match_key="k1")
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=0.0, match_key="k2")
    result = producer.add_registration(push_reg(D_ID), "d", now=1.0)  # no key: both may pair
    assert result.outcome is RegOutcome.AMBIGUOUS
    assert {s.match_key for s in result.collided} == {"k1", "k2"}
    assert set(producer.finished._until) == {("k1", "cmpl-abc-0"), ("k2", "cmpl-abc-0")}
    for i, key in enumerate(("k1", "k2")):
        late = producer.add_registration(push_reg(f"cmpl-abc-0-eeeeeee{i}", match_key=key), "d", now=2.0)
        assert late.outcome is RegOutcome.FINISHED
        assert producer.add_registration(push_reg(f"cmpl-xyz-0-eeeeeee{i}", match_key=key), "d", now=2.0).outcome \
            is RegOutcome.STASHED  # another base id: another request of that exchange


@pytest.mark.parametrize("registration_first", [True, False])
@pytest.mark.parametrize("other_key", ["k1", ""])  # the same exchange, or no key at all
def test_candidates_that_may_pair_make_a_match_ambiguous(producer, push_reg, registration_first: bool,
                                                         other_key: str) -> None:
    """Keys rule out other exchanges only: two candidates left with one base id are still
    two, whether they share the arrival's key or carry none."""
    if registration_first:
        producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa", match_key="k1"), "d0", now=0.0)
        producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb", match_key=other_key), "d1", now=0.0)
        result: RegResult | StageResult = producer.add_staged(P_ID, BLOCKS, now=1.0, match_key="k1")
    else:
        producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0, match_key="k1")
        producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=0.0, match_key=other_key)
        result = producer.add_registration(push_reg(D_ID, match_key="k1"), "d", now=1.0)
    assert result.outcome.value == "ambiguous" and result.match is None and len(result.collided) == 2
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}


def test_only_candidates_of_the_arrivals_exchange_make_a_match_ambiguous(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0, match_key="k1")  # keyed: not D's
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=0.0)
    result = producer.add_registration(push_reg(D_ID, match_key="k2"), "d", now=1.0)
    assert result.outcome is RegOutcome.MATCHED and result.match is not None
    assert result.match.request_id == "cmpl-abc-0-bbbbbbbb"

    producer.add_registration(push_reg("cmpl-xyz-0-aaaaaaaa", match_key="k3"), "d0", now=2.0)
    producer.add_registration(push_reg("cmpl-xyz-0-bbbbbbbb"), "d1", now=2.0)
    result = producer.add_staged("cmpl-xyz-0-cccccccc", BLOCKS, now=3.0, match_key="k4")
    assert result.outcome is StageOutcome.MATCHED and result.match is not None
    assert result.match.remote_request_id == "cmpl-xyz-0-bbbbbbbb"


def test_an_unverified_registration_is_no_candidate(producer, push_reg) -> None:
    producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "stranger", now=0.0, verified=False)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d", now=0.0)
    result = producer.add_staged(P_ID, BLOCKS, now=1.0)
    assert result.outcome is StageOutcome.MATCHED and result.match is not None
    assert result.match.remote_request_id == "cmpl-abc-0-bbbbbbbb"
    assert set(producer.registrations) == {(OWNER, "cmpl-abc-0-aaaaaaaa")}


def test_base_match_after_a_candidate_was_evicted(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", [[1]], now=0.0)
    producer.add_staged("cmpl-abc-0-bbbbbbbb", [[2]], now=1.0)
    assert producer.evict("cmpl-abc-0-aaaaaaaa", now=1.5) is not None
    match = producer.add_registration(push_reg("cmpl-abc-0-cccccccc"), "d", now=2.0).match
    assert match is not None and match.request_id == "cmpl-abc-0-bbbbbbbb"


def test_registration_is_not_rematched_against_a_request_already_writing(producer, push_reg) -> None:
    producer.add_staged("cmpl-abc-0-aaaaaaaa", BLOCKS, now=0.0)
    producer.add_registration(push_reg("cmpl-abc-0-bbbbbbbb"), "d", now=0.0)
    # A second D registration whose id equals P's id: P's blocks are taken already.
    assert producer.add_registration(push_reg("cmpl-abc-0-aaaaaaaa"), "d", now=1.0) == RegResult(RegOutcome.STASHED)
    assert only_match(producer).remote_request_id == "cmpl-abc-0-bbbbbbbb"


# ---------------------------------------------------------------- releases


def release(push_reg, rid: str = "cmpl-dummy-0-deadbeef", key: str = "kb", **fields) -> PushReg:
    """D's request ended before it was scheduled: a registration with no blocks."""
    return push_reg(rid, local_block_ids=[], match_key=key, **fields)


def test_a_keyed_release_pairs_with_every_staged_request_of_its_exchange(producer, push_reg) -> None:
    producer.add_staged("cmpl-b-0-1a2b3c4d", [[1]], now=0.0, match_key="kb")
    producer.add_staged("cmpl-c-0-1a2b3c4d", [[2]], now=0.0, match_key="kc")  # another exchange
    producer.add_staged("cmpl-b-1-1a2b3c4d", [[3]], now=1.0, match_key="kb")
    producer.add_staged("cmpl-dummy-0-1a2b3c4d", [[4]], now=1.0)  # the release's base id, no key
    reg = release(push_reg)

    result = producer.add_registration(reg, "d-agent", now=2.0)

    assert (result.outcome, result.collided) == (RegOutcome.MATCHED, ())
    assert [(m.request_id, m.block_ids) for m in result.matches] == [("cmpl-b-0-1a2b3c4d", [[1]]),
                                                                     ("cmpl-b-1-1a2b3c4d", [[3]])]
    assert result.match is result.matches[0]
    for m in result.matches:
        assert m.registration.reg is reg and m.registration.release and m.registration.sender == "d-agent"
        assert (m.remote_request_id, m.matched_at) == ("cmpl-dummy-0-deadbeef", 2.0)
    assert producer.writing == {m.request_id: m for m in result.matches}  # the caller finishes them
    assert not producer.registrations  # a keyed release is never kept...
    assert "kb" in producer.released  # ...only its key
    assert set(producer.staged) == {"cmpl-c-0-1a2b3c4d", "cmpl-dummy-0-1a2b3c4d"}
    for m in result.matches:
        assert producer.finish(m.request_id, now=2.0) is m
    assert not producer.writing and {("kb", "cmpl-b-0"), ("kb", "cmpl-b-1")} <= set(producer.finished._until)
    # A sub-request of the exchange that comes later is released on arrival.
    assert producer.add_staged("cmpl-b-2-1a2b3c4d", [[5]], now=3.0, match_key="kb") \
        == StageResult(StageOutcome.RELEASED)
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 2, "p_writing": 0}


def test_a_keyed_release_with_nothing_staged_releases_what_comes_later(producer, push_reg) -> None:
    assert producer.add_registration(release(push_reg), "d", now=1.0) == RegResult(RegOutcome.RELEASED)
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert "kb" in producer.released
    for i, rid in enumerate(("cmpl-b-0-1a2b3c4d", "cmpl-b-1-1a2b3c4d")):
        assert producer.add_staged(rid, [[i]], now=2.0, match_key="kb") == StageResult(StageOutcome.RELEASED)
        assert not producer.tracks(rid)
        assert ("kb", base_request_id(rid)) in producer.finished  # ended: a registration for it is answered
    assert producer.add_registration(push_reg("cmpl-b-0-deadbeef", match_key="kb"), "d", now=2.0) \
        == RegResult(RegOutcome.FINISHED)
    # Another exchange, and requests with no key, are not released.
    assert producer.add_staged("cmpl-c-0-1a2b3c4d", [[7]], now=2.0, match_key="kc").outcome is StageOutcome.STASHED
    assert producer.add_staged("cmpl-b-2-1a2b3c4d", [[8]], now=2.0).outcome is StageOutcome.STASHED
    assert not producer.writing


def test_a_release_is_remembered_for_a_registration_ttl(producer, push_reg) -> None:
    producer.add_registration(release(push_reg), "d", now=1.0)  # until 11
    producer.expire(10.999)
    assert producer.add_staged("cmpl-b-0-1a2b3c4d", [[1]], now=10.999, match_key="kb").outcome \
        is StageOutcome.RELEASED
    producer.expire(11.0)
    assert "kb" not in producer.released
    assert producer.add_staged("cmpl-b-1-1a2b3c4d", [[2]], now=11.0, match_key="kb").outcome is StageOutcome.STASHED


def test_a_release_after_its_exchange_was_served_keeps_nothing(producer, push_reg) -> None:
    producer.add_registration(push_reg(D_ID, match_key="kb"), "d", now=0.0)
    assert producer.add_staged(P_ID, BLOCKS, now=0.0, match_key="kb").match is not None
    producer.finish(P_ID, now=1.0)
    assert producer.add_registration(release(push_reg), "d", now=2.0) == RegResult(RegOutcome.RELEASED)
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}


@pytest.mark.parametrize("no_blocks", [[], [[]], [[], []]])
def test_an_unkeyed_release_pairs_by_id_like_any_registration(producer, push_reg,
                                                              no_blocks: list[list[int]]) -> None:
    producer.add_staged(P_ID, BLOCKS, now=0.0)
    producer.add_staged("cmpl-abc-1-1a2b3c4d", [[1]], now=0.0)  # another request: not released
    reg = push_reg(D_ID, local_block_ids=no_blocks)
    result = producer.add_registration(reg, "d", now=1.0)
    assert result.outcome is RegOutcome.MATCHED and result.match is not None and len(result.matches) == 1
    assert result.match.registration.release and result.match.registration.reg is reg
    assert (result.match.request_id, result.match.remote_request_id) == (P_ID, D_ID)
    assert set(producer.writing) == {P_ID} and set(producer.staged) == {"cmpl-abc-1-1a2b3c4d"}
    assert len(producer.released) == 0


def test_an_unkeyed_release_that_finds_nothing_staged_is_not_kept(producer, push_reg) -> None:
    """Nothing ties it to P blocks that come later (vLLM's dummy carries the request
    body's id, not the one P holds the blocks under)."""
    assert producer.add_registration(push_reg(D_ID, local_block_ids=[]), "d", now=0.0) \
        == RegResult(RegOutcome.RELEASED)
    assert producer.sizes() == {"p_registrations": 0, "p_staged": 0, "p_writing": 0}
    assert len(producer.released) == 0 and len(producer.finished) == 0
    assert producer.add_staged(P_ID, BLOCKS, now=1.0) == StageResult(StageOutcome.STASHED)


def test_a_registration_with_blocks_is_no_release(producer, push_reg) -> None:
    producer.add_staged("cmpl-b-0-1a2b3c4d", [[1]], now=0.0, match_key="kb")
    reg = push_reg("cmpl-dummy-0-deadbeef", local_block_ids=[[], [4]], match_key="kb")
    assert producer.add_registration(reg, "d", now=1.0) == RegResult(RegOutcome.STASHED)
    assert not producer.registrations[(OWNER, "cmpl-dummy-0-deadbeef")].release
    assert "kb" not in producer.released and set(producer.staged) == {"cmpl-b-0-1a2b3c4d"}


def test_finishing_a_release_keeps_another_write_under_its_d_id(producer, push_reg) -> None:
    """A release's matches are not indexed by D's id (several share it), so settling one
    must not drop the index entry of a WRITE a registration under that id started."""
    producer.add_staged("cmpl-b-0-1a2b3c4d", [[1]], now=0.0, match_key="kb")
    assert producer.add_registration(release(push_reg, "cmpl-dummy"), "d", now=0.0).outcome is RegOutcome.MATCHED
    producer.add_staged("cmpl-dummy", [[2]], now=0.0)
    match = producer.add_registration(push_reg("cmpl-dummy"), "d", now=0.0).match  # blocks under that id
    assert match is not None and match.request_id == "cmpl-dummy"
    producer.finish("cmpl-b-0-1a2b3c4d", now=1.0)  # the release's match settled
    # A copy of D's PUSH_REG is still a duplicate, and D's cancel still finds the WRITE.
    assert producer.add_registration(push_reg("cmpl-dummy"), "d", now=1.0) == RegResult(RegOutcome.DUPLICATE)
    assert producer.cancel_registration(OWNER, "cmpl-dummy", now=1.0) is match
    assert producer._writing_remote == {(OWNER, "cmpl-dummy"): "cmpl-dummy"}
