"""ConsumerTable against a reference model: random sequences of registrations, deliveries,
completions (from the right agent and from others), WriteStarted announcements, worker
evictions, P lost / back / gone and the watchdog, in verify mode and without."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from pushsvc.state.consumer import (
    CANCELLED,
    PEER_LOST,
    WATCHDOG,
    CompletionOutcome,
    ConsumerTable,
    EvictOutcome,
    ExpiryAction,
    PendingRecv,
    RecvState,
    Remote,
    SourceOutcome,
)

WATCHDOG_S = 10.0
GRACE = 3.0
DIGEST_WAIT = 2.0

RIDS = st.sampled_from(["r0", "r1", "r2", "r3", "r4"])
DAEMONS = ["pd-0", "pd-1"]
AGENT_OF = {"pd-0": "pa-0", "pd-1": "pa-1"}  # P rank i's agent at that P daemon: pa-0.i, pa-1.i
SENDERS = st.sampled_from(["pa-0.0", "pa-0.1", "pa-1.0", "pa-1.1", "pa-x"])


def sources_of(daemon: str, expected: int) -> dict[str, int]:
    """The agents a registration expecting ``expected`` P ranks goes to at ``daemon``."""
    return {f"{AGENT_OF[daemon]}.{i}": i for i in range(expected)}
MOSTLY = st.sampled_from([True, True, True, False])  # hypothesis leans to small integers, not to these

# What the worker may read when a withdrawn registration ends, by the reason it was withdrawn.
FAILED = "push_failed_remote: P rank cannot write"  # why a source's PushFailed withdraws the entry
REASON_PREFIX = {PEER_LOST: "peer_lost: ", WATCHDOG: "watchdog: ", CANCELLED: "cancelled", FAILED: FAILED}


@dataclass
class Model:
    blocks: list[list[int]]
    expected: int
    deadline: float | None
    state: RecvState = RecvState.PENDING
    reason: str = CANCELLED
    p_daemon: str = ""
    sources: dict[str, int] = field(default_factory=dict)
    open: set[str] = field(default_factory=set)
    landed: set[str] = field(default_factory=set)
    digests: dict[str, bytes] = field(default_factory=dict)
    announced_at: float | None = None

    @property
    def seen(self) -> int:
        return len(self.landed)

    def send(self, daemon: str) -> None:
        self.state, self.p_daemon = RecvState.SENT, daemon
        self.sources = sources_of(daemon, self.expected)
        self.open = set(self.sources)

    def cells(self) -> set[tuple[int, int]]:
        return {(g, b) for g, ids in enumerate(self.blocks) for b in ids}


class ConsumerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = ConsumerTable(watchdog_s=WATCHDOG_S, cancel_grace_s=GRACE,
                                   digest_wait_s=DIGEST_WAIT)
        self.now = 0.0
        self.verify = False
        self.live = set(DAEMONS)
        self.model: dict[str, Model] = {}
        self.serial = 0

    @initialize(verify=st.booleans(), n=st.integers(0, 4), sent=st.integers(0, 4))
    def start(self, verify: bool, n: int, sent: int) -> None:
        """Verify mode or not (a table setting), and a few registrations to begin with (the
        rule that adds them may be left out of a run)."""
        self.verify = verify
        self.table = ConsumerTable(watchdog_s=WATCHDOG_S, cancel_grace_s=GRACE,
                                   digest_wait_s=DIGEST_WAIT, verify=verify)
        for i in range(n):
            rid = f"r{i}"
            self.serial += 1
            assert self.table.add(rid, [[self.serial]], Remote("prefill-0", "10.0.0.1", 5600, 1), self.now)
            self.model[rid] = Model([[self.serial]], 1, self.now + WATCHDOG_S)
            if i < sent:
                daemon = DAEMONS[i % 2]
                assert self.table.mark_sent(rid, daemon, sources_of(daemon, 1))
                self.model[rid].send(daemon)

    # ------------------------------------------------------------ helpers

    def _pick(self, data: st.DataObject, *states: RecvState) -> str:
        """Mostly a tracked request in one of ``states`` (any tracked one if none given),
        else most steps would hit nothing; now and then any id."""
        fit = [r for r, m in self.model.items() if not states or m.state in states]
        if fit and data.draw(MOSTLY, label="tracked"):
            return data.draw(st.sampled_from(fit), label="rid")
        return data.draw(RIDS, label="rid")

    def _ended(self, before: set[str], finals: set[str]) -> None:
        """Entries leave the table only with a final outcome reported for them."""
        dropped = before - set(self.table.pending)
        assert dropped == finals, (dropped, finals)
        for rid in finals:
            del self.model[rid]

    def _withdraw(self, m: Model, alive: bool) -> EvictOutcome:
        m.state = RecvState.CANCELLING
        if alive:
            m.deadline = None
            return EvictOutcome.CANCEL
        m.deadline = self.now + GRACE
        return EvictOutcome.HELD

    def _check_final(self, m: Model, kind: str, reason: str) -> None:
        want_kind = PEER_LOST if m.reason == PEER_LOST else "cancel_unconfirmed"
        assert kind == want_kind
        assert reason.startswith(REASON_PREFIX[m.reason]), reason

    def _check_settled(self, entry: PendingRecv, m: Model) -> None:
        """P answered a withdrawal (its confirmation, or its WRITE's completion): the
        reason the worker reads never says P did not confirm."""
        reason = self.table.final_reason(entry, settled=True)
        assert reason.startswith(REASON_PREFIX[m.reason]) and not reason.endswith("P did not confirm"), reason

    # ------------------------------------------------------------ rules

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 5.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(data=st.data(), rid=RIDS, tp=st.sampled_from([1, 2]), groups=st.integers(1, 2), overlap=st.booleans())
    def add(self, data: st.DataObject, rid: str, tp: int, groups: int, overlap: bool) -> None:
        self.serial += 1
        blocks: list[list[int]] = [[self.serial] for _ in range(groups)]
        held_cells = sorted(c for m in self.model.values() for c in m.cells())
        if overlap and held_cells:  # a registration naming a block another one holds
            g, b = data.draw(st.sampled_from(held_cells), label="held block")
            blocks = [[] for _ in range(g)] + [[b]]
        remote = Remote("prefill-0", "10.0.0.1", 5600, tp)
        if rid in self.model:
            assert self.table.add(rid, blocks, remote, self.now) is None
            return
        cells = {(g, b) for g, ids in enumerate(blocks) for b in ids}
        held = {c: r for r, m in self.model.items() for c in m.cells() if c in cells}
        if held:
            # The daemon refuses a registration naming a held block, as the table tells it.
            assert self.table.holder(blocks) is not None
            assert self.table.holder(blocks)[1] in held.values()
            return
        assert self.table.holder(blocks) is None
        entry = self.table.add(rid, blocks, remote, self.now)
        assert entry is not None and entry.deadline == self.now + WATCHDOG_S
        self.model[rid] = Model(blocks, tp, self.now + WATCHDOG_S)

    @rule(data=st.data(), daemon=st.sampled_from(DAEMONS))
    def mark_sent(self, data: st.DataObject, daemon: str) -> None:
        rid = self._pick(data, RecvState.PENDING)
        m = self.model.get(rid)
        ok = m is not None and m.state is RecvState.PENDING
        assert self.table.mark_sent(rid, daemon, sources_of(daemon, m.expected if m else 1)) is ok
        if ok:
            m.send(daemon)

    @rule(data=st.data(), own=MOSTLY)
    def completion(self, data: st.DataObject, own: bool) -> None:
        rid = self._pick(data, RecvState.SENT, RecvState.CANCELLING)
        m = self.model.get(rid)
        if m is not None and m.open and own:
            sender = data.draw(st.sampled_from(sorted(m.open)), label="sender")
        else:
            sender = data.draw(SENDERS, label="sender")
        before = set(self.table.pending)
        outcome, entry = self.table.on_completion(rid, sender, self.now)
        if m is None or m.state in (RecvState.PENDING, RecvState.LANDED) or sender not in m.open:
            assert (outcome, entry) == (CompletionOutcome.UNKNOWN, None)
            self._ended(before, set())
            return
        assert entry is not None and entry.request_id == rid
        m.open.discard(sender)
        m.landed.add(sender)
        if m.open:
            assert outcome is CompletionOutcome.PARTIAL
            self._ended(before, set())
        elif m.landed != set(m.sources) or (m.state is RecvState.CANCELLING and m.reason != PEER_LOST):
            assert outcome is CompletionOutcome.CANCELLED
            self._check_settled(entry, m)
            self._ended(before, {rid})
        elif not self.verify:
            assert outcome is CompletionOutcome.DONE
            self._ended(before, {rid})
        elif set(m.digests) >= set(m.sources):
            assert outcome is CompletionOutcome.VERIFY and entry.digests == m.digests
            self._ended(before, {rid})
        else:
            assert outcome is CompletionOutcome.AWAIT_DIGESTS
            m.state, m.deadline = RecvState.LANDED, self.now + DIGEST_WAIT
            self._ended(before, set())

    @rule(data=st.data(), own=MOSTLY)
    def announce(self, data: st.DataObject, own: bool) -> None:
        rid = self._pick(data, RecvState.SENT, RecvState.LANDED)
        m = self.model.get(rid)
        daemon = m.p_daemon if m is not None and m.p_daemon and own else data.draw(st.sampled_from(DAEMONS))
        p_rank = data.draw(st.integers(0, 2), label="P rank")
        before = set(self.table.pending)
        digests = f"{rid}@{self.now}".encode()
        got = self.table.announce(rid, daemon, p_rank, digests, self.now)
        agent = next((a for a, r in m.sources.items() if r == p_rank), None) if m is not None else None
        if m is None or m.p_daemon != daemon or agent is None:
            assert got is None
            self._ended(before, set())
            return
        if self.verify:
            m.digests[agent] = digests
        if m.state is RecvState.LANDED:
            if set(m.digests) >= set(m.sources):
                assert got is not None and got.request_id == rid and got.digests == m.digests
                self._ended(before, {rid})
            else:
                assert got is None
                self._ended(before, set())
            return
        assert got is None
        m.announced_at = self.now
        self._ended(before, set())

    def _source(self, data: st.DataObject, own: bool, *states: RecvState) -> tuple[str, str, int, Model | None]:
        rid = self._pick(data, *states)
        m = self.model.get(rid)
        daemon = m.p_daemon if m is not None and m.p_daemon and own else data.draw(st.sampled_from(DAEMONS))
        if m is not None and m.open and own:
            p_rank = m.sources[data.draw(st.sampled_from(sorted(m.open)), label="open source")]
        else:
            p_rank = data.draw(st.integers(0, 2), label="P rank")
        return rid, daemon, p_rank, m

    @rule(data=st.data(), own=MOSTLY)
    def source_cancelled(self, data: st.DataObject, own: bool) -> None:
        """P rank ``p_rank`` confirms a cancel (``PushCancelled``)."""
        rid, daemon, p_rank, m = self._source(data, own, RecvState.CANCELLING)
        before = set(self.table.pending)
        got = self.table.source_cancelled(rid, daemon, p_rank)
        agent = next((a for a, r in m.sources.items() if r == p_rank), None) if m is not None else None
        if m is None or m.p_daemon != daemon or m.state is not RecvState.CANCELLING or agent not in m.open:
            assert got is None
            self._ended(before, set())
            return
        m.open.discard(agent)
        if m.open:
            assert got is None, "another source may still write: the blocks stay held"
            self._ended(before, set())
        else:
            assert got is not None and got.request_id == rid
            self._check_settled(got, m)
            self._ended(before, {rid})

    @rule(data=st.data(), own=MOSTLY)
    def source_failed(self, data: st.DataObject, own: bool) -> None:
        """P rank ``p_rank`` cannot write (``PushFailed``)."""
        rid, daemon, p_rank, m = self._source(data, own, RecvState.SENT, RecvState.CANCELLING, RecvState.LANDED)
        alive = daemon in self.live
        before = set(self.table.pending)
        outcome, entry = self.table.source_failed(rid, daemon, p_rank, FAILED, self.now, alive)
        agent = next((a for a, r in m.sources.items() if r == p_rank), None) if m is not None else None
        if m is None or m.p_daemon != daemon or agent is None:
            assert (outcome, entry) == (SourceOutcome.NONE, None)
            self._ended(before, set())
            return
        m.open.discard(agent)
        assert entry is not None and entry.request_id == rid
        if not m.open or m.state is RecvState.LANDED:
            assert outcome is SourceOutcome.FINAL
            self._ended(before, {rid})
        elif m.state is RecvState.CANCELLING:
            assert outcome is SourceOutcome.WAIT
            self._ended(before, set())
        else:
            m.reason = FAILED
            want = self._withdraw(m, alive)
            assert outcome is (SourceOutcome.CANCEL if want is EvictOutcome.CANCEL else SourceOutcome.HELD)
            self._ended(before, set())

    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        rid = self._pick(data)
        before = set(self.table.pending)
        got = self.table.fail(rid)
        assert (got is None) == (rid not in self.model)
        if got is not None and got.state is RecvState.CANCELLING:  # as for P's PushCancelled
            self._check_settled(got, self.model[rid])
        self._ended(before, {rid} if got is not None else set())

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        rid = self._pick(data, RecvState.SENT, RecvState.PENDING, RecvState.LANDED, RecvState.CANCELLING)
        before = set(self.table.pending)
        m = self.model.get(rid)
        alive = m is not None and m.p_daemon in self.live
        outcome, entry = self.table.evict(rid, self.now, alive)
        if m is None or (m.state is RecvState.CANCELLING and m.reason != PEER_LOST):
            assert (outcome, entry) == (EvictOutcome.NONE, None)  # unknown, or withdrawn already
            self._ended(before, set())
        elif m.state is RecvState.CANCELLING:
            # Held for a lost P: the grace (if any) runs on, but a WRITE that still lands
            # no longer makes it done.
            m.reason = CANCELLED
            assert outcome is EvictOutcome.HELD and entry is not None and entry.request_id == rid
            self._ended(before, set())
        elif m.state is not RecvState.SENT:
            assert outcome is EvictOutcome.FINAL and entry is not None
            self._ended(before, {rid})
        else:
            m.reason = CANCELLED
            assert outcome is self._withdraw(m, alive) and entry is not None
            self._ended(before, set())

    @rule(daemon=st.sampled_from(DAEMONS))
    def peer_lost(self, daemon: str) -> None:
        self.live.discard(daemon)
        got = self.table.peer_lost(daemon, self.now)
        want = [r for r, m in self.model.items()
                if m.p_daemon == daemon and m.state in (RecvState.SENT, RecvState.CANCELLING)]
        assert [e.request_id for e in got] == want
        for rid in want:
            m = self.model[rid]
            if m.state is RecvState.SENT:  # the full grace, whatever its watchdog said
                m.state, m.reason, m.deadline = RecvState.CANCELLING, PEER_LOST, self.now + GRACE
            elif m.deadline is None:  # waiting for P's answer: now it gets a timer
                m.deadline = self.now + GRACE
            # else held already: its grace runs on

    @rule(daemon=st.sampled_from(DAEMONS))
    def peer_back(self, daemon: str) -> None:
        self.live.add(daemon)
        got = self.table.peer_back(daemon)
        want = [r for r, m in self.model.items()
                if m.p_daemon == daemon and m.state is RecvState.CANCELLING and m.deadline is not None]
        assert [e.request_id for e in got] == want
        for rid in want:
            self.model[rid].deadline = None

    @rule(daemon=st.sampled_from(DAEMONS))
    def peer_gone(self, daemon: str) -> None:
        self.live.discard(daemon)
        before = set(self.table.pending)
        got = self.table.peer_gone(daemon)
        want = {r for r, m in self.model.items() if m.p_daemon == daemon and m.state is not RecvState.PENDING}
        for exp in got:
            m = self.model[exp.entry.request_id]
            assert exp.action is ExpiryAction.FAIL
            if m.state is RecvState.LANDED:  # its digests will never come
                assert (exp.kind, exp.reason) == ("verify", "verify: P daemon prefill-0 restarted before its "
                                                            "digests arrived")
                continue
            if m.state is RecvState.SENT:
                m.reason = PEER_LOST
            self._check_final(m, exp.kind, exp.reason)
            assert exp.reason.endswith("restarted")
        self._ended(before, {e.entry.request_id for e in got})
        assert {e.entry.request_id for e in got} == want

    @rule()
    def expire(self) -> None:
        before = set(self.table.pending)
        waiting = {r for r, m in self.model.items() if m.state is RecvState.CANCELLING and m.deadline is None}
        got = self.table.expire(self.now, frozenset(self.live))
        due = [r for r, m in self.model.items() if m.deadline is not None and m.deadline <= self.now]
        assert [e.entry.request_id for e in got] == due
        finals = set()
        for exp in got:
            rid = exp.entry.request_id
            m = self.model[rid]
            if m.state is RecvState.SENT:
                m.reason = WATCHDOG
                outcome = self._withdraw(m, m.p_daemon in self.live)
                assert exp.action is (ExpiryAction.CANCEL if outcome is EvictOutcome.CANCEL else ExpiryAction.HOLD)
                continue
            assert exp.action is ExpiryAction.FAIL
            finals.add(rid)
            if m.state is RecvState.PENDING:
                assert (exp.kind, exp.reason) == (WATCHDOG, f"watchdog: no push within {WATCHDOG_S}s")
            elif m.state is RecvState.LANDED:
                assert (exp.kind, exp.reason) == ("verify", "verify: P's digests never arrived")
            else:
                self._check_final(m, exp.kind, exp.reason)
        assert not finals & waiting, "a CANCELLING entry without deadline was dropped by expire"
        self._ended(before, finals)

    # ------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_model(self) -> None:
        assert list(self.table.pending) == list(self.model)
        for rid, m in self.model.items():
            e: PendingRecv = self.table.pending[rid]
            assert e.request_id == rid and e.block_ids == m.blocks
            assert (e.state, e.deadline, e.seen, e.reason) == (m.state, m.deadline, m.seen, m.reason)
            assert (e.p_daemon, e.sources, e.open, e.landed) == (m.p_daemon, m.sources, m.open, m.landed)
            assert (e.digests, e.announced_at) == (m.digests, m.announced_at)
            assert e.held == (m.state is RecvState.CANCELLING and m.deadline is not None)

    @invariant()
    def a_block_is_held_by_one_entry(self) -> None:
        owners: dict[tuple[int, int], str] = {}
        for rid, m in self.model.items():
            for cell in m.cells():
                assert cell not in owners, f"{cell} tracked by {owners[cell]} and {rid}"
                owners[cell] = rid
        assert self.table.holders.cells() == owners
        for (g, b), rid in owners.items():
            assert self.table.holder([[]] * g + [[b]]) == (b, rid)

    @invariant()
    def only_the_states_that_may_be_written_are_unsettled(self) -> None:
        t = self.table
        states = [m.state for m in self.model.values()]
        assert t.unsettled == any(s in (RecvState.SENT, RecvState.CANCELLING) for s in states)
        assert t.busy == any(s is not RecvState.PENDING for s in states)
        assert t.sizes() == {"d_pending": len(self.model)}
        for d in DAEMONS:
            assert [e.request_id for e in t.sent_to(d)] == [r for r, m in self.model.items() if m.p_daemon == d]

    @invariant()
    def deadlines_follow_the_state(self) -> None:
        for m in self.model.values():
            if m.state in (RecvState.PENDING, RecvState.SENT, RecvState.LANDED):
                assert m.deadline is not None
            if m.state is RecvState.PENDING:
                assert (m.p_daemon, m.sources, m.seen) == ("", {}, 0)
            assert m.open or m.state is RecvState.PENDING or m.state is RecvState.LANDED, \
                "an entry no source may write into is still tracked"


def test_consumer_table_state_machine() -> None:
    run_state_machine_as_test(
        ConsumerMachine,
        settings=settings(max_examples=400, stateful_step_count=80, deadline=None),
    )
