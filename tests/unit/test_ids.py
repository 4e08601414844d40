"""base_request_id: strip exactly vLLM's per-engine ``-<8 hex>`` suffix, nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.state.ids import base_request_id

HEX8 = st.text(alphabet="0123456789abcdef", min_size=8, max_size=8)
ID_CHARS = st.characters(codec="utf-8", exclude_characters="\x00")


@pytest.mark.parametrize(
    ("request_id", "base"),
    [
        ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0"),
        ("cmpl-abc-0-deadbeef", "cmpl-abc-0"),
        ("cmpl-abc-1-deadbeef", "cmpl-abc-1"),
        ("cmpl-0c5e2f6a-4b1d-4e8f-9a7b-123456789abc-0-00000000", "cmpl-0c5e2f6a-4b1d-4e8f-9a7b-123456789abc-0"),
        ("chatcmpl-xyz-12-ffffffff", "chatcmpl-xyz-12"),
        # Only the last suffix goes: a base that itself ends in 8 hex keeps it.
        ("cmpl-abc-0-deadbeef-cafebabe", "cmpl-abc-0-deadbeef"),
        ("x-01234567", "x"),
    ],
)
def test_strips_trailing_random_suffix(request_id: str, base: str) -> None:
    assert base_request_id(request_id) == base


@pytest.mark.parametrize(
    "request_id",
    [
        "",
        "cmpl-abc-0",  # randomisation disabled: the id is its own base
        "deadbeef",  # no separator at all
        "-deadbeef",  # nothing before the separator
        "cmpl-abc-0-",  # empty tail
        "cmpl-abc-0-deadbee",  # 7 hex
        "cmpl-abc-0-deadbeef0",  # 9 hex
        "cmpl-abc-0-DEADBEEF",  # vLLM's suffix is lower-case hex
        "cmpl-abc-0-deadbeeg",  # not hex
        "cmpl-abc-0-dead bee",  # 8 chars, one is a space
        "cmpl-abc-0-１２３４５６７８",  # non-ASCII digits are not hex
        "cmpl-abc-0_deadbeef",  # wrong separator
        "cmpl-abc-0:deadbeef",
    ],
)
def test_ids_without_suffix_are_their_own_base(request_id: str) -> None:
    assert base_request_id(request_id) == request_id


def test_p_and_d_legs_of_one_request_share_a_base() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == base_request_id("cmpl-abc-0-deadbeef")


def test_multi_prompt_sub_requests_stay_distinct() -> None:
    assert base_request_id("cmpl-abc-0-1a2b3c4d") != base_request_id("cmpl-abc-1-1a2b3c4d")


@given(head=st.text(ID_CHARS, min_size=1, max_size=40), suffix=HEX8)
def test_suffix_is_stripped_for_any_non_empty_head(head: str, suffix: str) -> None:
    assert base_request_id(f"{head}-{suffix}") == head


@given(request_id=st.text(ID_CHARS, max_size=60))
def test_result_is_the_id_or_the_id_minus_one_hex_suffix(request_id: str) -> None:
    base = base_request_id(request_id)
    if base != request_id:
        tail = request_id[len(base) :]
        assert request_id.startswith(base)
        assert base
        assert len(tail) == 9 and tail[0] == "-"
        assert set(tail[1:]) <= set("0123456789abcdef")


@given(
    prefix=st.text(ID_CHARS, min_size=1, max_size=30),
    i=st.integers(0, 1000),
    j=st.integers(0, 1000),
    s1=HEX8,
    s2=HEX8,
)
def test_sub_request_index_survives_normalisation(prefix: str, i: int, j: int, s1: str, s2: str) -> None:
    same = base_request_id(f"{prefix}-{i}-{s1}") == base_request_id(f"{prefix}-{j}-{s2}")
    assert same == (i == j)
