"""HTTP health, readiness, metrics and info, for operators and proxies (aiohttp).

Bound to loopback by default. ``/healthz`` answers while the event loop runs;
``/readyz`` only once the worker socket listens, the side channel is up, the daemon
is not shutting down, and every rank that said hello has its KV memory registered.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST


class HealthSource(Protocol):
    def readiness(self) -> tuple[bool, dict[str, Any]]: ...
    def info(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...


class HealthServer:
    def __init__(self, source: HealthSource, host: str, port: int) -> None:
        self._source = source
        self._host = host
        self._port = port
        self.port = 0
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/info", self._info)
        return app

    async def start(self) -> int:
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        sockets = site._server.sockets if site._server else ()  # aiohttp exposes no public accessor
        self.port = sockets[0].getsockname()[1] if sockets else self._port
        return self.port

    async def close(self) -> None:
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
