"""ConsumerTable: D-side registrations, delivery to P, completion counting (only from the
agent the PUSH_REG went to), the verify flow, block holders and the views."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.state.consumer import (
    CANCELLED,
    CompletionOutcome,
    ConsumerTable,
    EvictOutcome,
    ExpiryAction,
    PendingRecv,
    RecvExpiry,
    RecvState,
    Remote,
)

WATCHDOG = 60.0
DIGEST_WAIT = 5.0
P_DAEMON, P_AGENT = "p-daemon-0", "p-agent-0"  # where ``sent_recv`` delivers
LIVE = frozenset({P_DAEMON})
VERIFYING = pytest.mark.parametrize("consumer", [True], indirect=True, ids=["verify"])  # a table in verify mode


# ---------------------------------------------------------------- add


def test_add_tracks_a_pending_registration(consumer, p_remote) -> None:
    r = p_remote()
    entry = consumer.add("req-1", [[1, 2], [7]], r, now=10.0, match_key="k1")
    assert isinstance(entry, PendingRecv)
    assert (entry.request_id, entry.block_ids, entry.remote, entry.match_key) == ("req-1", [[1, 2], [7]], r, "k1")
    assert entry.remote is r
    assert (entry.registered_at, entry.deadline) == (10.0, 10.0 + WATCHDOG)
    assert (entry.seen, entry.state) == (0, RecvState.PENDING)
    assert (entry.p_daemon, entry.sources, entry.open, entry.reason) == ("", {}, set(), CANCELLED)
    assert (entry.announced_at, entry.digests, entry.held) == (None, {}, False)
    assert consumer.pending == {"req-1": entry}
    assert consumer.sizes() == {"d_pending": 1}
    assert consumer.add("req-2", [[3]], r, now=10.0).match_key == ""


def test_add_is_idempotent(consumer, p_remote) -> None:
    first = consumer.add("req-1", [[1]], p_remote(), now=0.0)
    assert consumer.add("req-1", [[2]], p_remote(tp_size=4), now=5.0, match_key="k1") is None
    assert consumer.pending == {"req-1": first}
    assert first is not None and first.block_ids == [[1]]
    assert first.deadline == WATCHDOG  # not re-armed
    assert first.match_key == ""


def test_flat_block_ids_concatenates_groups_in_order(consumer, p_remote) -> None:
    entry = consumer.add("r", [[3, 1], [], [9, 8]], p_remote(), now=0.0)
    assert entry is not None and entry.flat_block_ids == [3, 1, 9, 8]


# ---------------------------------------------------------------- delivery to P


def test_mark_sent_records_the_p_incarnation_and_its_agent(consumer, p_remote) -> None:
    entry = consumer.add("r", [[1]], p_remote(), now=0.0)
    assert not consumer.busy and not consumer.unsettled
    assert consumer.mark_sent("r", P_DAEMON, {P_AGENT: 0}) is True
    assert (entry.state, entry.p_daemon, entry.sources, entry.open) == (RecvState.SENT, P_DAEMON, {P_AGENT: 0}, {P_AGENT})
    assert consumer.busy and consumer.unsettled
    assert consumer.mark_sent("r", "p-daemon-1", {"p-agent-1": 0}) is False  # only a PENDING entry can be sent
    assert (entry.state, entry.p_daemon, entry.sources) == (RecvState.SENT, P_DAEMON, {P_AGENT: 0})


def test_mark_sent_unknown_request(consumer) -> None:
    assert consumer.mark_sent("nope", P_DAEMON, {P_AGENT: 0}) is False
    assert consumer.pending == {}


def test_sent_by_names_an_entry_only_for_the_p_incarnation_it_went_to(consumer, p_remote, sent_recv) -> None:
    consumer.add("pending", [[1]], p_remote(), now=0.0)
    entry = sent_recv("sent", [[2]])
    assert consumer.sent_by("sent", P_DAEMON) is entry
    assert consumer.sent_by("sent", "p-daemon-1") is None
    assert consumer.sent_by("pending", "") is None  # not sent: no P incarnation may speak for it
    assert consumer.sent_by("unknown", P_DAEMON) is None


# ---------------------------------------------------------------- completions


def test_single_completion_finishes_a_tp1_request(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.DONE, entry)
    assert entry.seen == 1
    assert consumer.pending == {}
    assert not consumer.busy and not consumer.unsettled


def test_completion_counting_until_every_p_rank_reported(consumer, sent_recv) -> None:
    entry = sent_recv("r", tp_size=4)
    for seen in (1, 2, 3):
        agent = f"p-agent-{seen - 1}"
        assert consumer.on_completion("r", agent, now=1.0) == (CompletionOutcome.PARTIAL, entry)
        assert entry.seen == seen
        # A second completion from a source that landed counts for nothing.
        assert consumer.on_completion("r", agent, now=1.0) == (CompletionOutcome.UNKNOWN, None)
        assert "r" in consumer.pending
    assert entry.open == {"p-agent-3"}
    assert consumer.on_completion("r", "p-agent-3", now=1.0) == (CompletionOutcome.DONE, entry)
    assert entry.seen == 4
    assert "r" not in consumer.pending


def test_completion_after_done_is_unknown(consumer, sent_recv) -> None:
    sent_recv("r")
    consumer.on_completion("r", P_AGENT, now=1.0)
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.UNKNOWN, None)


def test_completion_for_another_request_is_unknown(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    assert consumer.on_completion("other", P_AGENT, now=1.0) == (CompletionOutcome.UNKNOWN, None)
    assert entry.seen == 0


@pytest.mark.parametrize("sender", ["p-agent-2", "", "intruder"])
def test_completion_from_another_agent_than_the_push_regs_is_not_counted(consumer, sent_recv, sender: str) -> None:
    entry = sent_recv("r", tp_size=2)
    assert consumer.on_completion("r", sender, now=1.0) == (CompletionOutcome.UNKNOWN, None)
    assert entry.seen == 0
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.PARTIAL, entry)
    assert consumer.on_completion("r", sender, now=1.0) == (CompletionOutcome.UNKNOWN, None)
    assert consumer.on_completion("r", "p-agent-1", now=1.0) == (CompletionOutcome.DONE, entry)


def test_completion_before_registration_was_sent_is_not_counted(consumer, p_remote) -> None:
    entry = consumer.add("r", [[1]], p_remote(), now=0.0)
    assert consumer.on_completion("r", "", now=1.0) == (CompletionOutcome.UNKNOWN, None)
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.UNKNOWN, None)
    assert entry is not None and entry.seen == 0
    assert consumer.pending == {"r": entry}


def test_completions_of_different_requests_are_counted_apart(consumer, sent_recv) -> None:
    a = sent_recv("a", [[1]], tp_size=2)
    b = sent_recv("b", [[2]], tp_size=2)
    assert consumer.on_completion("a", P_AGENT, now=1.0)[0] is CompletionOutcome.PARTIAL
    assert consumer.on_completion("b", P_AGENT, now=1.0)[0] is CompletionOutcome.PARTIAL
    assert (a.seen, b.seen) == (1, 1)
    assert consumer.on_completion("a", "p-agent-1", now=1.0) == (CompletionOutcome.DONE, a)
    assert set(consumer.pending) == {"b"}


def test_request_can_be_registered_again_after_done(consumer, p_remote, sent_recv) -> None:
    sent_recv("r")
    consumer.on_completion("r", P_AGENT, now=1.0)
    again = consumer.add("r", [[5]], p_remote(), now=100.0)
    assert again is not None
    assert (again.state, again.seen, again.sources) == (RecvState.PENDING, 0, {})
    assert again.deadline == 100.0 + WATCHDOG


@pytest.mark.parametrize("sent", [False, True])
def test_fail_removes_and_returns_entry(consumer, p_remote, sent: bool) -> None:
    entry = consumer.add("r", [[1, 2]], p_remote(), now=0.0)
    if sent:
        consumer.mark_sent("r", P_DAEMON, {P_AGENT: 0})
    assert consumer.fail("r") is entry
    assert consumer.pending == {}
    assert consumer.fail("r") is None
    # A completion that arrives after the failure is late and ignored.
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.UNKNOWN, None)


def test_fail_after_partial_completion(consumer, sent_recv) -> None:
    entry = sent_recv("r", tp_size=2)
    consumer.on_completion("r", P_AGENT, now=1.0)
    assert consumer.fail("r") is entry
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.UNKNOWN, None)


# ---------------------------------------------------------------- verify


def test_verify_mode_is_a_table_setting(consumer) -> None:
    assert consumer.verify is False
    assert ConsumerTable(watchdog_s=1.0, verify=True).verify is True


@VERIFYING
def test_verify_with_the_digests_announced_first(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    assert consumer.announce("r", P_DAEMON, 0, b"digests", now=1.0) is None
    assert (entry.digests, entry.announced_at, entry.state) == ({P_AGENT: b"digests"}, 1.0, RecvState.SENT)
    assert consumer.on_completion("r", P_AGENT, now=2.0) == (CompletionOutcome.VERIFY, entry)
    assert consumer.pending == {}


def test_without_verify_the_digests_are_not_kept(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    assert consumer.announce("r", P_DAEMON, 0, b"digests", now=1.0) is None
    assert (entry.digests, entry.announced_at) == ({}, 1.0)
    assert consumer.on_completion("r", P_AGENT, now=2.0) == (CompletionOutcome.DONE, entry)


@VERIFYING
def test_a_completion_before_the_digests_waits_for_them(consumer, sent_recv) -> None:
    entry = sent_recv("r", [[1, 2]])
    assert consumer.on_completion("r", P_AGENT, now=3.0) == (CompletionOutcome.AWAIT_DIGESTS, entry)
    assert (entry.state, entry.deadline) == (RecvState.LANDED, 3.0 + DIGEST_WAIT)
    assert consumer.holder([[2]]) == (2, "r"), "the blocks stay held until they are checked"
    assert consumer.busy and not consumer.unsettled  # every WRITE landed: P writes nothing more
    assert consumer.on_completion("r", P_AGENT, now=3.5) == (CompletionOutcome.UNKNOWN, None)
    assert entry.seen == 1
    assert consumer.announce("r", "p-daemon-1", 0, b"forged", now=4.0) is None
    assert entry.digests == {} and consumer.pending == {"r": entry}

    assert consumer.announce("r", P_DAEMON, 0, b"digests", now=4.0) is entry

    assert entry.digests == {P_AGENT: b"digests"}
    assert consumer.pending == {} and consumer.holder([[1, 2]]) is None


@VERIFYING
def test_landed_registration_fails_when_its_digests_never_come(consumer, sent_recv) -> None:
    entry = sent_recv("r")
    consumer.on_completion("r", P_AGENT, now=3.0)
    assert consumer.expire(3.0 + DIGEST_WAIT - 0.001, LIVE) == []
    assert consumer.expire(3.0 + DIGEST_WAIT, LIVE) == [
        RecvExpiry(entry, ExpiryAction.FAIL, "verify", "verify: P's digests never arrived")]
    assert consumer.pending == {}


@VERIFYING
def test_verify_waits_for_every_p_rank(consumer, sent_recv) -> None:
    entry = sent_recv("r", tp_size=2)
    assert consumer.on_completion("r", P_AGENT, now=1.0) == (CompletionOutcome.PARTIAL, entry)
    assert entry.state is RecvState.SENT
    assert consumer.on_completion("r", "p-agent-1", now=2.0)[0] is CompletionOutcome.AWAIT_DIGESTS
    assert consumer.announce("r", P_DAEMON, 0, b"d0", now=2.5) is None, "P rank 1's digests are still missing"
    assert consumer.announce("r", P_DAEMON, 7, b"d7", now=2.5) is None  # not a source: ignored
    assert consumer.announce("r", P_DAEMON, 1, b"d1", now=3.0) is entry
    assert entry.digests == {"p-agent-0": b"d0", "p-agent-1": b"d1"}


@VERIFYING
def test_announce_for_an_entry_not_sent_to_that_p_is_ignored(consumer, p_remote) -> None:
    entry = consumer.add("r", [[1]], p_remote(), now=0.0)
    assert consumer.announce("r", P_DAEMON, 0, b"d", now=1.0) is None
    assert consumer.announce("r", "", 0, b"d", now=1.0) is None
    assert consumer.announce("unknown", P_DAEMON, 0, b"d", now=1.0) is None
    assert entry is not None and (entry.digests, entry.announced_at) == ({}, None)


@VERIFYING
def test_a_landed_registration_is_final_when_evicted(consumer, sent_recv) -> None:
    entry = sent_recv("r", [[4]])
    consumer.on_completion("r", P_AGENT, now=1.0)
    assert consumer.evict("r", now=2.0, peer_alive=True) == (EvictOutcome.FINAL, entry)
    assert consumer.pending == {} and consumer.holder([[4]]) is None


# ---------------------------------------------------------------- block holders


def test_holder_names_the_live_registration_that_holds_a_block(consumer, p_remote) -> None:
    consumer.add("a", [[1, 2], [7]], p_remote(), now=0.0)
    assert consumer.tracks("a") and not consumer.tracks("b")
    assert consumer.holder([[3, 2]]) == (2, "a")
    assert consumer.holder([[], [7]]) == (7, "a")
    assert consumer.holder([[7]]) is None  # block 7 of group 0 is not group 1's block 7
    assert consumer.holder([[3, 4]]) is None


@pytest.mark.parametrize("ending", ["done", "fail", "evict_pending", "expire_pending", "verified", "digests_late"])
def test_a_final_registration_releases_its_blocks(p_remote, ending: str) -> None:
    table = ConsumerTable(watchdog_s=WATCHDOG, verify=ending in ("verified", "digests_late"))
    table.add("a", [[1, 2]], p_remote(), now=0.0)
    if ending == "fail":
        table.fail("a")
    elif ending == "evict_pending":
        table.evict("a", now=1.0, peer_alive=True)
    elif ending == "expire_pending":
        table.expire(WATCHDOG + 1, LIVE)
    else:
        table.mark_sent("a", P_DAEMON, {P_AGENT: 0})
        if ending == "verified":
            table.announce("a", P_DAEMON, 0, b"d", now=0.5)
        table.on_completion("a", P_AGENT, now=1.0)
        if ending == "digests_late":
            table.announce("a", P_DAEMON, 0, b"d", now=1.5)
    assert table.holder([[1, 2]]) is None and not table.tracks("a")


def test_a_duplicate_add_does_not_take_over_blocks(consumer, p_remote) -> None:
    consumer.add("a", [[1]], p_remote(), now=0.0)
    assert consumer.add("a", [[5]], p_remote(), now=0.0) is None
    assert consumer.holder([[5]]) is None
    consumer.fail("a")
    assert consumer.holder([[1]]) is None


def test_a_block_keeps_its_first_holder(consumer, p_remote) -> None:
    # The daemon refuses such a registration; the table never lets it take a held block.
    consumer.add("a", [[1]], p_remote(), now=0.0)
    consumer.add("b", [[1, 2]], p_remote(), now=0.0)
    assert (consumer.holder([[1]]), consumer.holder([[2]])) == ((1, "a"), (2, "b"))
    consumer.fail("b")
    assert consumer.holder([[1]]) == (1, "a")


# ---------------------------------------------------------------- views


def test_waiting_on_filters_by_remote_engine(consumer, p_remote) -> None:
    a = consumer.add("a", [[1]], p_remote(engine_id="p0"), now=0.0)
    consumer.add("b", [[2]], p_remote(engine_id="p1"), now=0.0)
    c = consumer.add("c", [[3]], p_remote(engine_id="p0"), now=0.0)
    consumer.mark_sent("c", P_DAEMON, {P_AGENT: 0})
    assert consumer.waiting_on("p0") == [a, c]
    assert [e.request_id for e in consumer.waiting_on("p1")] == ["b"]
    assert consumer.waiting_on("p2") == []


def test_sent_to_filters_by_p_incarnation(consumer, p_remote, sent_recv) -> None:
    a = sent_recv("a", [[1]])
    b = sent_recv("b", [[2]], p_daemon="p-daemon-1", p_agent="p-agent-1")
    consumer.add("c", [[3]], p_remote(), now=0.0)
    assert (consumer.sent_to(P_DAEMON), consumer.sent_to("p-daemon-1")) == ([a], [b])
    assert consumer.sent_to("prefill-0") == []  # a daemon id, not an engine id


def test_busy_only_while_a_registration_is_out(consumer, p_remote) -> None:
    assert not consumer.busy
    consumer.add("a", [[1]], p_remote(), now=0.0)
    consumer.add("b", [[2]], p_remote(), now=0.0)
    assert not consumer.busy  # nothing to poll for until P knows about it
    consumer.mark_sent("b", P_DAEMON, {P_AGENT: 0})
    assert consumer.busy
    consumer.fail("b")
    assert not consumer.busy


def test_unsettled_while_p_may_still_write(consumer, sent_recv) -> None:
    sent_recv("a")
    assert consumer.unsettled
    consumer.evict("a", now=1.0, peer_alive=True)
    assert consumer.unsettled  # CANCELLING: P has not answered
    consumer.fail("a")
    assert not consumer.unsettled


def test_hot_for_a_while_after_p_announced_a_write(consumer, sent_recv) -> None:
    sent_recv("a")
    assert not consumer.hot(now=0.0, hot_max_s=2.0)
    consumer.announce("a", P_DAEMON, 0, b"", now=10.0)
    assert consumer.hot(now=11.999, hot_max_s=2.0)
    assert not consumer.hot(now=12.0, hot_max_s=2.0)
    consumer.on_completion("a", P_AGENT, now=11.0)
    assert not consumer.hot(now=11.0, hot_max_s=2.0)


def test_sizes_and_repr(consumer, p_remote) -> None:
    assert consumer.sizes() == {"d_pending": 0}
    consumer.add("a", [[1]], p_remote(), now=0.0)
    consumer.add("b", [[2]], p_remote(), now=0.0)
    assert consumer.sizes() == {"d_pending": 2}
    assert repr(consumer) == "<ConsumerTable pending=2>"


# ---------------------------------------------------------------- property: counting


@settings(max_examples=200, deadline=None)
@given(
    sources=st.sampled_from([1, 2, 4, 8]),
    extra=st.integers(0, 3),
    foreign=st.lists(st.integers(0, 20), max_size=4),
)
def test_done_exactly_once_after_each_source_completed(sources: int, extra: int, foreign: list[int]) -> None:
    table = ConsumerTable(watchdog_s=1.0)
    entry = table.add("r", [[0]], Remote("p", "10.0.0.1", 5600, sources), now=0.0)
    assert entry is not None
    agents = [f"p-agent-{i}" for i in range(sources)]
    table.mark_sent("r", P_DAEMON, {a: i for i, a in enumerate(agents)})
    outcomes = []
    for i in range(sources + extra):
        # Completions from other agents, anywhere in between, change nothing.
        for _ in range(foreign.count(i)):
            assert table.on_completion("r", "p-agent-x", now=0.0) == (CompletionOutcome.UNKNOWN, None)
        # Each source once, in order; then again (late duplicates).
        outcomes.append(table.on_completion("r", agents[i % len(agents)], now=0.0)[0])
    assert outcomes.count(CompletionOutcome.DONE) == 1
    assert outcomes.index(CompletionOutcome.DONE) == sources - 1
    assert outcomes[: sources - 1] == [CompletionOutcome.PARTIAL] * (sources - 1)
    assert outcomes[sources:] == [CompletionOutcome.UNKNOWN] * extra
