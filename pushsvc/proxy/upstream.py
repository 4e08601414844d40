"""HTTP calls to backends, and the translation of their failures into ``UpstreamError``.

aiohttp's exceptions stop here: callers see one error type carrying the leg, a metrics
kind and the status the client gets (502 unreachable, 504 timed out, else the backend's).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec

from pushsvc.errors import PushsvcError
from pushsvc.proxy.legs import PrefillCoordinates, backend_error_message

# Error kinds, the ``kind`` label of the backend-error counter.
CONNECT = "connect"
TIMEOUT = "timeout"
STATUS = "status"
DISCONNECT = "disconnect"
PROTOCOL = "protocol"

_KIND_TYPE = {
    CONNECT: "upstream_connect_error",
    TIMEOUT: "upstream_timeout",
    DISCONNECT: "upstream_disconnected",
    PROTOCOL: "upstream_protocol_error",
}
_MAX_ERROR_BODY = 64 * 1024
_coordinates_decoder = msgspec.json.Decoder(PrefillCoordinates)


class UpstreamError(PushsvcError):
    """A backend leg failed; ``status`` and ``message`` are what the client is told."""

    def __init__(self, leg: str, kind: str, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(f"{leg} {kind} ({status}): {message}")
        self.leg = leg
        self.kind = kind
        self.status = status
        self.message = message
        self.type = type_ or _KIND_TYPE.get(kind, "upstream_error")

    @property
    def unreachable(self) -> bool:
        """The backend could not be connected to: it is down, not merely slow or unhappy."""
        return self.kind == CONNECT


# How a backend that closed a kept-alive connection shows when we send on it: it closed
# cleanly (ServerDisconnectedError), or with our request unread in its buffer (a reset).
_CLOSED_BY_PEER = (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED)


def reuse_tracing() -> aiohttp.TraceConfig:
    """Marks a call's ``trace_request_ctx`` (a ``SimpleNamespace``) ``reused`` when its
    connection came from the pool rather than a new connect."""

    async def reused(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
        if isinstance(ctx.trace_request_ctx, SimpleNamespace):
            ctx.trace_request_ctx.reused = True

    config = aiohttp.TraceConfig()
    config.on_connection_reuseconn.append(reused)
    return config


def stale(exc: BaseException, reused: bool) -> bool:
    """A call on a pooled connection failed before any answer because the backend had
    closed that connection: vLLM's server closes one idle for 5 s, and a server whose loop
    was held up closes it late, discarding a request that arrived meanwhile unread."""
    if not reused or isinstance(exc, aiohttp.ClientConnectorError):
        return False
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and exc.errno in _CLOSED_BY_PEER


async def post(session: aiohttp.ClientSession, fresh: aiohttp.ClientSession, url: str,
               on_stale: Callable[[BaseException], None], **kwargs: Any) -> aiohttp.ClientResponse:
    """POST ``url`` through ``session`` (whose connector traces ``reuse_tracing``); where
    that failed on a stale pooled connection (``stale``), once more through ``fresh``,
    which always connects anew, after ``on_stale``. No answer had come, and a server that is
    up closes a kept-alive connection only between requests, so it did not take the first
    try; one that died with it takes nothing more (the new connection is refused, and the
    caller sees an unreachable backend). A connection made for the call is never tried
    again: nothing says its backend did not read the request. ``data`` must be bytes."""
    ctx = SimpleNamespace(reused=False)
    try:
        return await session.post(url, trace_request_ctx=ctx, **kwargs)
    except aiohttp.ClientError as exc:
        if not stale(exc, ctx.reused):
            raise
        on_stale(exc)
    return await fresh.post(url, **kwargs)


def translate(exc: BaseException, leg: str, url: str, what: str | None = None) -> UpstreamError:
    """Map an aiohttp/asyncio failure of a call to ``url`` onto an UpstreamError."""
    who = f"{what or f'{leg} backend'} {url}"
    # Timeout first: aiohttp's connect timeouts are ClientConnectionErrors too.
    if isinstance(exc, TimeoutError):
        return UpstreamError(leg, TIMEOUT, 504, f"{who} timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(leg, CONNECT, 502, f"{who} unreachable: {exc.os_error}")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return UpstreamError(leg, DISCONNECT, 502, f"{who} ended its response early: {exc}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamError(leg, DISCONNECT, 502, f"{who} closed the connection")
    if isinstance(exc, aiohttp.ClientConnectionError):
        return UpstreamError(leg, DISCONNECT, 502, f"{who} connection failed: {exc}")
    return UpstreamError(leg, PROTOCOL, 502, f"{who} sent an invalid response: {exc}")


async def status_error(leg: str, response: aiohttp.ClientResponse) -> UpstreamError:
    """The error for a non-2xx answer, keeping the backend's status, message and type."""
    try:
        raw = await response.content.read(_MAX_ERROR_BODY)
    except (TimeoutError, aiohttp.ClientError):
        raw = b""
    message, type_ = backend_error_message(raw)
    return UpstreamError(leg, STATUS, response.status, message, type_)


async def fetch_coordinates(
    session: aiohttp.ClientSession, daemon_url: str, timeout: aiohttp.ClientTimeout,
    headers: Mapping[str, str] | None = None,
) -> PrefillCoordinates:
    """GET a P daemon's ``/v1/info`` (with ``headers``: its bearer token) and keep the keys D needs."""
    leg = "daemon"
    url = f"{daemon_url}/v1/info"
    try:
        async with session.get(url, timeout=timeout, headers=headers) as response:
            if response.status != 200:
                raise await status_error(leg, response)
            raw = await response.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise translate(exc, leg, daemon_url, what="prefill daemon") from None
    try:
        coords = _coordinates_decoder.decode(raw)
        coords.check()
    except (msgspec.DecodeError, ValueError) as exc:
        message = f"prefill daemon {daemon_url} sent an unusable /v1/info: {exc}"
        raise UpstreamError(leg, PROTOCOL, 502, message) from None
    return coords


async def probe(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> str:
    """'' if ``GET url`` answers 200, else why not."""
    try:
        async with session.get(url, timeout=timeout) as response:
            await response.read()
            return "" if response.status == 200 else f"{url} answered {response.status}"
    except (TimeoutError, aiohttp.ClientError) as exc:
        return translate(exc, "probe", url, what="health probe of").message
