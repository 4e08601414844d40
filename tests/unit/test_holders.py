"""The block holder index (state/holders.py): which registration holds each block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.state.holders import FEW, MAX_BLOCK_ID, BlockHolders


def test_a_held_block_names_its_holder_and_is_free_once_released() -> None:
    h = BlockHolders()
    h.hold("a", [[3, 4, 5], [9]])
    assert h.holder([[1, 2]]) is None
    assert h.holder([[1, 5, 4]]) == (5, "a"), "the first held block in the order asked"
    assert h.holder([[], [8, 9]]) == (9, "a")
    assert h.holder([[7], [3]]) is None, "block 3 of group 1 is not block 3 of group 0"
    assert len(h) == 1 and h.cells() == {(0, 3): "a", (0, 4): "a", (0, 5): "a", (1, 9): "a"}
    h.release("a")
    assert h.holder([[3, 4, 5], [9]]) is None and len(h) == 0 and h.cells() == {}


def test_a_block_held_by_one_registration_stays_with_it() -> None:
    h = BlockHolders()
    h.hold("first", [[1, 2]])
    h.hold("second", [[2, 3]])  # the caller refuses such a registration; the index never moves a block
    assert h.holder([[2]]) == (2, "first")
    h.release("second")
    assert h.holder([[2]]) == (2, "first"), "releasing the second must not free the first's block"
    assert h.holder([[3]]) is None
    h.release("first")
    assert h.cells() == {}


def test_a_request_id_holds_once_and_again_after_release() -> None:
    h = BlockHolders()
    h.hold("r", [[1]])
    with pytest.raises(ValueError, match="holds blocks already"):
        h.hold("r", [[2]])
    assert h.cells() == {(0, 1): "r"}
    h.release("r")
    h.release("r")  # nothing held: nothing happens
    h.hold("r", [[2]])
    assert h.cells() == {(0, 2): "r"}


def test_ids_nobody_holds_are_free() -> None:
    h = BlockHolders()
    h.hold("r", [[0, 1023]])
    assert h.holder([[-1]]) is None
    assert h.holder([[-1024]]) is None
    assert h.holder([[10**9]]) is None
    assert h.holder([[], [], [0]]) is None, "a group the index never saw"


def test_a_block_named_twice_is_taken_once_and_given_back_once() -> None:
    h = BlockHolders()
    h.hold("r", [[4, 4, 5]])
    assert h.cells() == {(0, 4): "r", (0, 5): "r"}
    h.release("r")
    assert h.cells() == {}


@pytest.mark.parametrize("bad", [[[-1]], [[1], [MAX_BLOCK_ID + 1]], [list(range(FEW)) + [-5]]])
def test_a_bad_id_is_refused_before_anything_is_held(bad: list[list[int]]) -> None:
    h = BlockHolders()
    with pytest.raises(ValueError, match="outside"):
        h.hold("r", bad)
    assert h.cells() == {} and len(h) == 0
    h.hold("r", [[1]])  # the refused call took nothing, not even the request id
    assert h.cells() == {(0, 1): "r"}


def test_many_ids_go_by_arrays_and_agree_with_few() -> None:
    h = BlockHolders()
    many = list(range(10, 10 + 4 * FEW))  # over FEW: the array path
    h.hold("big", [many, [3]])
    h.hold("small", [[5, 10, 11], [3, 4]])  # 10, 11 and group 1's 3 are taken: it gets 5 and 4
    assert h.holder([[2_000, 9, 10 + 2 * FEW]]) == (10 + 2 * FEW, "big")
    assert h.holder([list(range(-FEW, 0)) + [5] + list(range(1_000, 1_000 + FEW))]) == (5, "small")
    assert h.holder([list(range(1_000, 1_000 + 2 * FEW)), [4]]) == (4, "small")
    h.release("big")
    assert h.cells() == {(0, 5): "small", (1, 4): "small"}
    h.release("small")
    assert h.cells() == {}


def test_far_apart_ids_are_held_alike() -> None:
    h = BlockHolders()
    h.hold("a", [[5]])
    h.hold("b", [[100_000, 6]])
    assert h.holder([[5]]) == (5, "a") and h.holder([[100_000]]) == (100_000, "b")
    h.release("a")
    assert h.cells() == {(0, 6): "b", (0, 100_000): "b"}


ops = st.lists(st.one_of(
    st.tuples(st.just("hold"), st.sampled_from("abcde"),
              st.lists(st.one_of(st.lists(st.integers(0, 40), max_size=6),  # few ids, and many
                                 st.lists(st.integers(0, 300), min_size=FEW + 1, max_size=2 * FEW)), max_size=3)),
    st.tuples(st.just("release"), st.sampled_from("abcde"), st.just([]))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops, st.lists(st.one_of(st.lists(st.integers(-3, 45), max_size=5),
                               st.lists(st.integers(-3, 310), min_size=FEW + 1, max_size=2 * FEW)), max_size=3))
def test_the_index_agrees_with_a_dict_of_blocks(steps, probe) -> None:
    h, model, holding = BlockHolders(), {}, set()
    for op, rid, blocks in steps:
        if op == "hold":
            if rid in holding:
                continue
            holding.add(rid)
            h.hold(rid, blocks)
            for g, ids in enumerate(blocks):
                for b in ids:
                    model.setdefault((g, b), rid)
        else:
            holding.discard(rid)
            h.release(rid)
            model = {cell: r for cell, r in model.items() if r != rid}
        assert h.cells() == model and len(h) == len(holding)
    expected = next(((b, model[(g, b)]) for g, ids in enumerate(probe) for b in ids if (g, b) in model), None)
    assert h.holder(probe) == expected
