"""ConsumerTable withdrawals: the worker's evict, the watchdog, P lost, back and gone, and
the final reasons. No path hands blocks back while a WRITE of P's may still land."""

from __future__ import annotations

import pytest

from pushsvc.state.consumer import (
    CANCELLED,
    PEER_LOST,
    WATCHDOG,
    CompletionOutcome,
    ConsumerTable,
    EvictOutcome,
    ExpiryAction,
    RecvExpiry,
    RecvState,
)

WATCHDOG_S = 60.0
GRACE = 5.0
P_DAEMON, P_AGENT = "p-daemon-0", "p-agent-0"  # where ``sent_recv`` delivers
LIVE = frozenset({P_DAEMON})
NOBODY: frozenset[str] = frozenset()
BOTH_MODES = pytest.mark.parametrize("consumer", [False, True], indirect=True, ids=["plain", "verify"])
VERIFYING = pytest.mark.parametrize("consumer", [True], indirect=True, ids=["verify"])

NO_PUSH = "watchdog: no push within 60.0s"
LOST = "peer_lost: P daemon prefill-0 went away; no WRITE landed within 5.0s"
RESTARTED = "peer_lost: P daemon prefill-0 restarted"
DROPPED = "peer_lost: the session to P daemon prefill-0 was lost and P dropped the registration"


# ---------------------------------------------------------------- evict


def test_evict_of_a_pending_registration_is_final(consumer, p_remote) -> None:
    r = consumer.add("r", [[1]], p_remote(), now=0.0)
    consumer.add("s", [[2]], p_remote(), now=0.0)
    assert consumer.evict("r", now=1.0, peer_alive=True) == (EvictOutcome.FINAL, r)
    assert r is not None and r.state is RecvState.PENDING  # P never saw it: the blocks are free now
    assert consumer.holder([[1]]) is None
    assert consumer.evict("r", now=1.0, peer_alive=True) == (EvictOutcome.NONE, None)
    assert consumer.evict("unknown", now=1.0, peer_alive=False) == (EvictOutcome.NONE, None)
    assert set(consumer.pending) == {"s"}


def test_evict_of_a_sent_registration_asks_a_live_p_and_waits_without_deadline(consumer, sent_recv) -> None:
    r = sent_recv("r", [[1]])
    assert consumer.evict("r", now=1.0, peer_alive=True) == (EvictOutcome.CANCEL, r)
    assert (r.state, r.reason, r.deadline, r.held) == (RecvState.CANCELLING, CANCELLED, None, False)
    assert "r" in consumer.pending and consumer.holder([[1]]) == (1, "r")  # P may be writing into them
    assert consumer.busy and consumer.unsettled
    assert consumer.evict("r", now=2.0, peer_alive=True) == (EvictOutcome.NONE, None)  # already cancelling
    assert consumer.mark_sent("r", P_DAEMON, {P_AGENT: 0}) is False
    assert consumer.fail("r") is r  # P confirmed
    assert consumer.final_reason(r) == "cancelled"
    assert consumer.pending == {}


@pytest.mark.parametrize("live", [LIVE, NOBODY])
def test_a_cancelling_registration_without_deadline_never_expires(consumer, sent_recv, live) -> None:
    """However long P's WRITE takes, the blocks wait for P's answer while its session lives."""
    r = sent_recv("r", [[1]])
    consumer.evict("r", now=1.0, peer_alive=True)
    assert consumer.expire(1e12, live) == []
    assert consumer.pending == {"r": r} and consumer.holder([[1]]) == (1, "r")
    assert consumer.on_completion("r", P_AGENT, now=1e12) == (CompletionOutcome.CANCELLED, r)
    assert consumer.final_reason(r) == "cancelled"
    assert consumer.pending == {} and consumer.holder([[1]]) is None


def test_evict_of_a_sent_registration_holds_it_for_the_grace_when_p_is_unreachable(consumer, sent_recv) -> None:
    r = sent_recv("r", [[1]])
    assert consumer.evict("r", now=10.0, peer_alive=False) == (EvictOutcome.HELD, r)
    assert (r.state, r.reason, r.deadline, r.held) == (RecvState.CANCELLING, CANCELLED, 10.0 + GRACE, True)
    assert consumer.expire(10.0 + GRACE - 0.001, NOBODY) == []
    assert consumer.holder([[1]]) == (1, "r")
    assert consumer.expire(10.0 + GRACE, NOBODY) == [
        RecvExpiry(r, ExpiryAction.FAIL, "cancel_unconfirmed", "cancelled: P did not confirm")]
    assert consumer.pending == {} and consumer.holder([[1]]) is None


