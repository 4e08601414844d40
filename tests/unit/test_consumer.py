"""ConsumerTable: D-side registrations, completion counting, failure and the watchdog."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.state.consumer import PEER_LOST, CompletionOutcome, ConsumerTable, PendingRecv, RecvState, Remote

WATCHDOG = 60.0


def remote(tp_size: int = 1, engine_id: str = "prefill-0") -> Remote:
    return Remote(engine_id=engine_id, host="10.0.0.1", port=5600, tp_size=tp_size)


@pytest.fixture
def table() -> ConsumerTable:
    return ConsumerTable(watchdog_s=WATCHDOG)


# ---------------------------------------------------------------- add


def test_add_tracks_a_pending_registration(table) -> None:
    r = remote()
    entry = table.add("req-1", [[1, 2], [7]], r, now=10.0)
    assert isinstance(entry, PendingRecv)
    assert entry.request_id == "req-1"
    assert entry.block_ids == [[1, 2], [7]]
    assert entry.remote is r
    assert entry.deadline == 10.0 + WATCHDOG
    assert entry.expected == 1
    assert entry.seen == 0
    assert entry.state is RecvState.PENDING
    assert table.pending == {"req-1": entry}
    assert table.sizes() == {"d_pending": 1}


def test_add_is_idempotent(table) -> None:
    first = table.add("req-1", [[1]], remote(), now=0.0)
    assert table.add("req-1", [[2]], remote(tp_size=4), now=5.0) is None
    assert table.pending == {"req-1": first}
    assert first.block_ids == [[1]]
    assert first.deadline == WATCHDOG  # not re-armed
    assert first.expected == 1


@pytest.mark.parametrize(
    ("remote_tp", "local_tp", "expected"),
    [(1, 1, 1), (2, 1, 2), (4, 1, 4), (4, 2, 2), (8, 2, 4), (8, 8, 1), (2, 4, 1), (1, 8, 1), (4, 0, 4)],
)
def test_expected_completions_are_p_ranks_per_d_rank(remote_tp: int, local_tp: int, expected: int) -> None:
    table = ConsumerTable(watchdog_s=1.0, local_tp_size=local_tp)
    entry = table.add("r", [[0]], remote(tp_size=remote_tp), now=0.0)
    assert entry is not None and entry.expected == expected


def test_flat_block_ids_concatenates_groups_in_order() -> None:
    table = ConsumerTable(watchdog_s=1.0)
    entry = table.add("r", [[3, 1], [], [9, 8]], remote(), now=0.0)
    assert entry is not None and entry.flat_block_ids == [3, 1, 9, 8]


# ---------------------------------------------------------------- mark_sent / completions


def test_mark_sent(table) -> None:
    entry = table.add("r", [[1]], remote(), now=0.0)
    assert not table.busy
    assert table.mark_sent("r") is True
    assert entry.state is RecvState.SENT
    assert table.busy
    assert table.mark_sent("r") is False  # only a PENDING entry can be sent
    assert entry.state is RecvState.SENT


def test_mark_sent_unknown_request(table) -> None:
    assert table.mark_sent("nope") is False
    assert table.pending == {}


def test_single_completion_finishes_a_tp1_request(table) -> None:
    entry = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    assert table.on_completion("r") == (CompletionOutcome.DONE, entry)
    assert entry.seen == 1
    assert table.pending == {}
    assert not table.busy


def test_completion_counting_until_every_p_rank_reported() -> None:
    table = ConsumerTable(watchdog_s=WATCHDOG, local_tp_size=1)
    entry = table.add("r", [[1]], remote(tp_size=4), now=0.0)
    table.mark_sent("r")
    for seen in (1, 2, 3):
        assert table.on_completion("r") == (CompletionOutcome.PARTIAL, entry)
        assert entry.seen == seen
        assert "r" in table.pending
    assert table.on_completion("r") == (CompletionOutcome.DONE, entry)
    assert entry.seen == 4
    assert "r" not in table.pending


def test_completion_after_done_is_unknown(table) -> None:
    table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.on_completion("r")
    assert table.on_completion("r") == (CompletionOutcome.UNKNOWN, None)


def test_completion_for_foreign_request_is_unknown(table) -> None:
    table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    assert table.on_completion("other") == (CompletionOutcome.UNKNOWN, None)
    assert table.pending["r"].seen == 0


def test_completion_before_registration_was_sent_is_not_counted(table) -> None:
    entry = table.add("r", [[1]], remote(), now=0.0)
    assert table.on_completion("r") == (CompletionOutcome.UNKNOWN, None)
    assert entry.seen == 0
    assert table.pending == {"r": entry}


def test_completions_of_different_requests_are_counted_apart() -> None:
    table = ConsumerTable(watchdog_s=WATCHDOG)
    a = table.add("a", [[1]], remote(tp_size=2), now=0.0)
    b = table.add("b", [[2]], remote(tp_size=2), now=0.0)
    table.mark_sent("a")
    table.mark_sent("b")
    assert table.on_completion("a")[0] is CompletionOutcome.PARTIAL
    assert table.on_completion("b")[0] is CompletionOutcome.PARTIAL
    assert (a.seen, b.seen) == (1, 1)
    assert table.on_completion("a") == (CompletionOutcome.DONE, a)
    assert set(table.pending) == {"b"}


def test_request_can_be_registered_again_after_done(table) -> None:
    table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.on_completion("r")
    again = table.add("r", [[5]], remote(), now=100.0)
    assert again is not None
    assert again.state is RecvState.PENDING and again.seen == 0
    assert again.deadline == 100.0 + WATCHDOG


# ---------------------------------------------------------------- fail / evict


@pytest.mark.parametrize("sent", [False, True])
def test_fail_removes_and_returns_entry(table, sent: bool) -> None:
    entry = table.add("r", [[1, 2]], remote(), now=0.0)
    if sent:
        table.mark_sent("r")
    assert table.fail("r") is entry
    assert table.pending == {}
    assert table.fail("r") is None
    # A completion that arrives after the failure is late and ignored.
    assert table.on_completion("r") == (CompletionOutcome.UNKNOWN, None)


def test_fail_after_partial_completion() -> None:
    t = ConsumerTable(watchdog_s=WATCHDOG)
    entry = t.add("r", [[1]], remote(tp_size=2), now=0.0)
    t.mark_sent("r")
    t.on_completion("r")
    assert t.fail("r") is entry
    assert t.on_completion("r") == (CompletionOutcome.UNKNOWN, None)


def test_evict_pending_removes_at_once(table) -> None:
    r = table.add("r", [[1]], remote(), now=0.0)
    table.add("s", [[2]], remote(), now=0.0)
    assert table.evict("r") is r
    assert r.state is RecvState.PENDING  # P never saw it: the blocks are free now
    assert table.evict("r") is None
    assert table.evict("unknown") is None
    assert set(table.pending) == {"s"}


def test_evict_sent_waits_for_p(table) -> None:
    r = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    assert table.evict("r") is r
    assert r.state is RecvState.CANCELLING
    assert "r" in table.pending  # P may still be writing into the blocks
    assert table.busy
    assert table.evict("r") is None  # already cancelling
    assert table.mark_sent("r") is False
    assert table.fail("r") is r  # P confirmed
    assert table.pending == {}


def test_completion_of_a_cancelling_registration_finishes_it(table) -> None:
    r = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.evict("r")
    assert table.on_completion("r") == (CompletionOutcome.CANCELLED, r)
    assert table.pending == {}


def test_watchdog_expires_cancelling_entries(table) -> None:
    r = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.evict("r")
    assert table.expire(WATCHDOG) == [r]


# ---------------------------------------------------------------- P lost


def test_orphan_holds_a_sent_registration_until_its_grace(table) -> None:
    r = table.add("r", [[1, 2]], remote(), now=0.0)
    table.mark_sent("r")
    assert table.orphan("r", now=10.0) is r
    assert (r.state, r.reason, r.deadline) == (RecvState.CANCELLING, PEER_LOST, 10.0 + table.cancel_grace_s)
    assert table.holder([[2]]) == (2, "r"), "a WRITE may still land: the blocks stay held"
    assert table.expire(10.0 + table.cancel_grace_s - 0.001) == []
    assert table.expire(10.0 + table.cancel_grace_s) == [r]
    assert table.pending == {} and table.holder([[1, 2]]) is None


def test_completion_of_an_orphaned_registration_is_done(table) -> None:
    # Every byte landed before (or after) P went away: the request succeeded.
    r = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.orphan("r", now=1.0)
    assert table.on_completion("r") == (CompletionOutcome.DONE, r)


def test_orphan_keeps_a_worker_cancellation_cancelled(table) -> None:
    r = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.evict("r", now=1.0)
    assert table.orphan("r", now=2.0) is r
    assert r.reason == "cancelled"
    assert table.on_completion("r") == (CompletionOutcome.CANCELLED, r)


def test_orphan_ignores_pending_and_unknown(table) -> None:
    table.add("r", [[1]], remote(), now=0.0)
    assert table.orphan("r", now=1.0) is None  # P never saw it: the handshake task decides
    assert table.orphan("nope", now=1.0) is None


def test_orphan_never_extends_a_deadline(table) -> None:
    r = table.add("r", [[1]], remote(), now=0.0)
    table.mark_sent("r")
    table.orphan("r", now=WATCHDOG - 1.0)
    assert r.deadline == WATCHDOG


# ---------------------------------------------------------------- watchdog


def test_watchdog_expires_at_exactly_the_deadline(table) -> None:
    entry = table.add("r", [[1]], remote(), now=5.0)
    assert table.next_deadline() == 5.0 + WATCHDOG
    assert table.expire(5.0 + WATCHDOG - 0.001) == []
    assert table.expire(5.0 + WATCHDOG) == [entry]
    assert table.pending == {}
    assert table.next_deadline() is None
    assert table.expire(1e9) == []


@pytest.mark.parametrize("sent", [False, True])
def test_watchdog_reports_pending_and_sent_but_keeps_sent_until_p_confirms(table, sent: bool) -> None:
    entry = table.add("r", [[1]], remote(), now=0.0)
    if sent:
        table.mark_sent("r")
    assert table.expire(WATCHDOG) == [entry]
    if sent:
        # P may be writing into the blocks: the entry waits, cancelling, for P.
        assert entry.state is RecvState.CANCELLING and entry.reason == "watchdog"
        assert table.pending == {"r": entry}
        assert entry.deadline == WATCHDOG + table.cancel_grace_s
        assert table.expire(entry.deadline) == [entry]  # P never answered: final
    assert table.pending == {}


def test_watchdog_expires_only_overdue_entries() -> None:
    table = ConsumerTable(watchdog_s=10.0)
    a = table.add("a", [[1]], remote(), now=0.0)  # 10
    b = table.add("b", [[2]], remote(tp_size=2), now=5.0)  # 15
    c = table.add("c", [[3]], remote(), now=20.0)  # 30
    table.mark_sent("b")
    table.on_completion("b")  # partial: still overdue later
    gone = table.expire(15.0)
    assert sorted(gone, key=lambda e: e.request_id) == [a, b]
    assert table.pending == {"b": b, "c": c}  # b is cancelling: P must confirm
    assert b.state is RecvState.CANCELLING
    assert table.on_completion("b") == (CompletionOutcome.CANCELLED, b)  # its last WRITE landed
    assert table.pending == {"c": c}
    assert table.next_deadline() == 30.0


# ---------------------------------------------------------------- views


def test_waiting_on_filters_by_remote_engine(table) -> None:
    a = table.add("a", [[1]], remote(engine_id="p0"), now=0.0)
    table.add("b", [[2]], remote(engine_id="p1"), now=0.0)
    c = table.add("c", [[3]], remote(engine_id="p0"), now=0.0)
    table.mark_sent("c")
    assert table.waiting_on("p0") == [a, c]
    assert [e.request_id for e in table.waiting_on("p1")] == ["b"]
    assert table.waiting_on("p2") == []


def test_next_deadline_is_earliest(table) -> None:
    assert table.next_deadline() is None
    table.add("late", [[1]], remote(), now=50.0)
    table.add("early", [[2]], remote(), now=10.0)
    assert table.next_deadline() == 10.0 + WATCHDOG
    table.evict("early")
    assert table.next_deadline() == 50.0 + WATCHDOG


def test_busy_only_while_a_registration_is_out(table) -> None:
    assert not table.busy
    table.add("a", [[1]], remote(), now=0.0)
    table.add("b", [[1]], remote(), now=0.0)
    assert not table.busy  # nothing to poll for until P knows about it
    table.mark_sent("b")
    assert table.busy
    table.fail("b")
    assert not table.busy


def test_sizes_and_repr(table) -> None:
    assert table.sizes() == {"d_pending": 0}
    table.add("a", [[1]], remote(), now=0.0)
    table.add("b", [[1]], remote(), now=0.0)
    assert table.sizes() == {"d_pending": 2}
    assert repr(table) == "<ConsumerTable pending=2>"


# ---------------------------------------------------------------- property: counting


@settings(max_examples=200, deadline=None)
@given(
    remote_tp=st.sampled_from([1, 2, 4, 8, 16]),
    local_tp=st.sampled_from([1, 2, 4, 8]),
    extra=st.integers(0, 3),
)
def test_done_exactly_once_after_expected_completions(remote_tp: int, local_tp: int, extra: int) -> None:
    table = ConsumerTable(watchdog_s=1.0, local_tp_size=local_tp)
    entry = table.add("r", [[0]], remote(tp_size=remote_tp), now=0.0)
    assert entry is not None
    table.mark_sent("r")
    outcomes = [table.on_completion("r")[0] for _ in range(entry.expected + extra)]
    assert outcomes.count(CompletionOutcome.DONE) == 1
    assert outcomes.index(CompletionOutcome.DONE) == entry.expected - 1
    assert outcomes[: entry.expected - 1] == [CompletionOutcome.PARTIAL] * (entry.expected - 1)
    assert outcomes[entry.expected :] == [CompletionOutcome.UNKNOWN] * extra
    assert entry.expected == max(1, remote_tp // local_tp)


# ---------------------------------------------------------------- block holders


def test_holder_names_the_live_registration_that_holds_a_block(table) -> None:
    table.add("a", [[1, 2], [7]], remote(), now=0.0)
    assert table.tracks("a") and not table.tracks("b")
    assert table.holder([[3, 2]]) == (2, "a")
    assert table.holder([[], [7]]) == (7, "a")
    assert table.holder([[7]]) is None  # block 7 of group 0 is not group 1's block 7
    assert table.holder([[3, 4]]) is None


@pytest.mark.parametrize("ending", ["done", "fail", "evict_pending", "expire_pending"])
def test_a_final_registration_releases_its_blocks(table, ending: str) -> None:
    table.add("a", [[1, 2]], remote(), now=0.0)
    if ending == "done":
        table.mark_sent("a")
        table.on_completion("a")
    elif ending == "fail":
        table.fail("a")
    elif ending == "evict_pending":
        table.evict("a")
    else:
        table.expire(WATCHDOG + 1)
    assert table.holder([[1, 2]]) is None and not table.tracks("a")


def test_a_cancelling_registration_keeps_its_blocks_until_final(table) -> None:
    # P may still write into them: a new registration naming them must be refused.
    table.add("a", [[1, 2]], remote(), now=0.0)
    table.mark_sent("a")
    table.evict("a", now=1.0)
    assert table.holder([[2]]) == (2, "a")
    table.expire(1.0 + table.cancel_grace_s / 2)  # P still has time to confirm
    assert table.holder([[2]]) == (2, "a")
    assert table.on_completion("a")[0] is CompletionOutcome.CANCELLED
    assert table.holder([[2]]) is None


def test_a_duplicate_add_does_not_take_over_blocks(table) -> None:
    table.add("a", [[1]], remote(), now=0.0)
    assert table.add("a", [[5]], remote(), now=0.0) is None
    assert table.holder([[5]]) is None
    table.fail("a")
    assert table.holder([[1]]) is None
