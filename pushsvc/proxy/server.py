"""The proxy's aiohttp application and its lifecycle: routes, the middleware that counts
every request and answers aiohttp's own errors in OpenAI's JSON, the listening server,
and ``run_proxy`` (serve until SIGINT or SIGTERM, then drain). The handlers are ``app.py``.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any, Self

from aiohttp import hdrs, web

from pushsvc.config import read_secret_file
from pushsvc.logging import get_logger
from pushsvc.proxy import legs
from pushsvc.proxy.admin import Admin
from pushsvc.proxy.app import Proxy, error_response
from pushsvc.proxy.config import ProxyConfig
from pushsvc.proxy.tracing import ExchangeTracer, otlp_provider

_log = get_logger("pushsvc.proxy")
_STATUS_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "method_not_allowed",
    413: "request_too_large",
}


PROXY = web.AppKey("proxy", Proxy)


@web.middleware
async def _observe(request: web.Request, handler: Any) -> web.StreamResponse:
    """Count every request by route and status; turn aiohttp's own errors into OpenAI JSON."""
    proxy = request.app[PROXY]
    endpoint = getattr(request.match_info.route, "name", None) or "unknown"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        message = {404: f"no route for {request.path}", 405: f"{request.method} not allowed on {request.path}"}
        response = error_response(exc.status, message.get(exc.status) or exc.text or exc.reason,
                                  _STATUS_TYPES.get(exc.status, "proxy_error"))
        if hdrs.ALLOW in exc.headers:
            response.headers[hdrs.ALLOW] = exc.headers[hdrs.ALLOW]
        return response
    except asyncio.CancelledError:
        status = 499  # the client left (or the server is shutting down)
        raise
    except Exception:  # noqa: BLE001 - answer a bug with an error JSON, not a dropped connection
        _log.exception("proxy_error", endpoint=endpoint, path=request.path)
        return error_response(500, "internal proxy error", "proxy_error")
    finally:
        proxy.metrics.requests.labels(endpoint, str(status)).inc()


def build_app(config: ProxyConfig, tracer: ExchangeTracer | None = None) -> web.Application:
    """The proxy's aiohttp application; its backend session lives from startup to cleanup.
    ``tracer``: where exchange spans go (default: ``--otlp-traces-endpoint``'s exporter if
    set, else OpenTelemetry's global provider)."""
    if tracer is None and config.otlp_traces_endpoint:
        tracer = ExchangeTracer(otlp_provider(config.otlp_traces_endpoint))
    proxy = Proxy(config, tracer)
    app = web.Application(middlewares=[_observe], client_max_size=config.max_body_bytes)
    app[PROXY] = proxy
    app.router.add_post("/v1/completions", proxy.completions, name=legs.COMPLETIONS)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions, name=legs.CHAT)
    app.router.add_get("/v1/models", proxy.models, name="models")
    app.router.add_get("/healthz", proxy.healthz, name="healthz")
    app.router.add_get("/metrics", proxy.metrics_text, name="metrics")
    token = read_secret_file(config.admin_token_file, "admin_token_file") if config.admin_token_file else None
    Admin([proxy.prefill, proxy.decode], proxy.metrics, token, forget=proxy.prefixes.forget).add_routes(app)
    app.on_startup.append(proxy.startup)
    app.on_cleanup.append(proxy.cleanup)
    return app


class ProxyServer:
    """Owns the listening socket and the app's lifecycle; ``start`` and ``close`` are idempotent."""

    def __init__(self, config: ProxyConfig, tracer: ExchangeTracer | None = None) -> None:
        self.config = config
        self.app = build_app(config, tracer)
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def proxy(self) -> Proxy:
        return self.app[PROXY]

    async def start(self) -> int:
        if self._runner is not None:
            return self.port
        # handler_cancellation: a client that leaves cancels its handler at once, which
        # closes both legs, instead of only when the next write to it fails.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=self.config.drain_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await self.close()
            raise
        sockets = site._server.sockets if site._server else ()  # aiohttp exposes no public accessor
        self.port = sockets[0].getsockname()[1] if sockets else self.config.port
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<ProxyServer {self.config.host}:{self.port} running={self._runner is not None}>"


def run_proxy(config: ProxyConfig) -> int:
    """Serve until SIGINT or SIGTERM; 0 after a drain, 1 if it cannot listen (or export
    its traces where ``otlp_traces_endpoint`` asks)."""
    import uvloop

    return uvloop.run(_serve(config))


async def _serve(config: ProxyConfig) -> int:
    try:
        server = ProxyServer(config)
    except RuntimeError as exc:  # the OTLP exporter cannot be set up (tracing.otlp_provider)
        print(f"pushsvc: cannot start proxy: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)  # only flips a flag; the drain below is bounded
    try:
        port = await server.start()
    except OSError as exc:
        print(f"pushsvc: cannot start proxy: {exc}", file=sys.stderr)
        return 1
    _log.info("proxy_started", host=config.host, port=port, prefill=config.prefill, decode=config.decode)
    try:
        await stop.wait()
        _log.info("proxy_stopping", drain_timeout_s=config.drain_timeout_s)
    finally:
        await server.close()
    return 0
