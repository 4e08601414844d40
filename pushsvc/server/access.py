"""Who may talk to the worker socket, and which unfinished connections give way to new ones.

Pure logic, no I/O and no clock reads: ``workers.py`` reads the peer's credentials and the
time and asks these objects what to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar


@dataclass(frozen=True)
class AccessPolicy:
    """Admit a peer whose uid is listed, or any of whose groups (primary or supplementary)
    is listed. Root and the daemon's own uid are always listed."""

    uids: frozenset[int]
    gids: frozenset[int]

    @classmethod
    def build(cls, *, own_uid: int, allowed_uids: Iterable[int], allowed_gids: Iterable[int],
              socket_gid: int | None) -> AccessPolicy:
        gids = frozenset(allowed_gids)
        if not gids and socket_gid is not None:
            # Without an explicit list, membership of the socket's group is what the file
            # mode already grants; an explicit list narrows it.
            gids = frozenset({socket_gid})
        return cls(uids=frozenset(allowed_uids) | {0, own_uid}, gids=gids)

    def admits(self, uid: int, groups: Iterable[int]) -> bool:
        return uid in self.uids or not self.gids.isdisjoint(groups)


C = TypeVar("C")


class PendingQueue(Generic[C]):
    """Connections that have not finished their hello, oldest first, each with a deadline.

    A cap bounds how many may wait: a flood of idle connections then costs the daemon at
    most ``cap`` sockets, and a real worker that just connected is never the one dropped.
    """

    def __init__(self, cap: int, timeout_s: float) -> None:
        self.cap = cap
        self.timeout_s = timeout_s
        self._deadlines: dict[C, float] = {}  # insertion order is arrival order

    def add(self, conn: C, now: float) -> float:
        """Track ``conn``; returns its deadline."""
        deadline = now + self.timeout_s
        self._deadlines[conn] = deadline
        return deadline

    def discard(self, conn: C) -> None:
        self._deadlines.pop(conn, None)

    def over_cap(self) -> bool:
        return len(self._deadlines) > self.cap

    def oldest(self) -> C | None:
        return next(iter(self._deadlines), None)

    def expired(self, now: float) -> list[C]:
        """Connections whose deadline has passed (deadlines grow with arrival order)."""
        out = []
        for conn, deadline in self._deadlines.items():
            if deadline > now:
                break
            out.append(conn)
        return out

    def next_deadline(self) -> float | None:
        first = self.oldest()
        return None if first is None else self._deadlines[first]

    def __len__(self) -> int:
        return len(self._deadlines)

    def __contains__(self, conn: object) -> bool:
        return conn in self._deadlines
