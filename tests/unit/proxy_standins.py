"""Stand-in backends for the proxy's tests, and the cluster that puts a proxy in front of them.

The stand-ins are real aiohttp servers on loopback that answer like vLLM's OpenAI server
(and, for ``/v1/info``, like a pushsvc daemon). They record what they received, and notice
when the proxy closes their connection (their handler is cancelled), which is how vLLM
learns to abort a request. A stand-in P answers a prefill leg with the ``kv_transfer_params``
P's connector returns (its daemon's coordinates and the leg's ``transfer_id``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from pushsvc.proxy.server import ProxyServer
from pushsvc.proxy.config import load_proxy_config
from pushsvc.proxy.legs import PrefillCoordinates

WAIT_S = 5.0  # upper bound for anything that should happen "soon"; tests pass far below it
COORDS = PrefillCoordinates("prefill-engine", "10.0.0.1", 5600)


@dataclass
class Received:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    at: float


Gate = Callable[["StandIn", dict[str, Any]], Awaitable[None]]
AnswerParams = Callable[["StandIn", dict[str, Any]], Any]


def transfer_id_of(body: dict[str, Any]) -> str:
    """The match key a leg's body carries ("" if none)."""
    return str((body.get("kv_transfer_params") or {}).get("transfer_id", ""))


async def hang(standin: StandIn, body: dict[str, Any]) -> None:
    await asyncio.Event().wait()  # until the proxy closes the connection


def connector_params(standin: StandIn, body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` P's connector answers a prefill leg with
    (``request_finished``), None for any other request."""
    if not (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "transfer_id": transfer_id_of(body), "remote_engine_id": standin.engine_id,
            "remote_host": standin.side_channel_host, "remote_port": standin.side_channel_port,
            "remote_tp_size": 1}


@dataclass
class StandIn:
    """A stand-in vLLM OpenAI server, or a pushsvc daemon's health endpoint."""

    name: str
    engine_id: str = ""
    side_channel_host: str = "127.0.0.9"  # in /v1/info and in a P's answers
    side_channel_port: int = 5600
    answer_params: AnswerParams = connector_params  # the kv_transfer_params of a 200 answer
    status: int = 200
    error_message: str = ""
    gate: Gate | None = None  # awaited before answering
    chunk_gate: Callable[[int], Awaitable[None]] | None = None  # awaited before SSE chunk i
    chunks: int = 4
    health_status: int = 200
    drop_after_first_chunk: bool = False
    received: list[Received] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    info_fetches: int = 0
    health_checks: int = 0
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    on_answer: Callable[[dict[str, Any]], None] | None = None  # called with the body answered

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/info", self._info)
        return app

    def sse(self, path: str) -> list[bytes]:
        events = []
        for i in range(self.chunks):
            if path.endswith("chat/completions"):
                choice: dict[str, Any] = {"index": 0, "delta": {"content": f"t{i}"}}
            else:
                choice = {"index": 0, "text": f"t{i}"}
            events.append(b"data: " + json.dumps({"id": f"{self.name}-{i}", "choices": [choice]}).encode() + b"\n\n")
        return [*events, b"data: [DONE]\n\n"]

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(request.path, request.headers.copy(), body, time.monotonic()))
        self.got_request.set()
        try:
            if self.gate is not None:
                await self.gate(self, body)
            if self.status != 200:
                err = {"error": {"message": self.error_message, "type": "BackendError", "code": self.status}}
                return web.json_response(err, status=self.status)
            if self.on_answer is not None:  # only a successful P has KV to give
                self.on_answer(body)
            if body.get("stream"):
                return await self._stream(request)
            if request.path.endswith("chat/completions"):
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": f"from {self.name}"}}
            else:
                choice = {"index": 0, "text": f"from {self.name}"}
            return web.json_response({"id": self.name, "choices": [choice],
                                      "kv_transfer_params": self.answer_params(self, body)})
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            self.answered_at.append(time.monotonic())

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, event in enumerate(self.sse(request.path)):
            if self.chunk_gate is not None:
                await self.chunk_gate(i)
            await out.write(event)
            if self.drop_after_first_chunk:
                assert request.transport is not None
                request.transport.close()
                return out
        await out.write_eof()
        return out

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

    async def _health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=self.health_status)

    async def _info(self, request: web.Request) -> web.Response:
        self.info_fetches += 1
        return web.json_response({"version": "0.1.0", "engine_id": self.engine_id, "daemon_id": "x",
                                  "side_channel_host": self.side_channel_host,
                                  "side_channel_port": self.side_channel_port, "agents": []})


@asynccontextmanager
async def serving(standin: StandIn) -> AsyncIterator[StandIn]:
    runner = web.AppRunner(standin.app(), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert site._server is not None
    standin.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        yield standin
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@dataclass
class Cluster:
    prefill: list[StandIn]
    daemons: list[StandIn]
    decode: list[StandIn]
    server: ProxyServer
    client: aiohttp.ClientSession
    url: str

    @property
    def p(self) -> StandIn:
        return self.prefill[0]

    @property
    def d(self) -> StandIn:
        return self.decode[0]

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, CIMultiDict[str], Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.client.post(self.url + path, data=data, headers=headers) as r:
            raw = await r.read()
            return r.status, r.headers.copy(), json.loads(raw)

    async def metrics(self) -> str:
        async with self.client.get(self.url + "/metrics") as r:
            return await r.text()


@asynccontextmanager
async def cluster(n_prefill: int = 1, n_decode: int = 1, prefill_urls: list[str] | None = None,
                  tracer: Any = None, **config: Any) -> AsyncIterator[Cluster]:
    """P, P-daemon and D stand-ins plus a proxy in front. D answers a request only after the
    P that got the same match key has answered successfully, as a real D waits for the KV
    its daemon is paired with by that key. P i and its daemon both say ``engine-p<i>``;
    ``prefill_daemon=[]`` starts the proxy without daemon URLs (it learns from P's answers)."""
    p_done: dict[str, asyncio.Event] = {}

    def done(key: str) -> asyncio.Event:
        return p_done.setdefault(key, asyncio.Event())

    async def after_p(standin: StandIn, body: dict[str, Any]) -> None:
        await asyncio.wait_for(done(transfer_id_of(body)).wait(), WAIT_S)

    prefill = [StandIn(f"p{i}", engine_id=f"engine-p{i}", on_answer=lambda body: done(transfer_id_of(body)).set())
               for i in range(n_prefill)]
    daemons = [StandIn(f"pd{i}", engine_id=f"engine-p{i}") for i in range(n_prefill)]
    decode = [StandIn(f"d{i}", gate=after_p) for i in range(n_decode)]
    async with _serving_all([*prefill, *daemons, *decode]):
        values: dict[str, Any] = {
            "prefill": prefill_urls or [s.url for s in prefill], "prefill_daemon": [s.url for s in daemons],
            "decode": [s.url for s in decode], "port": 0, "timeout_s": WAIT_S, "connect_timeout_s": 1.0,
            "health_interval_s": 0, "drain_timeout_s": 1.0,
        }
        values.update(config)
        server = ProxyServer(load_proxy_config(values), tracer)
        async with server, aiohttp.ClientSession() as client:
            yield Cluster(prefill, daemons, decode, server, client, f"http://127.0.0.1:{server.port}")


@asynccontextmanager
async def _serving_all(standins: list[StandIn]) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        for standin in standins:
            await stack.enter_async_context(serving(standin))
        yield


async def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def outstanding(c: Cluster) -> list[int]:
    return [b.outstanding for b in (*c.server.proxy.prefill, *c.server.proxy.decode)]


COMPLETION = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 8}
