"""Worker events out: to the connection that owns the request's rank.

A request's final event must reach the worker process that holds its blocks, and the
daemon cannot tell a broken connection from a dead worker. So when a rank's connection
is gone, its events are kept for the same process (same rank number, same pid) and
delivered when it connects again: the connector holds those requests' blocks until it
hears. Kept events are bounded in number and age; those nobody claimed are counted as
dropped.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import structlog

from pushsvc.metrics import Metrics
from pushsvc.protocol import worker as wp
from pushsvc.server.ranks import Rank, RankRegistry
from pushsvc.server.timelines import Timelines

log = structlog.get_logger("pushsvc.outbox")

MAX_KEPT = 1 << 16


class Outbox:
    def __init__(self, ranks: RankRegistry, metrics: Metrics, keep_s: float, timelines: Timelines) -> None:
        self._ranks = ranks
        self._timelines = timelines  # a request's final event ends its timeline
        self._metrics = metrics
        self._keep_s = keep_s
        # (rank number, pid) -> events for that process, with the time they were kept
        self._kept: OrderedDict[tuple[int, int], list[tuple[float, wp.DaemonMessage]]] = OrderedDict()
        self._count = 0

    def tell(self, rank: Rank, msg: wp.DaemonMessage) -> None:
        ended = self._timelines.final(rank, msg)
        conn = rank.conn
        if conn is None:
            successor = self._ranks.successor(rank)
            conn = successor.conn if successor is not None else None
        if conn is not None:
            conn.send(msg)
        elif rank.pid:
            self._keep((rank.number, rank.pid), msg)
        else:
            self._drop(rank.number, msg)
        if ended is not None:  # its histograms and log event once the worker has the event, not before,
            # and after what else this turn of the loop settles (a step's requests: the rest still wait)
            asyncio.get_running_loop().call_soon(self._timelines.report, ended)

    def attached(self, rank: Rank) -> None:
        """``rank``'s worker connected: give it what was kept for its process, once the
        call that attached it (and sent the welcome) has returned."""
        if (rank.number, rank.pid) in self._kept:
            asyncio.get_running_loop().call_soon(self._deliver, rank)

    def _deliver(self, rank: Rank) -> None:
        events = self._kept.pop((rank.number, rank.pid), [])
        self._count -= len(events)
        if rank.conn is None:
            for _, msg in events:
                self._drop(rank.number, msg)
            return
        log.info("kept_events_delivered", rank=rank.number, pid=rank.pid, events=len(events))
        for _, msg in events:
            rank.conn.send(msg)

    def expire(self, now: float) -> None:
        for key in list(self._kept):
            events = self._kept[key]
            fresh = [(t, m) for t, m in events if now - t < self._keep_s]
            for t, msg in events:
                if now - t >= self._keep_s:
                    self._drop(key[0], msg)
            self._count -= len(events) - len(fresh)
            if fresh:
                self._kept[key] = fresh
            else:
                del self._kept[key]

    def _keep(self, key: tuple[int, int], msg: wp.DaemonMessage) -> None:
        self._kept.setdefault(key, []).append((asyncio.get_running_loop().time(), msg))
        self._count += 1
        while self._count > MAX_KEPT:
            oldest_key = next(iter(self._kept))
            events = self._kept[oldest_key]
            _, msg = events.pop(0)
            self._count -= 1
            self._drop(oldest_key[0], msg)
            if not events:
                del self._kept[oldest_key]

    def _drop(self, rank: int, msg: wp.DaemonMessage) -> None:
        self._metrics.events_dropped.labels(type(msg).__name__).inc()
        log.debug("event_dropped", rank=rank, kind=type(msg).__name__, request_id=getattr(msg, "request_id", None))

    @property
    def kept(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"<Outbox kept={self._count} for {len(self._kept)} processes>"
