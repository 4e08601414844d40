"""Request timelines: the moments of one request's path through a daemon (pure).

A timeline is opened when a table takes a request, marked as the request moves, and
closed by its final event. ``TimelineBook`` holds the open ones (bounded: past ``max_open``
the oldest is dropped) and the last ``keep`` closed ones. Times are seconds on one clock
that the caller chooses (the daemon uses the host's monotonic clock); nothing here reads
a clock. See docs/architecture.md, "Request timelines".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator

SEND, RECV = "send", "recv"
MAX_OPEN = 65536


@dataclass(slots=True)
class Timeline:
    request_id: str
    side: str  # SEND (P) or RECV (D)
    rank: int
    events: list[tuple[str, float]] = field(default_factory=list)  # (event, time), in marking order
    outcome: str = ""  # the final event's name once closed
    peer_request_id: str = ""  # P: the D request it was paired with

    @property
    def started(self) -> float:
        return self.events[0][1]

    def mark(self, event: str, t: float) -> None:
        """Record ``event`` at ``t``; an event already recorded keeps its first time."""
        if not self.has(event):
            self.events.append((event, t))

    def has(self, event: str) -> bool:
        return any(name == event for name, _ in self.events)

    def steps(self) -> Iterator[tuple[str, float]]:
        """Each event after the first with the seconds since the one before it."""
        for (_, before), (name, t) in zip(self.events, self.events[1:]):
            yield name, max(0.0, t - before)

    @property
    def total(self) -> float:
        return max(0.0, self.events[-1][1] - self.events[0][1]) if self.events else 0.0


def _closed_key(t: Timeline) -> tuple[int, str, str]:
    return (t.rank, t.side, t.request_id)


class TimelineBook:
    """Open timelines by key (the caller's: rank, side and request id), and the recent
    closed ones, newest last."""

    def __init__(self, keep: int, max_open: int = MAX_OPEN) -> None:
        self._open: OrderedDict[Hashable, Timeline] = OrderedDict()
        self._recent: deque[Timeline] = deque()
        self._recent_by: dict[tuple[int, str, str], Timeline] = {}  # (rank number, side, request id)
        self._keep = keep
        self._max_open = max_open
        self.dropped = 0  # open timelines dropped to stay under max_open

    def open(self, key: Hashable, timeline: Timeline) -> Timeline:
        """Start ``timeline`` under ``key`` (one already open under it is replaced)."""
        self._open.pop(key, None)
        self._open[key] = timeline
        while len(self._open) > self._max_open:
            self._open.popitem(last=False)
            self.dropped += 1
        return timeline

    def get(self, key: Hashable) -> Timeline | None:
        return self._open.get(key)

    def mark(self, key: Hashable, event: str, t: float) -> None:
        timeline = self._open.get(key)
        if timeline is not None:
            timeline.mark(event, t)

    def close(self, key: Hashable, outcome: str, t: float) -> Timeline | None:
        """The request's final event: the closed timeline, or None if none was open."""
        timeline = self._open.pop(key, None)
        if timeline is None:
            return None
        timeline.mark(outcome, t)
        timeline.outcome = outcome
        if self._keep > 0:
            if len(self._recent) >= self._keep:
                oldest = self._recent.popleft()
                if self._recent_by.get(_closed_key(oldest)) is oldest:
                    del self._recent_by[_closed_key(oldest)]
            self._recent.append(timeline)
            self._recent_by[_closed_key(timeline)] = timeline
        return timeline

    def closed(self, rank: int, side: str, request_id: str) -> Timeline | None:
        """The newest closed timeline of ``request_id`` on that rank and side, while it
        is among the recent ones (a moment after the final event is added to it)."""
        return self._recent_by.get((rank, side, request_id))

    def drop(self, owner: object) -> int:
        """Forget the open timelines whose key's first item is ``owner`` (a rank gone)."""
        gone = [k for k in self._open if isinstance(k, tuple) and k and k[0] is owner]
        for k in gone:
            del self._open[k]
        return len(gone)

    def recent(self, limit: int, request_id: str = "") -> list[Timeline]:
        """Up to ``limit`` closed timelines, newest first, of ``request_id`` if given."""
        out = []
        for timeline in reversed(self._recent):
            if len(out) >= limit:
                break
            if not request_id or timeline.request_id == request_id or timeline.peer_request_id == request_id:
                out.append(timeline)
        return out

    @property
    def open_count(self) -> int:
        return len(self._open)