@BOTH_MODES
@pytest.mark.parametrize("peer_alive", [True, False])
def test_the_last_write_of_a_withdrawn_registration_ends_it_cancelled(consumer, sent_recv, peer_alive: bool) -> None:
    r = sent_recv("r", tp_size=2)
    consumer.evict("r", now=1.0, peer_alive=peer_alive)
    assert consumer.on_completion("r", P_AGENT, now=2.0) == (CompletionOutcome.PARTIAL, r)
    assert consumer.on_completion("r", "p-agent-2", now=2.0) == (CompletionOutcome.UNKNOWN, None)
    assert consumer.on_completion("r", P_AGENT, now=2.0) == (CompletionOutcome.UNKNOWN, None)
    assert consumer.on_completion("r", "p-agent-1", now=2.0) == (CompletionOutcome.CANCELLED, r)
    assert consumer.pending == {}
    # The WRITE's completion settled it: the grace did not run out, P answered.
    assert consumer.final_reason(r, settled=True) == "cancelled"


# ---------------------------------------------------------------- watchdog


def test_watchdog_fails_a_pending_registration_at_exactly_the_deadline(consumer, p_remote) -> None:
    entry = consumer.add("r", [[1]], p_remote(), now=5.0)
    assert consumer.expire(5.0 + WATCHDOG_S - 0.001, LIVE) == []
    assert consumer.expire(5.0 + WATCHDOG_S, LIVE) == [RecvExpiry(entry, ExpiryAction.FAIL, WATCHDOG, NO_PUSH)]
    assert consumer.pending == {}
    assert consumer.expire(1e9, LIVE) == []


