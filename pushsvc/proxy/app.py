"""The proxy's request handling (aiohttp handlers): the P/D exchange, backends, probes.
The application, its middleware and the server lifecycle are ``server.py``.

One exchange per generation request. Both legs start together: P computes the prompt's KV
while D allocates blocks and its daemon registers them with P's (push mode). The client
gets D's answer. Until D has produced its first bytes, either leg failing ends the
exchange: the other leg's connection is closed (vLLM aborts a request whose client left)
and the client gets the failed leg's status. Once D has answered, P no longer matters.

D's leg names P's daemon. With ``--prefill-daemon`` the proxy asks that daemon
(``/v1/info``); without, P's answers say it (P's connector returns its daemon's
coordinates in every answer's ``kv_transfer_params``): for a P whose coordinates the proxy
does not know yet (the first exchange, or the first after a failure), D's leg waits for
P's answer; after that both legs start together again, and every P answer refreshes what
is kept. A P that answers without usable coordinates fails that exchange (502).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import aiohttp
import msgspec
from aiohttp import hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST

from pushsvc.config import read_secret_file
from pushsvc.logging import get_logger
from pushsvc.proxy import legs
from pushsvc.proxy.affinity import PrefixMap, prefix_keys, prompt_text
from pushsvc.proxy.backends import (
    DECODE,
    PREFILL,
    Backend,
    BackendPool,
    DaemonInfoCache,
    NoBackend,
)
from pushsvc.proxy.config import ProxyConfig
from pushsvc.proxy.legs import PrefillCoordinates
from pushsvc.proxy.metrics import PHASES, ProxyMetrics
from pushsvc.proxy.tracing import ExchangeTracer
from pushsvc.proxy.upstream import (
    CONNECT,
    PROTOCOL,
    UpstreamError,
    fetch_coordinates,
    probe,
    reuse_tracing,
    status_error,
    translate,
)
from pushsvc.proxy.upstream import post as upstream_post  # beside aiohttp's session.post

_log = get_logger("pushsvc.proxy")

# What a failed call to a backend raised before ``translate`` names it.
_CALL_ERRORS = (aiohttp.ClientError, TimeoutError)
# A client that left shows up as one of these when we write to it.
_CLIENT_GONE = (ConnectionError, aiohttp.ClientConnectionResetError)
BACKEND_KEEPALIVE_S = 4.0


@dataclass
class Exchange:
    """One client request and the two backends serving it."""

    request_id: str
    transfer_id: str  # the match key both legs carry; unique per exchange, unlike request_id
    endpoint: str
    body: dict[str, Any]
    prefill: Backend
    decode: Backend
    headers: dict[str, str]  # sent on both legs
    log: Any
    started: float = field(default_factory=time.monotonic)
    ttft_s: float | None = None
    wall: float = field(default_factory=time.time)  # the wall-clock time of ``started``
    # Seconds since ``started`` of each moment of the exchange (the proxy's side of a
    # request's timeline, docs/proxy.md), each recorded at its first time.
    moments: dict[str, float] = field(default_factory=dict)
    # Why P's leg could not connect, if that is how the exchange failed: P got nothing and
    # neither did the client, so another P may take the request (``_generate``).
    prefill_unreachable: str = ""

    def mark(self, moment: str) -> None:
        self.moments.setdefault(moment, time.monotonic() - self.started)


@dataclass
class Streaming:
    """D accepted a streamed request and sent its first bytes; the response is ours to close."""

    response: aiohttp.ClientResponse
    first: bytes


@dataclass
class Completed:
    """D's whole non-streamed answer."""

    status: int
    content_type: str
    body: bytes


