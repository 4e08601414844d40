"""Fuzz the NIXL notification decoders (PUSH_REG and completions) exactly where the
daemon reads them: ``PushService.drain_notifs`` of a real in-process P/D pair on the
fake engine, fed by D's own agent (a known peer) and by an agent no daemon knows.

Every notification must end in exactly one of two counters: refused,
``pushsvc_malformed_inputs{source="notification"}`` (a part for a rank without landing
too), or handled,
``pushsvc_notifications{kind=push_reg|completion|late_completion}``. Those the protocol's
decoders refuse are counted under the decoder's reason (``push_reg``, ``completion``)
one for one. None of them makes P WRITE: nothing is staged on P, and a registration
alone never moves a byte.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
from daemon_fixtures import D_ENGINE, P_ENGINE, assert_tables_empty, metric, push_pair
from fuzzing import Driven, _text, batches, examples_for, fuzz_settings, seeds, structs
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.errors import ProtocolError
from pushsvc.protocol import notif
from pushsvc.protocol import worker as wp

# A failing batch of big inputs has a big repr; Hypothesis warns about it, which would
# hide the failure behind the warning.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Generating overly large repr")]

HANDLED = ("push_reg", "completion", "late_completion")


def _push_regs() -> st.SearchStrategy[bytes]:
    # Random PushRegs are nearly all for another engine; these name this pair's engines,
    # so they get past that check into the sender and block checks and the tables.
    ours = structs(notif.PushReg).map(
        lambda r: msgspec.structs.replace(r, remote_engine_id=P_ENGINE, decode_engine_id=D_ENGINE))
    return st.one_of(seeds(notif.PushReg), ours.map(msgspec.msgpack.encode)).map(
        lambda body: notif.PUSH_REG_PREFIX + body)


_completions = st.one_of(
    st.builds(lambda rid, tp: f"{rid}:{tp}".encode(), _text(0, 24), st.integers(1, 1024)),
    # Parts of a WRITE (side channel 1.3): to these ranks, which have no landing, refused.
    st.builds(lambda i, k, rid, tp: notif.PART_PREFIX + f"{i}/{k}:{rid}:{tp}".encode(), st.integers(-1, 40),
              st.integers(-1, 40), _text(0, 24), st.integers(0, 1100)),
    st.builds(lambda rid, tp: f"{rid}:{tp}".encode(), _text(0, 24), st.integers(-3, 1100)),
    st.binary(max_size=48),
)


def _reference_reason(payload: bytes) -> str:
    """The decoder's reason if the protocol's decoders refuse ``payload``, else ''."""
    try:
        if notif.is_push_reg(payload):
            notif.decode_push_reg(payload)
        else:
            notif.decode_notification(payload)
    except ProtocolError:
        return "push_reg" if notif.is_push_reg(payload) else "completion"
    return ""


def _malformed(daemon) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in daemon.metrics.malformed.collect():
        for s in m.samples:
            if s.name.endswith("_total") and s.labels["source"] == "notification":
                out[s.labels["reason"]] = s.value
    return out


def _handled(daemon) -> float:
    return sum(metric(daemon, "pushsvc_notifications_total", kind=k) for k in HANDLED)


def test_notification_decoders_fuzz(fuzz_cases: int) -> None:
    env = Driven(push_pair())
    pair = env.value
    counts = {"inputs": 0, "handled": 0, "refused": 0, "push_reg": 0, "completion": 0}
    intruder = pair.fake.create_agent("intruder/r0/00000000")

    async def push_once(rid: str) -> None:
        pair.register_recv(rid, [0])
        pair.send_ready(rid, [0])
        await pair.dw.wait_for(wp.RecvDone, rid)
        await pair.pw.wait_for(wp.SendDone, rid)

    async def run(batch: list[bytes]) -> None:
        rng = random.Random(sum(map(len, batch)))
        targets = [(pair.p, pair.p.service.ranks.current[0]), (pair.d, pair.d.service.ranks.current[0])]
        senders = [intruder, pair.d.service.ranks.current[0].agent, pair.p.service.ranks.current[0].agent]
        for daemon, rank in targets:
            for s in senders:
                if s is not rank.agent:
                    s.add_remote(rank.agent.metadata())
        before = {id(d): (_malformed(d), _handled(d)) for d, _ in targets}
        expected = {id(d): {"push_reg": 0, "completion": 0, "n": 0} for d, _ in targets}
        for payload in batch:
            daemon, rank = rng.choice(targets)
            sender = rng.choice([s for s in senders if s is not rank.agent])
            sender.send_notif(rank.agent.name, payload)
            daemon.service.drain_notifs(rank)  # the daemon's own path: progress() calls it
            reason = _reference_reason(payload)
            if reason:
                expected[id(daemon)][reason] += 1
            expected[id(daemon)]["n"] += 1
        for daemon, _ in targets:
            (m0, h0), exp = before[id(daemon)], expected[id(daemon)]
            m1, h1 = _malformed(daemon), _handled(daemon)
            refused = {k: v - m0.get(k, 0) for k, v in m1.items() if v != m0.get(k, 0)}
            handled = h1 - h0
            assert sum(refused.values()) + handled == exp["n"], (refused, handled, exp)
            assert refused.get("push_reg", 0) == exp["push_reg"], (refused, exp)
            assert refused.get("completion", 0) == exp["completion"], (refused, exp)
            counts["handled"] += handled
            counts["refused"] += sum(refused.values())
            counts["push_reg"] += exp["push_reg"]
            counts["completion"] += exp["completion"]
        counts["inputs"] += len(batch)

    payloads = st.one_of(_push_regs(), _completions)

    @fuzz_settings(examples_for(fuzz_cases))
    @given(batch=batches(payloads))
    def fuzz(batch: list[bytes]) -> None:
        env.run(run(batch))

    start = time.perf_counter()
    try:
        # One real push first, so that P knows D's daemon and agent: notifications from
        # D's agent then meet the known-sender checks.
        env.run(push_once("warmup"))
        writes = metric(pair.p, "pushsvc_transfers_total", result="done")
        fuzz()
        # No notification made P WRITE; D holds nothing; a real push still goes through.
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == writes
        assert metric(pair.p, "pushsvc_transfers_total", result="failed") == 0
        assert pair.p.service.writes_in_flight() == 0
        env.run(assert_tables_empty(pair.d))
        env.run(push_once("after-the-fuzz"))
        assert metric(pair.p, "pushsvc_transfers_total", result="done") == writes + 1
    finally:
        env.close()
    print(f"\nnotification fuzz: {counts} in {time.perf_counter() - start:.1f}s")
    assert counts["inputs"] >= fuzz_cases
    assert counts["handled"] > 0 and counts["push_reg"] > 0 and counts["completion"] > 0

