"""Request timelines out of the daemon: marks from the Sender and Receiver, closed by the
final event the Outbox hands a worker; on close the ``pushsvc_phase_seconds`` histogram,
the ``request_timeline`` log event and the recent ones for ``GET /v1/requests``
(docs/architecture.md, "Request timelines")."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable

import structlog

from pushsvc.metrics import Metrics
from pushsvc.protocol import worker as wp
from pushsvc.server.ranks import Rank
from pushsvc.state.timeline import MAX_OPEN, RECV, SEND, Timeline, TimelineBook

log = structlog.get_logger("pushsvc.timelines")

_FINALS: dict[type, tuple[str, str]] = {
    wp.SendDone: (SEND, "send_done"), wp.SendFailed: (SEND, "send_failed"),
    wp.RecvDone: (RECV, "recv_done"), wp.RecvFailed: (RECV, "recv_failed"),
}


class Timelines:
    def __init__(self, metrics: Metrics, keep: int, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, max_open: int = MAX_OPEN) -> None:
        self._metrics = metrics
        self._clock = clock
        self._wall_offset = wall() - clock()  # monotonic -> wall clock, for display only
        self._book = TimelineBook(keep, max_open)
        self._phases: dict[tuple[str, str], Any] = {}  # (side, phase) -> its histogram child

    def open(self, rank: Rank, side: str, rid: str, event: str) -> None:
        self._book.open((rank, side, rid), Timeline(rid, side, rank.number)).mark(event, self._clock())

    def mark(self, rank: Rank, side: str, rid: str, event: str) -> None:
        self._book.mark((rank, side, rid), event, self._clock())

    def paired(self, rank: Rank, rid: str, d_request_id: str) -> None:
        """P's request ``rid`` was matched with D's request ``d_request_id``."""
        timeline = self._book.get((rank, SEND, rid))
        if timeline is not None:
            timeline.peer_request_id = d_request_id

    def final(self, rank: Rank, msg: wp.DaemonMessage) -> Timeline | None:
        """``msg`` goes to ``rank``'s worker: if it is a request's final event, its timeline
        ends now (returned, for ``report`` once the worker has the event)."""
        kind = _FINALS.get(type(msg))
        if kind is None:
            return None
        side, outcome = kind
        return self._book.close((rank, side, msg.request_id), outcome, self._clock())  # type: ignore[attr-defined]

    def report(self, timeline: Timeline) -> None:
        """An ended timeline into ``pushsvc_phase_seconds`` and the ``request_timeline`` event."""
        for phase, seconds in timeline.steps():
            self._phase(timeline.side, phase).observe(seconds)
        self._phase(timeline.side, "total").observe(timeline.total)
        if log.is_enabled_for(logging.INFO):  # building the event costs more than the rest
            log.info("request_timeline", **self.describe(timeline))

    def reported(self, rank: Rank, msg: wp.Reported) -> None:
        """The worker handed these requests to vLLM as finished (``finished_sending`` /
        ``finished_recving``): the last moment of their closed timelines, observed as its
        own phase. The worker's time is on the host's clock; one before the final event
        or in the future is taken as the nearest plausible one."""
        now = self._clock()
        for side, ids, event in ((SEND, msg.sending, "finished_sending"), (RECV, msg.recving, "finished_recving")):
            for rid in ids:
                timeline = self._book.closed(rank.number, side, rid)
                if timeline is None or timeline.has(event):
                    continue
                final = timeline.events[-1][1]
                at = min(max(msg.at, final), now)
                timeline.mark(event, at)
                self._phase(side, event).observe(at - final)
                log.debug("request_reported", request_id=rid, side=side, rank=rank.number,
                          after_final_ms=round((at - final) * 1e3, 3))

    def _phase(self, side: str, phase: str) -> Any:
        child = self._phases.get((side, phase))
        if child is None:
            child = self._phases[(side, phase)] = self._metrics.phase_seconds.labels(side, phase)
        return child

    def forget(self, rank: Rank) -> None:
        self._book.drop(rank)

    def recent(self, limit: int, request_id: str = "") -> list[dict[str, Any]]:
        return [self.describe(t) for t in self._book.recent(limit, request_id)]

    def describe(self, t: Timeline) -> dict[str, Any]:
        start = datetime.fromtimestamp(t.started + self._wall_offset, timezone.utc)
        out: dict[str, Any] = {
            "request_id": t.request_id, "side": t.side, "rank": t.rank, "outcome": t.outcome,
            "start": start.isoformat(timespec="microseconds"),
            "events_ms": {name: round((at - t.started) * 1e3, 3) for name, at in t.events},
        }
        if t.peer_request_id:
            out["peer_request_id"] = t.peer_request_id
        return out

    @property
    def open_count(self) -> int:
        return self._book.open_count