class Proxy:
    """State of one proxy app: backend pools, the backend session, metrics, the probe."""

    def __init__(self, config: ProxyConfig, tracer: ExchangeTracer | None = None) -> None:
        self.config = config
        self.tracer = tracer or ExchangeTracer()
        self.prefill = BackendPool(
            [Backend(url, PREFILL, daemon_url=daemon)
             for url, daemon in zip(config.prefill, config.prefill_daemon or [None] * len(config.prefill))]
        )
        self.decode = BackendPool([Backend(url, DECODE) for url in config.decode])
        self.prefixes: PrefixMap[Backend] = PrefixMap()
        self.metrics = ProxyMetrics()
        self.infos = DaemonInfoCache(self._fetch_coordinates)
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None  # no pooling: a POST's second try
        self._probe_task: asyncio.Task[None] | None = None
        # ``sock_connect`` rather than ``connect``: waiting for a pooled connection is not
        # the backend's fault.
        self._call_timeout = aiohttp.ClientTimeout(total=config.timeout_s, sock_connect=config.connect_timeout_s)
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.timeout_s
        )
        self._probe_timeout = aiohttp.ClientTimeout(total=config.connect_timeout_s)
        token = config.prefill_daemon_token_file
        self._daemon_headers = ({"Authorization": "Bearer " + read_secret_file(token, "prefill_daemon_token_file")
                                 .decode("latin-1")} if token else None)

    # ------------------------------------------------------------ lifecycle

    async def startup(self, app: web.Application) -> None:
        # vLLM's uvicorn drops idle keep-alive connections after 5 s, so pooled connections
        # are given up a little earlier; a server whose loop is held up closes late, and a
        # POST sent meanwhile fails: it goes again on a new connection (``upstream.post``).
        connector = aiohttp.TCPConnector(limit=self.config.max_connections, keepalive_timeout=BACKEND_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, trace_configs=[reuse_tracing()])
        self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.config.max_connections,
                                                                           force_close=True))
        if self.config.health_interval_s > 0:
            self._probe_task = asyncio.create_task(self._probe_loop())

    async def cleanup(self, app: web.Application) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.wait([self._probe_task])
            self._probe_task = None
        await self.infos.close()
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "proxy app not started"
        return self._session

    async def _post(self, ex: Exchange, leg: str, backend: Backend, data: bytes,
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """One leg's POST to ``backend``; sent again on a new connection where the pooled
        one turned out closed by the backend (``upstream.post``)."""
        def again(exc: BaseException) -> None:
            self.metrics.stale_connections.labels(leg).inc()
            ex.log.info("backend_connection_stale", leg=leg, backend=backend.url, error=str(exc) or type(exc).__name__)

        assert self._fresh is not None, "proxy app not started"
        return await upstream_post(self.session, self._fresh, backend.url + legs.PATHS[ex.endpoint], again, data=data,
                                   headers=ex.headers, timeout=timeout, allow_redirects=False)

    # ------------------------------------------------------------ routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, legs.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, legs.CHAT)

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            backend = self.decode.pick()
        except NoBackend as exc:
            return self._no_backend(exc, None, "models")
        try:
            async with self.session.get(
                f"{backend.url}/v1/models", headers=_auth(request), timeout=self._call_timeout, allow_redirects=False
            ) as response:
                body = await response.read()
                ctype = response.headers.get(hdrs.CONTENT_TYPE, "application/json")
                return web.Response(status=response.status, body=body, headers={hdrs.CONTENT_TYPE: ctype})
        except _CALL_ERRORS as exc:
            err = translate(exc, "models", backend.url, what="decode backend")
            self._count_failure(err, backend, _log.bind(endpoint="models"), phase="models")
            return error_response(err.status, err.message, err.type)
        finally:
            self.decode.release(backend)

    async def healthz(self, request: web.Request) -> web.Response:
        ok = self.prefill.any_healthy() and self.decode.any_healthy()
        doc = {"status": "ok" if ok else "unavailable", "prefill": self.prefill.describe(),
               "decode": self.decode.describe()}
        return web.json_response(doc, status=200 if ok else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        for pool in (self.prefill, self.decode):
            for b in pool:
                self.metrics.outstanding.labels(b.role, b.url).set(b.outstanding)
                self.metrics.healthy.labels(b.role, b.url).set(1 if b.healthy else 0)
                self.metrics.draining.labels(b.role, b.url).set(1 if b.draining else 0)
        return web.Response(body=self.metrics.render(), headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------ the exchange

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        started = time.monotonic()
        try:
            request_id = legs.request_id(request.headers)
        except legs.BadRequestId as exc:
            return self._refuse_request_id(request, endpoint, exc)
        try:
            body = legs.parse_body(await request.read())
        except legs.BadRequestBody as exc:
            return error_response(400, str(exc), "invalid_request_error", request_id)
        headers = {legs.REQUEST_ID_HEADER: request_id, hdrs.CONTENT_TYPE: "application/json", **_auth(request)}
        arrival = time.time() - (time.monotonic() - started)
        span = self.tracer.start(request.headers, arrival, {"pushsvc.request_id": request_id,
                                                             "pushsvc.endpoint": endpoint})
        self.tracer.inject(span, headers)  # both legs: vLLM's spans join the exchange's trace
        transfer_id = legs.mint_transfer_id()
        try:
            prefill, decode = self._pick_pair(endpoint, body)
        except NoBackend as exc:
            self.tracer.end(span, arrival, {"done": time.monotonic() - started}, 503, {})
            return self._no_backend(exc, request_id, endpoint)
        log = _log.bind(request_id=request_id, transfer_id=transfer_id, endpoint=endpoint)
        ex = Exchange(request_id, transfer_id, endpoint, body, prefill, decode, headers, log, started, wall=arrival)
        status = 499  # unless a response is returned below: the client left
        try:
            attempts = len(self.prefill.backends)
            for attempt in range(1, attempts + 1):
                response = await self._exchange(request, ex)
                if not ex.prefill_unreachable or attempt == attempts or not self.prefill.any_healthy():
                    break
                # P refused the connection (a P taken out before the probe saw it): it got
                # nothing, nor did the client, and D's leg is closed (D let go of its
                # registration). Another P takes the request, with a new match key.
                try:
                    pair = self._pick_pair(endpoint, body)
                except NoBackend:  # drained meanwhile: the client gets P's failure
                    break
                self.metrics.prefill_retries.inc()
                log.warning("prefill_retry", backend=prefill.url, attempt=attempt, error=ex.prefill_unreachable)
                self.decode.release(decode)
                transfer_id = legs.mint_transfer_id()
                prefill, decode = pair
                log = _log.bind(request_id=request_id, transfer_id=transfer_id, endpoint=endpoint)
                ex = Exchange(request_id, transfer_id, endpoint, body, prefill, decode, headers, log, started, wall=arrival)
            status = response.status
            return response
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client disconnects (handler_cancellation),
            # or at shutdown after the drain; unwinding _exchange has closed both legs.
            log.info("request_cancelled", backend=decode.url, phase="stream" if ex.ttft_s else "before_answer")
            raise
        finally:
            self.decode.release(decode)
            total = time.monotonic() - started
            self.metrics.request_seconds.labels(endpoint).observe(total)
            ex.moments["done"] = total
            self._timeline(ex, status)
            self.tracer.end(span, arrival, ex.moments, status, {
                "pushsvc.transfer_id": ex.transfer_id, "pushsvc.prefill": prefill.url, "pushsvc.decode": decode.url})
            log.debug("request_done", status=status, prefill=prefill.url, decode=decode.url,
                      ttft_s=ex.ttft_s, total_s=round(total, 6))

    def _timeline(self, ex: Exchange, status: int) -> None:
        """The exchange's moments: the phase histogram and one ``request_timeline`` event."""
        m = ex.moments
        for phase, (a, b) in PHASES.items():
            # Not every exchange has every moment, nor in this order: D may answer before
            # P does (D computed the prompt itself after a failed transfer, say).
            start = m.get(a) if a else 0.0
            if b in m and start is not None and m[b] >= start:
                self.metrics.phase_seconds.labels(phase).observe(m[b] - start)
        ex.log.info("request_timeline", side="proxy", status=status,
                    start=datetime.fromtimestamp(ex.wall, timezone.utc).isoformat(),
                    events_ms={k: round(v * 1e3, 3) for k, v in sorted(m.items(), key=lambda kv: kv[1])})

    async def _exchange(self, request: web.Request, ex: Exchange) -> web.StreamResponse:
        p_task = asyncio.create_task(self._prefill_leg(ex))
        # A done callback runs even if the task is cancelled before it starts.
        p_task.add_done_callback(lambda _: self.prefill.release(ex.prefill))
        d_task: asyncio.Task[Streaming | Completed] | None = None
        try:
            try:
                coords = await self._coordinates(ex, p_task)
            except UpstreamError as err:
                return self._fail(ex, err)
            d_task = asyncio.create_task(self._decode_leg(ex, coords))
            try:
                start = await _first_answer(p_task, d_task)
            except UpstreamError as err:
                return self._fail(ex, err)
            if isinstance(start, Completed):
                return web.Response(status=start.status, body=start.body, headers={
                    hdrs.CONTENT_TYPE: start.content_type, legs.REQUEST_ID_HEADER: ex.request_id})
            return await self._stream(request, ex, start)
        finally:
            # Closing a leg's connection is how vLLM learns to abort it.
            if d_task is not None:
                await _stop(d_task)
                if not d_task.cancelled() and d_task.exception() is None:
                    result = d_task.result()
                    if isinstance(result, Streaming):  # idempotent if _stream closed it already
                        result.response.close()
            await _stop(p_task)

    async def _coordinates(self, ex: Exchange, p_task: asyncio.Task[PrefillCoordinates | None]) -> PrefillCoordinates:
        """Where D's leg sends D's daemon: P's daemon's ``/v1/info`` (``--prefill-daemon``),
        else what P last answered, else (nothing known about this P) P's answer to this
        exchange's leg, which then runs alone first. Raises UpstreamError, already counted."""
        backend = ex.prefill
        if backend.daemon_url is not None:
            try:
                return await self.infos.get(backend)
            except UpstreamError as err:
                self._count_failure(err, backend, ex.log, phase="daemon_info")
                raise
        if backend.coordinates is not None:
            return backend.coordinates
        coords = await p_task  # P's UpstreamError propagates; the leg counted it
        assert coords is not None, "a P without a daemon URL answers with coordinates or fails"
        return coords

    async def _prefill_leg(self, ex: Exchange) -> PrefillCoordinates | None:
        """P's leg; the coordinates P's answer gave when P has no ``--prefill-daemon``."""
        backend = ex.prefill
        data = legs.encode_body(legs.prefill_body(ex.body, ex.endpoint, ex.transfer_id))
        try:
            async with await self._post(ex, PREFILL, backend, data, self._call_timeout) as response:
                if not 200 <= response.status < 300:
                    raise await status_error(PREFILL, response)
                # One token, discarded (P's work is the KV it pushes), and P's coordinates.
                raw = await response.read()
                ex.mark("prefill_answered")
        except _CALL_ERRORS as exc:
            err = translate(exc, PREFILL, backend.url)
            self._count_failure(err, backend, ex.log, phase="prefill")
            raise err from None
        except UpstreamError as err:
            self._count_failure(err, backend, ex.log, phase="prefill")
            raise
        backend.mark_ok()
        if backend.daemon_url is not None:
            return None  # its daemon says where it is; the answer is not consulted
        return self._learn(ex, raw)

    def _learn(self, ex: Exchange, raw: bytes) -> PrefillCoordinates:
        """P's daemon coordinates from P's answer, kept for the next exchanges with P.

        Every answer refreshes them (a restarted daemon has a new side-channel port). A P
        that lies can only misdirect D's daemon, which then fails to handshake or to pair
        there (docs/routers.md, "Trust"); a P that answers without them fails this exchange.
        """
        backend = ex.prefill
        try:
            coords = legs.answered_coordinates(raw, ex.transfer_id)
        except legs.BadPrefillAnswer as exc:
            err = UpstreamError(PREFILL, PROTOCOL, 502,
                                f"prefill backend {backend.url} did not say where its daemon is: {exc}")
            self._count_failure(err, backend, ex.log, phase="prefill_coordinates")
            raise err from None
        if coords != backend.coordinates:
            previous = backend.coordinates
            ex.log.info("prefill_coordinates_learned", backend=backend.url, engine_id=coords.engine_id,
                        host=coords.side_channel_host, port=coords.side_channel_port, tp_size=coords.tp_size,
                        previous=None if previous is None else msgspec.structs.asdict(previous))
            backend.coordinates = coords
        return coords

    async def _decode_leg(self, ex: Exchange, coords: PrefillCoordinates) -> Streaming | Completed:
        backend = ex.decode
        stream = legs.is_stream(ex.body)
        data = legs.encode_body(legs.decode_body(ex.body, coords, self.config.remote_tp_size, ex.transfer_id))
        response: aiohttp.ClientResponse | None = None
        try:
            response = await self._post(ex, DECODE, backend, data,
                                        self._stream_timeout if stream else self._call_timeout)
            if not 200 <= response.status < 300:
                raise await status_error(DECODE, response)
            ex.mark("decode_answered")
            if stream:
                first = await response.content.readany()
                ex.mark("decode_first_chunk")
                started, response = Streaming(response, first), None  # the caller closes it now
                backend.mark_ok()
                return started
            body = await response.read()
            ex.mark("decode_first_chunk")  # the whole answer: its first token came with it
            backend.mark_ok()
            return Completed(response.status, response.headers.get(hdrs.CONTENT_TYPE, "application/json"), body)
        except _CALL_ERRORS as exc:
            err = translate(exc, DECODE, backend.url)
            self._count_failure(err, backend, ex.log, phase="decode")
            raise err from None
        except UpstreamError as err:
            self._count_failure(err, backend, ex.log, phase="decode")
            raise
        finally:
            if response is not None:
                # Fully read: the connection is back in the pool and this is a no-op.
                # Otherwise (error, cancelled): the connection is closed.
                response.close()

    async def _stream(self, request: web.Request, ex: Exchange, start: Streaming) -> web.StreamResponse:
        upstream = start.response
        try:
            out = web.StreamResponse(status=upstream.status, headers={
                hdrs.CONTENT_TYPE: upstream.headers.get(hdrs.CONTENT_TYPE, "text/event-stream"),
                legs.REQUEST_ID_HEADER: ex.request_id,
            })
            chunk = start.first
            try:
                await out.prepare(request)
                while chunk:
                    await out.write(chunk)
                    if ex.ttft_s is None:
                        ex.mark("first_chunk_sent")
                        ex.ttft_s = round(time.monotonic() - ex.started, 6)
                        self.metrics.ttft_seconds.labels(ex.endpoint).observe(ex.ttft_s)
                    try:
                        chunk = await upstream.content.readany()
                    except _CALL_ERRORS as exc:
                        # Too late to change the status: tell the client inside the stream.
                        err = translate(exc, DECODE, ex.decode.url)
                        self._count_failure(err, ex.decode, ex.log, phase="decode_stream")
                        await out.write(legs.error_sse_event(err.message, err.type, err.status))
                        break
                await out.write_eof()
            except _CLIENT_GONE:
                ex.log.info("client_disconnected", phase="stream", backend=ex.decode.url)
            return out
        finally:
            upstream.close()

    def _refuse_request_id(self, request: web.Request, endpoint: str, exc: legs.BadRequestId) -> web.Response:
        # Refused before any backend sees it: an id longer than the daemons take got no
        # answer at all (not an error) once it had reached them.
        self.metrics.request_id_refused.labels(exc.reason).inc()
        given = request.headers.get(legs.REQUEST_ID_HEADER, "").strip()
        _log.info("request_id_refused", endpoint=endpoint, reason=exc.reason, length=len(given),
                  head=given[:48].encode("ascii", "backslashreplace").decode("ascii"))
        # No X-Request-Id on this answer: the client's may not even be sendable back.
        return error_response(400, str(exc), "invalid_request_error")

    def _fail(self, ex: Exchange, err: UpstreamError) -> web.Response:
        # Even when D failed: a D that cannot reach P's daemon may have stale coordinates.
        self.infos.invalidate(ex.prefill)
        if err.leg == PREFILL and err.kind == CONNECT:
            ex.prefill_unreachable = err.message
        return error_response(err.status, err.message, err.type, ex.request_id)

    def _pick_pair(self, endpoint: str, body: dict[str, Any]) -> tuple[Backend, Backend]:
        """A P and a D for one exchange, each counted; ``NoBackend`` with neither counted."""
        prefill = self._pick_prefill(endpoint, body)
        try:
            return prefill, self.decode.pick()
        except NoBackend:
            self.prefill.release(prefill)
            raise

    def _no_backend(self, exc: NoBackend, request_id: str | None, endpoint: str) -> web.Response:
        self.metrics.no_backend.labels(exc.role).inc()
        _log.warning("no_backend", request_id=request_id, endpoint=endpoint, role=exc.role)
        return error_response(503, str(exc), "service_unavailable", request_id)

    def _pick_prefill(self, endpoint: str, body: dict[str, Any]) -> Backend:
        """Least outstanding, or the P that took this prompt's start while it is not much
        busier (``affinity.py``); that P then holds the prompt's prefixes."""
        slack = self.config.prefix_affinity_slack
        if slack < 0 or len(self.prefill.backends) == 1:
            return self.prefill.pick()
        keys = prefix_keys(prompt_text(endpoint, body))
        preferred = self.prefixes.lookup(keys)
        backend = self.prefill.pick(preferred, slack)
        result = "short" if not keys else "miss" if preferred is None else "hit" if backend is preferred \
            else "overloaded"
        self.metrics.prefix_affinity.labels(result).inc()
        self.prefixes.remember(keys, backend)
        return backend

    def _count_failure(self, err: UpstreamError, backend: Backend, log: Any, phase: str) -> None:
        self.metrics.backend_errors.labels(err.leg, err.kind).inc()
        log.warning("backend_failed", phase=phase, backend=backend.url, kind=err.kind, status=err.status,
                    error=err.message)
        if err.unreachable:
            backend.mark_failed(err.message)
            self.prefixes.forget(backend)  # when it is back, it is a new process with an empty cache
        if backend.role == PREFILL:
            # P (or its daemon) may have restarted with another engine id or port.
            self.infos.invalidate(backend)

    # ------------------------------------------------------------ health probe

    async def _fetch_coordinates(self, daemon_url: str) -> PrefillCoordinates:
        return await fetch_coordinates(self.session, daemon_url, self._call_timeout, self._daemon_headers)

    async def _probe_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._probe(b) for b in [*self.prefill, *self.decode]))
            except Exception:  # noqa: BLE001 - a bug here must not end probing for the proxy's lifetime
                _log.exception("probe_failed", phase="probe")
            await asyncio.sleep(self.config.health_interval_s)

    async def _probe(self, backend: Backend) -> None:
        problem = await probe(self.session, f"{backend.url}/health", self._probe_timeout)
        if not problem and backend.role == PREFILL and backend.daemon_url is not None:
            # P is useless for P/D without its daemon; asking also refreshes the coordinates.
            try:
                await self.infos.refresh(backend)
            except UpstreamError as err:
                problem = err.message
        if problem:
            if backend.healthy:
                _log.warning("backend_unhealthy", phase="probe", backend=backend.url, error=problem)
                self.prefixes.forget(backend)  # back, it is a new process with an empty cache
            backend.mark_failed(problem)
        else:
            if not backend.healthy:
                _log.info("backend_healthy", phase="probe", backend=backend.url)
            backend.mark_ok()


async def _first_answer(
    p_task: asyncio.Task[PrefillCoordinates | None], d_task: asyncio.Task[Streaming | Completed]
) -> Streaming | Completed:
    """D's start, unless a leg fails first. Raises the failed leg's UpstreamError."""
    await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
    if d_task.done() and d_task.exception() is None:
        return d_task.result()  # D answered, so it has P's KV; P's outcome no longer matters
    if p_task.done() and (p_exc := p_task.exception()) is not None:
        raise p_exc
    if d_task.done():
        raise d_task.exception()  # type: ignore[misc]
    return await d_task


async def _stop(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and let its cleanup (closing its connection) run."""
    if not task.done():
        task.cancel()
        await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # already counted and logged by the leg; retrieved so asyncio stays quiet


def _auth(request: web.Request) -> dict[str, str]:
    # vLLM started with --api-key checks the same header the client sent us.
    value = request.headers.get(hdrs.AUTHORIZATION)
    return {hdrs.AUTHORIZATION: value} if value else {}


def error_response(status: int, message: str, type_: str, request_id: str | None = None) -> web.Response:
    headers = {legs.REQUEST_ID_HEADER: request_id} if request_id else None
    return web.json_response(legs.error_body(message, type_, status), status=status, headers=headers)
