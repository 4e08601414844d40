"""Request timelines, the pure part (state/timeline.py): marking, closing, bounds."""

from __future__ import annotations

from pushsvc.state.timeline import RECV, SEND, Timeline, TimelineBook


def _opened(book: TimelineBook, key: tuple, rid: str, t: float, side: str = SEND) -> Timeline:
    timeline = book.open(key, Timeline(rid, side, 0))
    timeline.mark("first", t)
    return timeline


def test_steps_are_the_time_from_each_event_to_the_next_and_a_repeat_keeps_its_first_time() -> None:
    t = Timeline("r", RECV, 1)
    for name, at in (("registered", 10.0), ("push_reg_sent", 10.5), ("completion", 12.0), ("completion", 13.0),
                     ("recv_done", 12.25)):
        t.mark(name, at)
    assert [name for name, _ in t.events] == ["registered", "push_reg_sent", "completion", "recv_done"]
    assert list(t.steps()) == [("push_reg_sent", 0.5), ("completion", 1.5), ("recv_done", 0.25)]
    assert t.total == 2.25


def test_a_clock_that_steps_back_gives_zero_not_a_negative_duration() -> None:
    t = Timeline("r", SEND, 0)
    t.mark("a", 5.0)
    t.mark("b", 4.0)
    assert list(t.steps()) == [("b", 0.0)] and t.total == 0.0


def test_close_ends_the_open_timeline_once_and_keeps_the_recent_ones_newest_first() -> None:
    book = TimelineBook(keep=2)
    for i in range(3):
        _opened(book, ("rank", SEND, f"r{i}"), f"r{i}", float(i))
    assert book.open_count == 3
    first = book.close(("rank", SEND, "r0"), "send_done", 0.5)
    assert first is not None and first.outcome == "send_done" and first.events[-1] == ("send_done", 0.5)
    assert book.close(("rank", SEND, "r0"), "send_failed", 0.6) is None  # closed already: nothing to end
    assert book.close(("rank", SEND, "nope"), "send_done", 0.6) is None  # never opened
    book.close(("rank", SEND, "r1"), "send_done", 1.5)
    book.close(("rank", SEND, "r2"), "send_failed", 2.5)
    assert [t.request_id for t in book.recent(10)] == ["r2", "r1"]  # keep=2: r0 fell out
    assert [t.request_id for t in book.recent(1)] == ["r2"]
    assert book.open_count == 0


def test_recent_filters_by_either_sides_request_id() -> None:
    book = TimelineBook(keep=10)
    p = _opened(book, ("p", SEND, "p-1"), "p-1", 0.0)
    p.peer_request_id = "d-1"
    _opened(book, ("d", RECV, "d-1"), "d-1", 0.0, RECV)
    _opened(book, ("d", RECV, "d-2"), "d-2", 0.0, RECV)
    for key, outcome in ((("p", SEND, "p-1"), "send_done"), (("d", RECV, "d-1"), "recv_done"),
                         (("d", RECV, "d-2"), "recv_done")):
        book.close(key, outcome, 1.0)
    assert [(t.request_id, t.side) for t in book.recent(10, "d-1")] == [("d-1", RECV), ("p-1", SEND)]
    assert [t.request_id for t in book.recent(10, "p-1")] == ["p-1"]


def test_keep_zero_keeps_nothing_but_still_closes() -> None:
    book = TimelineBook(keep=0)
    _opened(book, ("r", SEND, "a"), "a", 0.0)
    assert book.close(("r", SEND, "a"), "send_done", 1.0) is not None
    assert book.recent(10) == [] and book.open_count == 0


def test_open_timelines_are_bounded_the_oldest_going_first() -> None:
    book = TimelineBook(keep=5, max_open=3)
    for i in range(5):
        _opened(book, ("r", SEND, f"r{i}"), f"r{i}", float(i))
    assert book.open_count == 3 and book.dropped == 2
    assert book.get(("r", SEND, "r0")) is None and book.get(("r", SEND, "r4")) is not None


def test_a_rank_that_goes_away_drops_only_its_open_timelines() -> None:
    book = TimelineBook(keep=5)
    gone, other = object(), object()
    _opened(book, (gone, SEND, "a"), "a", 0.0)
    _opened(book, (gone, RECV, "b"), "b", 0.0, RECV)
    _opened(book, (other, SEND, "a"), "a", 0.0)
    assert book.drop(gone) == 2
    assert book.open_count == 1 and book.get((other, SEND, "a")) is not None


def test_reopening_a_key_replaces_the_open_timeline() -> None:
    book = TimelineBook(keep=5)
    _opened(book, ("r", SEND, "a"), "a", 0.0)
    _opened(book, ("r", SEND, "a"), "a", 7.0)
    closed = book.close(("r", SEND, "a"), "send_done", 8.0)
    assert closed is not None and closed.started == 7.0 and book.open_count == 0


def test_closed_finds_the_newest_recent_timeline_of_a_request_until_it_falls_out() -> None:
    book = TimelineBook(keep=2)
    for i, rid in enumerate(("a", "b", "a")):  # "a" twice: a reused id, the newer one wins
        _opened(book, ("rank", RECV, rid), rid, float(i), side=RECV)
        book.close(("rank", RECV, rid), "recv_done", i + 0.5)
    newest = book.closed(0, RECV, "a")
    assert newest is not None and newest.started == 2.0
    assert book.closed(0, RECV, "b") is not None
    assert book.closed(0, SEND, "a") is None and book.closed(1, RECV, "a") is None
    _opened(book, ("rank", RECV, "c"), "c", 3.0, side=RECV)
    assert book.closed(0, RECV, "c") is None, "still open"
    book.close(("rank", RECV, "c"), "recv_done", 3.5)
    assert book.closed(0, RECV, "b") is None, "fell out of the recent ones"
    assert book.closed(0, RECV, "a") is newest and book.closed(0, RECV, "c") is not None
    nothing_kept = TimelineBook(keep=0)
    _opened(nothing_kept, ("rank", RECV, "x"), "x", 0.0, side=RECV)
    nothing_kept.close(("rank", RECV, "x"), "recv_done", 1.0)
    assert nothing_kept.closed(0, RECV, "x") is None
