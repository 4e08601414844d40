"""HTTP health, readiness, metrics and info, for operators and proxies (aiohttp).

Bound to loopback by default; beyond it a bearer token is required (``health_token_file``)
for everything but the probes: ``/healthz`` and ``/readyz`` say only up or ready, so the
kubelet needs no secret, while ``/metrics``, ``/v1/info`` and ``/v1/requests`` answer 401
without ``Authorization: Bearer <token>``. ``/healthz`` answers while the event loop runs;
``/readyz`` only once the worker socket listens, the side channel is up, the daemon
is not shutting down, and every rank that said hello has its KV memory registered.

Slow or flooding clients must not starve the probes. A connection that has not finished a
request within ``idle_timeout_s`` of opening (or of its last answer) is closed, however
slowly it trickles header bytes; at most ``max_connections`` are open at once and a new
one closes the oldest that holds no complete request. The listen backlog stays short:
a flooder then waits for SYN retransmits, while a deep queue (measured with 4096) makes
every probe wait behind thousands of dead connections, about a second on a loaded host.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, Protocol

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST

from pushsvc.metrics import Metrics

log = structlog.get_logger("pushsvc.health")

# Probes and scrapes open a connection, ask, and go; nothing legitimate idles for long.
IDLE_TIMEOUT_S = 10.0
# A memory bound (a few KiB each), not a fairness tool: below it idle connections cost
# nothing but an fd, while above it every new connection closes an old one, which a client
# that reconnects at once turns into a connect flood.
MAX_CONNECTIONS = 1024
_BACKLOG = 128
MAX_REQUESTS_LIMIT = 10_000
OPEN_PATHS = frozenset({"/healthz", "/readyz"})  # probes: never behind the token


class HealthSource(Protocol):
    def readiness(self) -> tuple[bool, dict[str, Any]]: ...
    def info(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...
    def requests(self, limit: int, request_id: str) -> list[dict[str, Any]]: ...


class HealthServer:
    def __init__(self, source: HealthSource, host: str, port: int, metrics: Metrics | None = None, *,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 token: bytes | None = None) -> None:
        self._source = source
        self._expected = b"Bearer " + token if token else None
        self._host = host
        self._port = port
        self._counters = metrics
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self._dropped: set[RequestHandler] = set()

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self._expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode("latin-1", "replace")
            if not hmac.compare_digest(given, self._expected):
                if self._counters is not None:
                    self._counters.rejected_connections.labels("health", "unauthorized").inc()
                log.warning("health_unauthorized", path=request.path[:100], peer=request.remote)
                return web.json_response({"error": "this path needs Authorization: Bearer <health token>"},
                                         status=401, headers={"WWW-Authenticate": 'Bearer realm="pushsvc"'})
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._authorize])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/info", self._info)
        app.router.add_get("/v1/requests", self._requests)
        return app

    async def start(self) -> int:
        # aiohttp 3.14 starts the keep-alive timer when the connection opens and does not
        # move it while a request trickles in: it bounds idle and slowloris connections alike.
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False,
                                     keepalive_timeout=self._idle_timeout_s)
        await self._runner.setup()
        # Our own listener instead of a TCPSite: every new connection passes through
        # ``_new_connection``, which enforces the cap.
        self._listener = await asyncio.get_running_loop().create_server(
            self._new_connection, self._host, self._port, backlog=_BACKLOG, reuse_address=True)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self.port

    def _new_connection(self) -> RequestHandler:
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        try:
            self._make_room(server)
        except Exception:
            # uvloop stops accepting for good when a protocol factory raises: a bug in
            # the cap must cost the cap, not the health endpoint.
            log.exception("health_cap_failed")
        return server()

    def _make_room(self, server: web.Server) -> None:
        conns = server.connections  # oldest first
        # Closed handlers stay listed until their task ends; count each one once.
        self._dropped.intersection_update(conns)
        live = [h for h in conns if h not in self._dropped]
        excess = len(live) + 1 - self._max_connections
        for old in live:
            if excess <= 0:
                break
            if _is_idle(old):
                old.force_close()
                self._dropped.add(old)
                excess -= 1
                if self._counters is not None:
                    self._counters.rejected_connections.labels("health", "oldest_idle_dropped").inc()

    @property
    def open_connections(self) -> int:
        server = self._runner.server if self._runner is not None else None
        return 0 if server is None else sum(1 for h in server.connections if h not in self._dropped)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        ready, detail = self._source.readiness()
        return web.json_response({"ready": ready, **detail}, status=200 if ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._source.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(self._source.info())

    async def _requests(self, request: web.Request) -> web.Response:
        """The recent request timelines, newest first: ``?limit=`` (1..10000, default 100),
        ``?request_id=`` (either side's id)."""
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_REQUESTS_LIMIT:
            return web.json_response({"error": f"limit must be an integer in 1..{MAX_REQUESTS_LIMIT}"}, status=400)
        request_id = request.query.get("request_id", "")[:1024]
        return web.json_response({"timelines": self._source.requests(limit, request_id)})


def _is_idle(handler: RequestHandler) -> bool:
    """No complete request queued and none being answered: an idle keep-alive connection,
    one that never sent a byte, or one still trickling its headers. aiohttp has no public
    accessor for this; ``tests/unit/test_health_flood.py`` pins the behaviour."""
    return not getattr(handler, "_request_in_progress", False) and not getattr(handler, "_messages", ())
