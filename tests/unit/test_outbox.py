"""Outbox: events reach the rank's connection, or wait (bounded) for the same process to
reconnect, and are dropped (counted) when nobody claims them."""

from __future__ import annotations

import asyncio

import pytest

from pushsvc.engine.fake import FakeEngine
from pushsvc.metrics import Metrics
from pushsvc.protocol import worker as wp
from pushsvc.server import outbox as outbox_module
from pushsvc.server.outbox import Outbox
from pushsvc.server.ranks import Rank, RankRegistry
from pushsvc.server.remotes import RemoteAgents
from pushsvc.server.timelines import Timelines


class Conn:
    def __init__(self, pid: int) -> None:
        self.pid, self.minor, self.got = pid, 1, []

    def send(self, msg) -> None:
        self.got.append(msg)


def rank(number: int, pid: int, conn: Conn | None) -> Rank:
    agent = FakeEngine().create_agent(f"r{number}-{pid}-{id(conn)}")
    return Rank(number, 2, "both", pid, agent, RemoteAgents(agent, 1 << 10, prepare=True), conn=conn)


def dropped(metrics: Metrics, kind: str) -> float:
    return metrics.registry.get_sample_value("pushsvc_worker_events_dropped_total", {"type": kind}) or 0.0


@pytest.mark.asyncio
async def test_events_go_to_the_rank_or_wait_for_the_same_process() -> None:
    ranks, metrics = RankRegistry(), Metrics()
    out = Outbox(ranks, metrics, keep_s=60.0, timelines=Timelines(metrics, 0))
    old = rank(0, 42, None)  # its connection broke
    ranks.retiring.append(old)
    out.tell(old, wp.RecvDone(request_id="a"))
    assert out.kept == 1
    other = rank(0, 7, Conn(7))  # another process took rank 0: not for it
    ranks.current[0] = other
    out.attached(other)
    await asyncio.sleep(0)
    assert other.conn.got == [] and out.kept == 1
    back = rank(0, 42, Conn(42))  # the same process is back
    ranks.current[0] = back
    out.attached(back)
    await asyncio.sleep(0)
    assert back.conn.got == [wp.RecvDone(request_id="a")] and out.kept == 0
    out.tell(old, wp.SendDone(request_id="b"))  # later events of the old rank: straight to the successor
    assert back.conn.got[-1] == wp.SendDone(request_id="b")


@pytest.mark.asyncio
async def test_kept_events_expire_and_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox_module, "MAX_KEPT", 3)
    ranks, metrics = RankRegistry(), Metrics()
    out = Outbox(ranks, metrics, keep_s=1.0, timelines=Timelines(metrics, 0))
    gone = rank(1, 9, None)
    for i in range(5):
        out.tell(gone, wp.RecvDone(request_id=f"r{i}"))
    assert out.kept == 3 and dropped(metrics, "RecvDone") == 2  # the oldest went first
    out.expire(asyncio.get_running_loop().time() + 2.0)
    assert out.kept == 0 and dropped(metrics, "RecvDone") == 5


def test_an_event_for_a_rank_without_pid_is_dropped() -> None:
    ranks, metrics = RankRegistry(), Metrics()
    out = Outbox(ranks, metrics, keep_s=1.0, timelines=Timelines(metrics, 0))
    out.tell(rank(0, 0, None), wp.SendFailed(request_id="x", reason="r"))
    assert out.kept == 0 and dropped(metrics, "SendFailed") == 1


@pytest.mark.asyncio
async def test_a_final_event_reaches_the_worker_before_its_timeline_is_reported() -> None:
    """The phases' histograms and the ``request_timeline`` log event come after the
    worker's event is sent, and after the rest of the loop's turn: they are bookkeeping,
    not on the request's path, nor on that of the requests settled in the same turn (a
    step's layer-wise requests, completed one after another)."""
    metrics, order = Metrics(), []

    class Recording(Timelines):
        def report(self, timeline) -> None:
            order.append(("report", timeline.request_id, timeline.outcome))
            super().report(timeline)

    class Watching(Conn):
        def send(self, msg) -> None:
            order.append(("send", msg.request_id))
            super().send(msg)

    timelines = Recording(metrics, 4)
    r = rank(0, 42, Watching(42))
    out = Outbox(RankRegistry(), metrics, keep_s=60.0, timelines=timelines)
    for rid in ("a", "b"):
        timelines.open(r, "recv", rid, "registered")
        out.tell(r, wp.RecvDone(request_id=rid))
    assert order == [("send", "a"), ("send", "b")]
    total = {"side": "recv", "phase": "total"}
    assert metrics.registry.get_sample_value("pushsvc_phase_seconds_count", total) is None
    await asyncio.sleep(0)
    assert order == [("send", "a"), ("send", "b"), ("report", "a", "recv_done"), ("report", "b", "recv_done")]
    assert metrics.registry.get_sample_value("pushsvc_phase_seconds_count", total) == 2.0
