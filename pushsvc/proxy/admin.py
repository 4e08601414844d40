"""Operator actions on the proxy's backends: take one out (drain) and put it back (resume).

    POST /admin/drain    {"backend": "<base URL as given to --prefill/--decode>"}
    POST /admin/resume   {"backend": "<base URL>"}
    GET  /admin/backends

A drained backend gets no new request, healthy or not, until it is resumed; what it has
in flight finishes (its ``outstanding`` in the answer counts down to 0: then it may be
stopped, upgraded, restarted; the prompt prefixes the proxy sent to it are forgotten, as
its cache may not outlive the work). Drain and resume answer with the backend as ``/healthz``
describes it, plus its role. Draining every backend of a role makes new requests fail with
503 and ``/healthz`` say unavailable: the operator asked for it.

Who may call: with ``admin_token_file``, a client sending ``Authorization: Bearer <token>``
(compared in constant time); without one, loopback clients only. Whoever reaches these
routes can take every backend out, so a proxy listening beyond loopback must not serve
them to anyone who can send a generation request.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import hdrs, web

from pushsvc.errors import ConfigError
from pushsvc.logging import get_logger
from pushsvc.peer_hosts import parse_address
from pushsvc.proxy.backends import Backend, BackendPool
from pushsvc.proxy.config import normalize_url
from pushsvc.proxy.metrics import ProxyMetrics

_log = get_logger("pushsvc.proxy.admin")

MAX_BODY_BYTES = 4096
DRAIN, RESUME = "drain", "resume"


class BackendRef(msgspec.Struct, forbid_unknown_fields=True):
    backend: str


_decoder = msgspec.json.Decoder(BackendRef)


class Admin:
    def __init__(self, pools: list[BackendPool], metrics: ProxyMetrics, token: bytes | None,
                 forget: Callable[[Backend], None] = lambda _backend: None) -> None:
        """``forget``: called for a backend as it is drained (the proxy drops the prompt
        prefixes it routed there: a drain usually comes before a restart)."""
        self._pools = pools
        self._forget = forget
        self._metrics = metrics
        self._expected = b"Bearer " + token if token else None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/drain", self.drain, name="admin_drain")
        app.router.add_post("/admin/resume", self.resume, name="admin_resume")
        app.router.add_get("/admin/backends", self.backends, name="admin_backends")

    async def drain(self, request: web.Request) -> web.Response:
        return await self._act(request, DRAIN)

    async def resume(self, request: web.Request) -> web.Response:
        return await self._act(request, RESUME)

    async def backends(self, request: web.Request) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            return refused
        return web.json_response([_describe(b) for pool in self._pools for b in pool])

    async def _act(self, request: web.Request, action: str) -> web.Response:
        refused = self._refusal(request)
        if refused is not None:
            self._metrics.admin_actions.labels(action, "unauthorized").inc()
            return refused
        body = await request.content.read(MAX_BODY_BYTES + 1)
        if len(body) > MAX_BODY_BYTES:
            return self._bad(action, 413, f"body over {MAX_BODY_BYTES} bytes")
        try:
            url = normalize_url("backend", _decoder.decode(body).backend)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._bad(action, 400, f'expected {{"backend": "<base URL>"}}: {exc}')
        except ConfigError as exc:
            return self._bad(action, 400, str(exc))
        found = [b for pool in self._pools if (b := pool.find(url)) is not None]
        if not found:
            return self._bad(action, 404, f"no backend {url}")
        for backend in found:  # one URL may serve as P and as D
            was = backend.draining
            backend.draining = action == DRAIN
            if backend.draining:
                self._forget(backend)
            if was != backend.draining:
                _log.warning("backend_drained" if action == DRAIN else "backend_resumed", backend=backend.url,
                             role=backend.role, outstanding=backend.outstanding, client=request.remote)
        self._metrics.admin_actions.labels(action, "ok").inc()
        answer: Any = [_describe(b) for b in found]
        return web.json_response(answer[0] if len(answer) == 1 else answer)

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self._expected is not None:
            given = request.headers.get(hdrs.AUTHORIZATION, "").encode("latin-1", "replace")
            if hmac.compare_digest(given, self._expected):
                return None
            _log.warning("admin_unauthorized", path=request.path[:100], client=request.remote)
            return web.json_response({"error": "the admin endpoints need Authorization: Bearer <admin token>"},
                                     status=401, headers={hdrs.WWW_AUTHENTICATE: 'Bearer realm="pushsvc-proxy"'})
        address = parse_address(request.remote or "")
        if address is not None and address.is_loopback:
            return None
        _log.warning("admin_refused", path=request.path[:100], client=request.remote)
        return web.json_response({"error": "the admin endpoints answer loopback clients only unless the proxy has "
                                           "an admin token (--admin-token-file)"}, status=403)

    def _bad(self, action: str, status: int, message: str) -> web.Response:
        self._metrics.admin_actions.labels(action, "bad_request").inc()
        return web.json_response({"error": message}, status=status)


def _describe(backend: Backend) -> dict[str, Any]:
    return {"role": backend.role, **backend.describe()}
