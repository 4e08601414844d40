"""Backends, least-outstanding selection, and the cache of P daemons' coordinates.

No network I/O here: ``DaemonInfoCache`` is handed the function that fetches a daemon's
``/v1/info`` (``upstream.fetch_coordinates``), so tests and the app share one cache logic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pushsvc.proxy.legs import PrefillCoordinates

PREFILL = "prefill"
DECODE = "decode"


@dataclass(eq=False)
class Backend:
    """One vLLM instance. ``outstanding``: proxy requests to it not yet finished."""

    url: str
    role: str
    # P only: its pushsvc daemon's health endpoint; None: P's answers say where it is.
    daemon_url: str | None = None
    outstanding: int = 0
    healthy: bool = True
    # Taken out by the operator (``POST /admin/drain``): gets no new request, whatever
    # its health, until resumed; what it has in flight finishes.
    draining: bool = False
    last_error: str = ""
    coordinates: PrefillCoordinates | None = None  # P only: cached from the daemon or P's last answer

    def mark_failed(self, reason: str) -> None:
        self.healthy = False
        self.last_error = reason

    def mark_ok(self) -> None:
        self.healthy = True
        self.last_error = ""

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"url": self.url, "healthy": self.healthy, "draining": self.draining,
                               "outstanding": self.outstanding}
        if self.role == PREFILL:
            out["daemon_url"] = self.daemon_url
            out["engine_id"] = self.coordinates.engine_id if self.coordinates else None
        if self.last_error:
            out["last_error"] = self.last_error
        return out

    def __repr__(self) -> str:
        state = ("up" if self.healthy else "down") + (" draining" if self.draining else "")
        return f"<Backend {self.role} {self.url} {state} outstanding={self.outstanding}>"


class NoBackend(Exception):
    """Every backend of a role is drained: nothing may take a new request."""

    def __init__(self, role: str) -> None:
        super().__init__(f"every {role} backend is drained (POST /admin/resume puts one back)")
        self.role = role


class BackendPool:
    """Backends of one role; ``pick`` takes the least busy healthy one, ties round robin."""

    def __init__(self, backends: list[Backend]) -> None:
        if not backends:
            raise ValueError("a pool needs at least one backend")
        self.backends = backends
        self.role = backends[0].role
        self._next = 0  # where the round-robin scan for ties starts

    def pick(self, preferred: Backend | None = None, slack: int = 0) -> Backend:
        """Choose a backend and count the request against it; pair with ``release``.

        Drained backends are never candidates (``NoBackend`` when every one is).
        Unhealthy backends are skipped while a healthy one exists; if none is, all are
        candidates, so a request can still discover that a backend came back. A
        ``preferred`` candidate (prefix affinity) is taken while it has at most ``slack``
        requests more outstanding than the least busy candidate.
        """
        n = len(self.backends)
        any_healthy = self.any_healthy()
        best: Backend | None = None
        best_index = 0
        for step in range(n):
            index = (self._next + step) % n
            backend = self.backends[index]
            if backend.draining or (any_healthy and not backend.healthy):
                continue
            if best is None or backend.outstanding < best.outstanding:
                best, best_index = backend, index
        if best is None:
            raise NoBackend(self.role)
        if (preferred is not None and preferred is not best and preferred in self.backends
                and not preferred.draining and (preferred.healthy or not any_healthy)
                and preferred.outstanding <= best.outstanding + slack):
            best = preferred
        else:
            self._next = (best_index + 1) % n
        best.outstanding += 1
        return best

    def release(self, backend: Backend) -> None:
        backend.outstanding -= 1

    def any_healthy(self) -> bool:
        """A backend that is healthy and takes new requests (not drained)."""
        return any(b.healthy and not b.draining for b in self.backends)

    def find(self, url: str) -> Backend | None:
        return next((b for b in self.backends if b.url == url), None)

    def describe(self) -> list[dict[str, Any]]:
        return [b.describe() for b in self.backends]

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends)

    def __repr__(self) -> str:
        return f"<BackendPool {self.backends!r}>"


FetchCoordinates = Callable[[str], Awaitable[PrefillCoordinates]]


class DaemonInfoCache:
    """P coordinates per backend, fetched once and kept until ``invalidate``.

    Fetches only for a backend with a ``daemon_url``; for one without, the app keeps what
    P's answers say in ``Backend.coordinates`` and ``invalidate`` drops that alike.

    Concurrent requests for an uncached backend share one fetch; a caller that gives up
    (its client left) does not cancel the fetch for the others.
    """

    def __init__(self, fetch: FetchCoordinates) -> None:
        self._fetch = fetch
        self._inflight: dict[str, asyncio.Task[PrefillCoordinates]] = {}

    async def get(self, backend: Backend) -> PrefillCoordinates:
        if backend.coordinates is not None:
            return backend.coordinates
        return await asyncio.shield(self._start(backend))

    async def refresh(self, backend: Backend) -> PrefillCoordinates:
        """Fetch now (the health probe), replacing what is cached if it succeeds."""
        return await asyncio.shield(self._start(backend))

    def invalidate(self, backend: Backend) -> None:
        backend.coordinates = None

    async def close(self) -> None:
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _start(self, backend: Backend) -> asyncio.Task[PrefillCoordinates]:
        assert backend.daemon_url is not None
        task = self._inflight.get(backend.url)
        if task is None:
            task = asyncio.create_task(self._fetch(backend.daemon_url))
            self._inflight[backend.url] = task
            task.add_done_callback(lambda t: self._settle(backend, t))
        return task

    def _settle(self, backend: Backend, task: asyncio.Task[PrefillCoordinates]) -> None:
        self._inflight.pop(backend.url, None)
        # Retrieve the exception even if every waiter left, so asyncio does not log it.
        if not task.cancelled() and task.exception() is None:
            backend.coordinates = task.result()
