"""Worker events out: to the connection that owns the request's rank.

A request's final event must reach the worker process that holds its blocks. When a
worker's connection breaks and the same process connects again (same rank, same pid),
the requests of the old connection still end on the old ``Rank`` (its WRITEs settle
there), and their events go to the new connection: the connector holds those blocks
until it hears. Events nobody can receive any more are counted and dropped.
"""

from __future__ import annotations

import structlog

from pushsvc.metrics import Metrics
from pushsvc.protocol import worker as wp
from pushsvc.server.ranks import Rank, RankRegistry

log = structlog.get_logger("pushsvc.outbox")


class Outbox:
    def __init__(self, ranks: RankRegistry, metrics: Metrics) -> None:
        self._ranks = ranks
        self._metrics = metrics

    def tell(self, rank: Rank, msg: wp.DaemonMessage) -> None:
        conn = rank.conn
        if conn is None:
            successor = self._ranks.successor(rank)
            conn = successor.conn if successor is not None else None
        if conn is None:
            self._metrics.events_dropped.labels(type(msg).__name__).inc()
            log.debug("event_dropped", rank=rank.number, kind=type(msg).__name__,
                      request_id=getattr(msg, "request_id", None))
            return
        conn.send(msg)