def test_watchdog_on_a_sent_registration_asks_a_live_p_first(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    assert consumer.expire(WATCHDOG_S, LIVE) == [RecvExpiry(entry, ExpiryAction.CANCEL)]
    # P may be writing into the blocks: the entry waits, cancelling, for P.
    assert (entry.state, entry.reason, entry.deadline) == (RecvState.CANCELLING, WATCHDOG, None)
    assert consumer.pending == {"r": entry}
    assert consumer.expire(1e12, LIVE) == []
    assert consumer.on_completion("r", P_AGENT, now=1e12) == (CompletionOutcome.CANCELLED, entry)
    assert consumer.final_reason(entry) == NO_PUSH


def test_watchdog_on_a_sent_registration_holds_it_when_p_is_unreachable(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    assert consumer.expire(WATCHDOG_S, NOBODY) == [RecvExpiry(entry, ExpiryAction.HOLD)]
    assert (entry.state, entry.reason, entry.deadline) == (RecvState.CANCELLING, WATCHDOG, WATCHDOG_S + GRACE)
    assert consumer.expire(WATCHDOG_S + GRACE - 0.001, NOBODY) == []
    assert consumer.expire(WATCHDOG_S + GRACE, NOBODY) == [  # P never answered: final
        RecvExpiry(entry, ExpiryAction.FAIL, "cancel_unconfirmed", f"{NO_PUSH}: P did not confirm")]
    assert consumer.pending == {}


def test_watchdog_asks_only_about_a_live_p(consumer, sent_recv) -> None:
    a = sent_recv("a", [[1]])
    b = sent_recv("b", [[2]], p_daemon="p-daemon-1", p_agent="p-agent-1")
    got = consumer.expire(WATCHDOG_S, LIVE)
    assert {e.entry.request_id: e.action for e in got} == {"a": ExpiryAction.CANCEL, "b": ExpiryAction.HOLD}
    assert (a.deadline, b.deadline) == (None, WATCHDOG_S + GRACE)


def test_watchdog_expires_only_overdue_entries(p_remote) -> None:
    table = ConsumerTable(watchdog_s=10.0)
    a = table.add("a", [[1]], p_remote(), now=0.0)  # 10
    b = table.add("b", [[2]], p_remote(tp_size=2), now=5.0)  # 15
    c = table.add("c", [[3]], p_remote(), now=20.0)  # 30
    table.mark_sent("b", P_DAEMON, {P_AGENT: 0, "p-agent-1": 1})
    table.on_completion("b", P_AGENT, now=6.0)  # partial: still overdue later
    gone = table.expire(15.0, LIVE)
    assert [(e.entry, e.action) for e in gone] == [(a, ExpiryAction.FAIL), (b, ExpiryAction.CANCEL)]
    assert table.pending == {"b": b, "c": c}  # b is cancelling: P must confirm
    assert b is not None and b.state is RecvState.CANCELLING
    assert table.on_completion("b", "p-agent-1", now=16.0) == (CompletionOutcome.CANCELLED, b)  # its last WRITE landed
    assert table.pending == {"c": c}
    assert c is not None and c.deadline == 30.0


# ---------------------------------------------------------------- P lost


def test_peer_lost_holds_a_sent_registration_until_its_grace(consumer, sent_recv) -> None:
    r = sent_recv("r", [[1, 2]])
    assert consumer.peer_lost(P_DAEMON, now=10.0) == [r]
    assert (r.state, r.reason, r.deadline, r.held) == (RecvState.CANCELLING, PEER_LOST, 10.0 + GRACE, True)
    assert consumer.holder([[2]]) == (2, "r"), "a WRITE may still land: the blocks stay held"
    assert consumer.unsettled
    assert consumer.expire(10.0 + GRACE - 0.001, NOBODY) == []
    assert consumer.expire(10.0 + GRACE, NOBODY) == [RecvExpiry(r, ExpiryAction.FAIL, PEER_LOST, LOST)]
    assert consumer.pending == {} and consumer.holder([[1, 2]]) is None


def test_peer_lost_names_a_p_incarnation_not_an_engine(consumer, sent_recv) -> None:
    a = sent_recv("a", [[1]])
    b = sent_recv("b", [[2]], p_daemon="p-daemon-1", p_agent="p-agent-1")  # same engine, prefill-0
    assert consumer.peer_lost("prefill-0", now=1.0) == []
    assert consumer.peer_lost("p-daemon-1", now=1.0) == [b]
    assert (a.state, b.state) == (RecvState.SENT, RecvState.CANCELLING)


@BOTH_MODES
def test_a_write_that_lands_for_a_lost_p_still_succeeds(consumer, sent_recv) -> None:
    # Every byte landed before (or after) P went away: the request succeeded.
    r = sent_recv("r")
    consumer.peer_lost(P_DAEMON, now=1.0)
    outcome = consumer.on_completion("r", P_AGENT, now=2.0)
    assert outcome == ((CompletionOutcome.AWAIT_DIGESTS if consumer.verify else CompletionOutcome.DONE), r)
    if consumer.verify:
        assert (r.state, r.deadline) == (RecvState.LANDED, 2.0 + consumer.digest_wait_s)
    else:
        assert consumer.pending == {}


@BOTH_MODES
def test_a_held_registration_the_worker_withdraws_is_no_longer_made_done(consumer, sent_recv) -> None:
    """Held for a lost P, then evicted by the worker: its grace keeps running, and a
    WRITE that still lands ends it cancelled (the worker gave the request up)."""
    r = sent_recv("r", [[1]], tp_size=2)
    consumer.peer_lost(P_DAEMON, now=1.0)
    assert consumer.evict("r", now=2.0, peer_alive=False) == (EvictOutcome.HELD, r)
    assert (r.state, r.reason, r.deadline, r.held) == (RecvState.CANCELLING, CANCELLED, 1.0 + GRACE, True)
    assert consumer.holder([[1]]) == (1, "r")
    assert consumer.evict("r", now=2.5, peer_alive=False) == (EvictOutcome.NONE, None)  # withdrawn already
    assert consumer.on_completion("r", P_AGENT, now=3.0) == (CompletionOutcome.PARTIAL, r)
    assert consumer.on_completion("r", "p-agent-1", now=3.0) == (CompletionOutcome.CANCELLED, r)
    assert consumer.final_reason(r, settled=True) == "cancelled"
    assert consumer.pending == {} and consumer.holder([[1]]) is None


def test_a_held_registration_the_worker_withdraws_fails_when_the_grace_ends(consumer, sent_recv) -> None:
    r = sent_recv("r")
    consumer.peer_lost(P_DAEMON, now=1.0)
    consumer.evict("r", now=2.0, peer_alive=False)
    assert consumer.expire(1.0 + GRACE - 0.001, NOBODY) == []
    assert consumer.expire(1.0 + GRACE, NOBODY) == [
        RecvExpiry(r, ExpiryAction.FAIL, "cancel_unconfirmed", "cancelled: P did not confirm")]


def test_peer_lost_keeps_a_worker_cancellation_cancelled(consumer, sent_recv) -> None:
    r = sent_recv("r")
    consumer.evict("r", now=1.0, peer_alive=True)
    assert consumer.peer_lost(P_DAEMON, now=2.0) == [r]
    assert (r.reason, r.deadline) == (CANCELLED, 2.0 + GRACE)  # the wait for P's answer gets a timer
    assert consumer.on_completion("r", P_AGENT, now=3.0) == (CompletionOutcome.CANCELLED, r)


def test_a_cancellation_p_never_confirmed_fails_after_the_grace(consumer, sent_recv) -> None:
    r = sent_recv("r")
    consumer.evict("r", now=1.0, peer_alive=True)
    consumer.peer_lost(P_DAEMON, now=2.0)
    assert consumer.expire(2.0 + GRACE, NOBODY) == [
        RecvExpiry(r, ExpiryAction.FAIL, "cancel_unconfirmed", "cancelled: P did not confirm")]


@VERIFYING
def test_peer_lost_ignores_pending_landed_and_unknown_registrations(consumer, p_remote, sent_recv) -> None:
    consumer.add("pending", [[1]], p_remote(), now=0.0)
    landed = sent_recv("landed", [[2]])
    consumer.on_completion("landed", P_AGENT, now=1.0)
    assert consumer.peer_lost(P_DAEMON, now=2.0) == []  # P never saw one, wrote all of the other
    assert consumer.peer_lost("", now=2.0) == []
    assert consumer.pending["pending"].state is RecvState.PENDING
    assert (landed.state, landed.deadline) == (RecvState.LANDED, 1.0 + consumer.digest_wait_s)


def test_peer_lost_gives_a_sent_registration_the_full_grace(consumer, sent_recv) -> None:
    """A WRITE P posted just before its watchdog fired may still land: the grace runs in
    full, whatever the watchdog said."""
    r = sent_recv("r")
    assert consumer.peer_lost(P_DAEMON, now=WATCHDOG_S - 1.0) == [r]
    assert r.deadline == WATCHDOG_S - 1.0 + GRACE
    assert consumer.expire(WATCHDOG_S, NOBODY) == []  # the watchdog no longer applies
    assert consumer.expire(WATCHDOG_S - 1.0 + GRACE, NOBODY) == [RecvExpiry(r, ExpiryAction.FAIL, PEER_LOST, LOST)]


def test_peer_lost_keeps_the_deadline_of_a_held_registration(consumer, sent_recv) -> None:
    held = sent_recv("held", [[2]])
    consumer.evict("held", now=0.0, peer_alive=False)
    lost = sent_recv("lost", [[3]])
    consumer.peer_lost(P_DAEMON, now=1.0)
    assert consumer.peer_lost(P_DAEMON, now=3.0) == [held, lost]  # held already: their graces run on
    assert (held.deadline, lost.deadline) == (GRACE, 1.0 + GRACE)
    assert (held.reason, lost.reason) == (CANCELLED, PEER_LOST)


# ---------------------------------------------------------------- P back


def test_peer_back_waits_for_p_instead_of_the_grace(consumer, sent_recv) -> None:
    r = sent_recv("r", [[1]])
    consumer.peer_lost(P_DAEMON, now=1.0)
    assert consumer.peer_back(P_DAEMON) == [r]
    assert (r.state, r.reason, r.deadline, r.held) == (RecvState.CANCELLING, PEER_LOST, None, False)
    assert consumer.expire(1e12, LIVE) == []
    assert consumer.holder([[1]]) == (1, "r")
    assert consumer.fail("r") is r  # P confirmed the cancel the caller sent
    assert consumer.final_reason(r) == DROPPED


def test_peer_back_touches_only_held_registrations_of_that_incarnation(consumer, sent_recv) -> None:
    held = sent_recv("held", [[1]])
    other = sent_recv("other", [[2]], p_daemon="p-daemon-1", p_agent="p-agent-1")
    consumer.peer_lost(P_DAEMON, now=1.0)
    consumer.peer_lost("p-daemon-1", now=1.0)
    waiting = sent_recv("waiting", [[3]])
    consumer.evict("waiting", now=1.0, peer_alive=True)  # no deadline: not held
    sent = sent_recv("sent", [[4]], now=1.0)
    assert consumer.peer_back(P_DAEMON) == [held]
    assert (held.deadline, other.deadline, waiting.deadline, sent.deadline) == (None, 1.0 + GRACE, None,
                                                                                1.0 + WATCHDOG_S)
    assert consumer.peer_back(P_DAEMON) == []


def test_a_p_lost_again_after_coming_back_restarts_the_grace(consumer, sent_recv) -> None:
    r = sent_recv("r")
    consumer.peer_lost(P_DAEMON, now=1.0)
    consumer.peer_back(P_DAEMON)
    assert consumer.peer_lost(P_DAEMON, now=100.0) == [r]
    assert r.deadline == 100.0 + GRACE
    assert consumer.expire(100.0 + GRACE, NOBODY)[0].reason == LOST


# ---------------------------------------------------------------- P gone


def test_peer_gone_ends_every_registration_sent_to_that_incarnation(consumer, p_remote, sent_recv) -> None:
    sent_recv("sent", [[1]])
    sent_recv("cancelling", [[2]])
    consumer.evict("cancelling", now=1.0, peer_alive=True)
    sent_recv("watchdog", [[3]], now=-WATCHDOG_S)
    consumer.expire(0.0, LIVE)
    sent_recv("lost", [[4]], p_daemon="p-daemon-1", p_agent="p-agent-1")
    consumer.peer_lost("p-daemon-1", now=1.0)
    pending = consumer.add("pending", [[5]], p_remote(), now=0.0)
    other = sent_recv("other", [[6]], p_daemon="p-daemon-2", p_agent="p-agent-2")

    gone = consumer.peer_gone(P_DAEMON) + consumer.peer_gone("p-daemon-1")

    assert all(e.action is ExpiryAction.FAIL for e in gone)
    assert {e.entry.request_id: (e.kind, e.reason) for e in gone} == {
        "sent": (PEER_LOST, RESTARTED),
        "cancelling": ("cancel_unconfirmed", "cancelled: P daemon prefill-0 restarted"),
        "watchdog": ("cancel_unconfirmed", f"{NO_PUSH}: P daemon prefill-0 restarted"),
        "lost": (PEER_LOST, RESTARTED),
    }
    assert len(gone) == 4
    assert consumer.pending == {"pending": pending, "other": other}
    assert consumer.holder([[1, 2, 3, 4]]) is None
    assert consumer.peer_gone(P_DAEMON) == []


@VERIFYING
def test_peer_gone_fails_what_waited_for_its_digests(consumer, sent_recv) -> None:
    landed = sent_recv("landed", [[1]])
    consumer.on_completion("landed", P_AGENT, now=1.0)
    other = sent_recv("other", [[2]], p_daemon="p-daemon-1", p_agent="p-agent-1")
    consumer.on_completion("other", "p-agent-1", now=1.0)
    reason = "verify: P daemon prefill-0 restarted before its digests arrived"
    assert consumer.peer_gone(P_DAEMON) == [RecvExpiry(landed, ExpiryAction.FAIL, "verify", reason)]
    assert consumer.pending == {"other": other} and consumer.holder([[1]]) is None
    assert other.state is RecvState.LANDED


# ---------------------------------------------------------------- final reasons


@pytest.mark.parametrize(
    ("reason", "deadline", "gone", "settled", "text"),
    [
        (PEER_LOST, 9.0, False, False, LOST),
        (PEER_LOST, None, False, False, DROPPED),
        (PEER_LOST, None, False, True, DROPPED),
        (PEER_LOST, 9.0, True, False, RESTARTED),
        (PEER_LOST, None, True, False, RESTARTED),
        (WATCHDOG, None, False, False, NO_PUSH),
        (WATCHDOG, 9.0, False, False, f"{NO_PUSH}: P did not confirm"),
        (WATCHDOG, 9.0, False, True, NO_PUSH),  # P (or its WRITE) answered before the grace ran out
        (WATCHDOG, None, True, False, f"{NO_PUSH}: P daemon prefill-0 restarted"),
        (CANCELLED, None, False, False, "cancelled"),
        (CANCELLED, None, False, True, "cancelled"),
        (CANCELLED, 9.0, False, False, "cancelled: P did not confirm"),
        (CANCELLED, 9.0, False, True, "cancelled"),
        (CANCELLED, 9.0, True, False, "cancelled: P daemon prefill-0 restarted"),
        (CANCELLED, 9.0, True, True, "cancelled: P daemon prefill-0 restarted"),
    ],
)
def test_final_reason(consumer, sent_recv, reason: str, deadline: float | None, gone: bool, settled: bool,
                      text: str) -> None:
    entry = sent_recv("r")
    entry.state, entry.reason, entry.deadline = RecvState.CANCELLING, reason, deadline
    assert consumer.final_reason(entry, gone=gone, settled=settled) == text
    if not settled:
        assert consumer.final_reason(entry, gone=gone) == text  # settled defaults to False
