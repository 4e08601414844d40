"""The P/D proxy: pure leg builders and selection, then the app against stand-in backends.

The stand-ins are real aiohttp servers on loopback that answer like vLLM's OpenAI server
(and, for ``/v1/info``, like a pushsvc daemon). They record what they received, and notice
when the proxy closes their connection (their handler is cancelled), which is how vLLM
learns to abort a request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from pushsvc import cli
from pushsvc.errors import ConfigError
from pushsvc.proxy import legs
from pushsvc.proxy.app import ProxyServer
from pushsvc.proxy.backends import (
    DECODE,
    PREFILL,
    Backend,
    BackendPool,
    DaemonInfoCache,
)
from pushsvc.proxy.config import ProxyConfig, load_proxy_config
from pushsvc.proxy.legs import PrefillCoordinates

WAIT_S = 5.0  # upper bound for anything that should happen "soon"; tests pass far below it
COORDS = PrefillCoordinates("prefill-engine", "10.0.0.1", 5600)


# ======================================================================== pure functions


def test_prefill_body_for_completions() -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
              "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0}
    leg = legs.prefill_body(client, legs.COMPLETIONS)
    assert leg == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    assert client["max_tokens"] == 50 and "stream_options" in client  # not mutated


def test_prefill_body_for_chat_caps_max_completion_tokens_too() -> None:
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40}
    leg = legs.prefill_body(client, legs.CHAT)
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
    assert leg["messages"] == client["messages"]
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    # Only chat knows max_completion_tokens, and only a client that sent it gets it capped.
    assert "max_completion_tokens" not in legs.prefill_body({"messages": []}, legs.CHAT)
    completion = legs.prefill_body({"prompt": "x", "max_completion_tokens": 9}, legs.COMPLETIONS)
    assert completion["max_completion_tokens"] == 9


@pytest.mark.parametrize("endpoint", [legs.COMPLETIONS, legs.CHAT])
def test_decode_body_keeps_the_client_body_and_names_p(endpoint: str) -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
              "stream_options": {"include_usage": True}, "kv_transfer_params": {"bogus": 1}}
    leg = legs.decode_body(client, COORDS, remote_tp_size=2)
    assert {k: v for k, v in leg.items() if k != "kv_transfer_params"} == {
        k: v for k, v in client.items() if k != "kv_transfer_params"}
    assert leg["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
        "remote_host": "10.0.0.1", "remote_port": 5600, "remote_tp_size": 2,
    }
    assert client["kv_transfer_params"] == {"bogus": 1}


@pytest.mark.parametrize(
    ("raw", "words"),
    [(b"", "empty"), (b"{nope", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'"text"', "JSON object")],
)
def test_parse_body_rejects_non_objects(raw: bytes, words: str) -> None:
    with pytest.raises(legs.BadRequestBody, match=words):
        legs.parse_body(raw)


def test_request_id_passes_through_or_is_generated() -> None:
    assert legs.request_id({"X-Request-Id": " abc "}) == "abc"
    fresh = legs.request_id({})
    assert len(fresh) == 32 and int(fresh, 16) >= 0 and fresh != legs.request_id({})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"error": {"message": "too long", "type": "BadRequestError", "code": 400}}',
         ("too long", "BadRequestError")),
        (b'{"object": "error", "message": "old shape", "type": "X", "code": 400}', ("old shape", "X")),
        (b'{"detail": "Not Found"}', ("Not Found", None)),
        (b"Internal Server Error", ("Internal Server Error", None)),
        (b"", ("(empty response body)", None)),
    ],
)
def test_backend_error_message_shapes(raw: bytes, expected: tuple[str, str | None]) -> None:
    assert legs.backend_error_message(raw) == expected


def _pool(n: int) -> BackendPool:
    return BackendPool([Backend(f"http://b{i}:8000", DECODE) for i in range(n)])


def test_pick_round_robins_ties_and_prefers_the_least_busy() -> None:
    pool = _pool(3)
    first = [pool.pick() for _ in range(3)]
    assert [b.url for b in first] == ["http://b0:8000", "http://b1:8000", "http://b2:8000"]
    pool.release(first[1])  # b1 now has the fewest outstanding
    assert pool.pick() is first[1]
    for b in pool:
        while b.outstanding:
            pool.release(b)
    assert [pool.pick().url for _ in range(2)] == ["http://b2:8000", "http://b0:8000"]  # ties resume the rotation


def test_pick_skips_unhealthy_unless_all_are() -> None:
    pool = _pool(2)
    pool.backends[0].mark_failed("down")
    assert {pool.pick().url for _ in range(3)} == {"http://b1:8000"}
    pool.backends[1].mark_failed("down")
    assert not pool.any_healthy()
    assert pool.pick() in pool.backends  # still tries: that is how a backend is found back


@pytest.mark.asyncio
async def test_daemon_info_cache_shares_one_fetch_and_refetches_after_invalidate() -> None:
    fetched: list[str] = []
    release = asyncio.Event()

    async def fetch(url: str) -> PrefillCoordinates:
        fetched.append(url)
        await release.wait()
        return COORDS

    cache = DaemonInfoCache(fetch)
    backend = Backend("http://p:8000", PREFILL, daemon_url="http://pd:8471")
    waiters = [asyncio.create_task(cache.get(backend)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiters) == [COORDS] * 3
    assert fetched == ["http://pd:8471"] and backend.coordinates == COORDS
    assert await cache.get(backend) == COORDS and len(fetched) == 1
    cache.invalidate(backend)
    assert await cache.get(backend) == COORDS and len(fetched) == 2
    await cache.close()


def _cfg(**overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"prefill": ["http://p:8000"], "prefill_daemon": ["http://p:8471"],
                              "decode": ["http://d:8000/"], "port": 8000}
    values.update(overrides)
    return values


def test_config_normalizes_urls_and_keeps_defaults() -> None:
    cfg = load_proxy_config(_cfg(timeout_s=None))
    assert cfg.decode == ["http://d:8000"] and cfg.timeout_s == 300.0 and cfg.host == "127.0.0.1"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"prefill": ["not-a-url"]}, "prefill"),
        ({"decode": ["ftp://d:21"]}, "decode"),
        ({"decode": ["http://d:70000"]}, "decode"),
        ({"prefill_daemon": ["http://a:1", "http://b:1"]}, "prefill_daemon"),
        ({"prefill": ["http://p:1", "http://p:1"], "prefill_daemon": ["http://a:1", "http://b:1"]}, "prefill"),
        ({"port": 70000}, "port"),
        ({"port": "eighty"}, "port"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"remote_tp_size": 0}, "remote_tp_size"),
        ({"decode": []}, "decode"),
    ],
)
def test_config_errors_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_proxy_config(_cfg(**overrides))
    assert info.value.field == field


# ======================================================================== stand-in servers


@dataclass
class Received:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    at: float


Gate = Callable[["StandIn", dict[str, Any]], Awaitable[None]]


async def hang(standin: StandIn, body: dict[str, Any]) -> None:
    await asyncio.Event().wait()  # until the proxy closes the connection


@dataclass
class StandIn:
    """A stand-in vLLM OpenAI server, or a pushsvc daemon's health endpoint."""

    name: str
    engine_id: str = ""
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
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    on_answer: Callable[[str], None] | None = None

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
                self.on_answer(request.headers.get("X-Request-Id", ""))
            if body.get("stream"):
                return await self._stream(request)
            if request.path.endswith("chat/completions"):
                choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": f"from {self.name}"}}
            else:
                choice = {"index": 0, "text": f"from {self.name}"}
            return web.json_response({"id": self.name, "choices": [choice]})
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
        return web.Response(status=self.health_status)

    async def _info(self, request: web.Request) -> web.Response:
        self.info_fetches += 1
        return web.json_response({"version": "0.1.0", "engine_id": self.engine_id, "daemon_id": "x",
                                  "side_channel_host": "127.0.0.9", "side_channel_port": 5600, "agents": []})


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
                  **config: Any) -> AsyncIterator[Cluster]:
    """P, P-daemon and D stand-ins plus a proxy in front. D answers a request only after the
    P that got the same request id has answered successfully, as a real D waits for P's KV."""
    p_done: dict[str, asyncio.Event] = {}

    def done(rid: str) -> asyncio.Event:
        return p_done.setdefault(rid, asyncio.Event())

    async def after_p(standin: StandIn, body: dict[str, Any]) -> None:
        await asyncio.wait_for(done(standin.received[-1].headers["X-Request-Id"]).wait(), WAIT_S)

    prefill = [StandIn(f"p{i}", on_answer=lambda rid: done(rid).set()) for i in range(n_prefill)]
    daemons = [StandIn(f"pd{i}", engine_id=f"engine-p{i}") for i in range(n_prefill)]
    decode = [StandIn(f"d{i}", gate=after_p) for i in range(n_decode)]
    async with _serving_all([*prefill, *daemons, *decode]):
        values: dict[str, Any] = {
            "prefill": prefill_urls or [s.url for s in prefill], "prefill_daemon": [s.url for s in daemons],
            "decode": [s.url for s in decode], "port": 0, "timeout_s": WAIT_S, "connect_timeout_s": 1.0,
            "health_interval_s": 0, "drain_timeout_s": 1.0,
        }
        values.update(config)
        server = ProxyServer(load_proxy_config(values))
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


# ======================================================================== the exchange


@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "body", "key"), [
    ("/v1/completions", COMPLETION, "text"),
    ("/v1/chat/completions", CHAT, "message"),
])
async def test_non_streaming_passthrough_and_both_leg_bodies(path: str, body: dict[str, Any], key: str) -> None:
    async with cluster() as c:
        status, headers, doc = await c.post(path, body, {"X-Request-Id": "client-id-1"})
        assert status == 200 and headers["X-Request-Id"] == "client-id-1"
        choice = doc["choices"][0]
        assert (choice["text"] if key == "text" else choice["message"]["content"]) == "from d0"
        (p_got,), (d_got,) = c.p.received, c.d.received
        assert p_got.path == d_got.path == path
        assert p_got.headers["X-Request-Id"] == d_got.headers["X-Request-Id"] == "client-id-1"
        endpoint = legs.COMPLETIONS if key == "text" else legs.CHAT
        assert p_got.body == legs.prefill_body(body, endpoint)
        assert d_got.body == {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
            "remote_host": "127.0.0.9", "remote_port": 5600, "remote_tp_size": 1}}
        await wait_until(lambda: outstanding(c) == [0, 0])


@pytest.mark.asyncio
async def test_request_id_is_generated_when_the_client_sends_none() -> None:
    async with cluster() as c:
        status, headers, _ = await c.post("/v1/completions", COMPLETION)
        rid = headers["X-Request-Id"]
        assert status == 200 and len(rid) == 32
        assert c.p.received[0].headers["X-Request-Id"] == c.d.received[0].headers["X-Request-Id"] == rid


@pytest.mark.asyncio
async def test_both_legs_are_sent_concurrently() -> None:
    async with cluster() as c:
        async def wait_for_d(standin: StandIn, body: dict[str, Any]) -> None:
            await asyncio.wait_for(c.d.got_request.wait(), WAIT_S)  # a serial proxy never gets here

        c.p.gate = wait_for_d
        status, _, _ = await c.post("/v1/completions", COMPLETION)
        assert status == 200
        assert c.d.received[0].at < c.p.answered_at[0]


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streaming_passes_every_chunk_through_in_order(path: str) -> None:
    async with cluster() as c:
        seen: list[bytes] = []
        forwarded = asyncio.Event()

        async def one_at_a_time(i: int) -> None:
            if i:  # chunk i-1 must have reached the client before D sends chunk i
                await asyncio.wait_for(forwarded.wait(), WAIT_S)
                forwarded.clear()

        c.d.chunk_gate = one_at_a_time
        body = {**(CHAT if "chat" in path else COMPLETION), "stream": True, "stream_options": {"include_usage": True}}
        async with c.client.post(c.url + path, json=body, headers={"X-Request-Id": "s1"}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream") and r.headers["X-Request-Id"] == "s1"
            buffer = b""
            while True:
                chunk = await r.content.readany()
                if not chunk:
                    break
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    seen.append(event + b"\n\n")
                    forwarded.set()
        assert seen == c.d.sse(path)
        assert c.p.received[0].body["stream"] is False and "stream_options" not in c.p.received[0].body
        assert c.d.received[0].body["stream_options"] == {"include_usage": True}


@pytest.mark.asyncio
async def test_prefill_error_cancels_decode_and_returns_ps_status() -> None:
    async with cluster() as c:
        async def fail_once_d_waits(standin: StandIn, body: dict[str, Any]) -> None:
            await asyncio.wait_for(c.d.got_request.wait(), WAIT_S)

        c.p.gate, c.p.status, c.p.error_message = fail_once_d_waits, 500, "prefill exploded"
        c.d.gate = hang
        status, headers, doc = await c.post("/v1/completions", COMPLETION, {"X-Request-Id": "bad-p"})
        assert status == 500 and headers["X-Request-Id"] == "bad-p"
        assert doc["error"]["message"] == "prefill exploded" and doc["error"]["code"] == 500
        assert doc["error"]["type"] == "BackendError"
        await asyncio.wait_for(c.d.cancelled.wait(), WAIT_S)
        await wait_until(lambda: outstanding(c) == [0, 0])
        assert "pushsvc_proxy_backend_errors_total{kind=\"status\",leg=\"prefill\"} 1.0" in await c.metrics()


@pytest.mark.asyncio
async def test_prefill_unreachable_is_502_and_marks_it_unhealthy() -> None:
    async with cluster(prefill_urls=[closed_port_url()]) as c:
        c.d.gate = hang
        async with c.client.get(c.url + "/healthz") as r:
            assert r.status == 200
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 502 and "unreachable" in doc["error"]["message"]
        assert doc["error"] == {**doc["error"], "type": "upstream_connect_error", "code": 502}
        # P failed at once: D's leg was cancelled before it was sent, or closed after.
        await wait_until(lambda: not c.d.received or c.d.cancelled.is_set())
        await wait_until(lambda: outstanding(c) == [0, 0])
        async with c.client.get(c.url + "/healthz") as r:
            health = await r.json()
            assert r.status == 503 and health["status"] == "unavailable"
            assert health["prefill"][0]["healthy"] is False and "unreachable" in health["prefill"][0]["last_error"]


@pytest.mark.asyncio
async def test_prefill_timeout_is_504_and_closes_decode() -> None:
    async with cluster(timeout_s=0.3) as c:
        c.p.gate = hang
        c.d.gate = hang
        started = time.monotonic()
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 504 and "prefill" in doc["error"]["message"] and "timed out" in doc["error"]["message"]
        assert time.monotonic() - started < 2
        await asyncio.wait_for(c.p.cancelled.wait(), WAIT_S)
        await asyncio.wait_for(c.d.cancelled.wait(), WAIT_S)


@pytest.mark.asyncio
async def test_decode_error_cancels_prefill_and_returns_ds_status() -> None:
    async with cluster() as c:
        c.p.gate = hang
        c.d.gate, c.d.status, c.d.error_message = None, 400, "prompt too long for decode"
        status, _, doc = await c.post("/v1/chat/completions", CHAT)
        assert status == 400 and doc["error"]["message"] == "prompt too long for decode"
        await asyncio.wait_for(c.p.cancelled.wait(), WAIT_S)
        await wait_until(lambda: outstanding(c) == [0, 0])


@pytest.mark.asyncio
async def test_decode_dropping_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async with cluster() as c:
        c.d.drop_after_first_chunk = True
        async with c.client.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status == 200
            raw = await r.read()
        first, rest = raw.split(b"\n\n", 1)
        assert first + b"\n\n" == c.d.sse("/v1/completions")[0]
        assert rest.startswith(b"data: ") and json.loads(rest[6:])["error"]["code"] == 502
        assert 'kind="disconnect",leg="decode"' in await c.metrics()


@pytest.mark.asyncio
async def test_client_disconnect_mid_stream_closes_the_backend_stream() -> None:
    async with cluster() as c:
        async def stall_after_first(i: int) -> None:
            if i:
                await asyncio.Event().wait()

        c.d.chunk_gate = stall_after_first
        r = await c.client.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status == 200
        assert (await r.content.readany()).startswith(b"data: ")
        r.close()  # the client goes away mid-stream
        await asyncio.wait_for(c.d.cancelled.wait(), WAIT_S)
        await wait_until(lambda: outstanding(c) == [0, 0])
        assert 'endpoint="completions",status="499"' in await c.metrics()


@pytest.mark.asyncio
async def test_load_is_spread_over_two_prefill_and_two_decode_backends() -> None:
    async with cluster(n_prefill=2, n_decode=2) as c:
        async def slow(standin: StandIn, body: dict[str, Any]) -> None:
            await asyncio.sleep(0.1)  # keep all four in flight together

        for p in c.prefill:
            p.gate = slow
        rids = [f"r{i}" for i in range(4)]
        results = await asyncio.gather(*(c.post("/v1/completions", COMPLETION, {"X-Request-Id": r}) for r in rids))
        assert [s for s, _, _ in results] == [200] * 4
        assert [len(s.received) for s in (*c.prefill, *c.decode)] == [2, 2, 2, 2]
        # D is sent to the daemon of the P that computes the same request.
        engine_of = {r.headers["X-Request-Id"]: p.name.replace("p", "engine-p")
                     for p in c.prefill for r in p.received}
        for d in c.decode:
            for got in d.received:
                assert got.body["kv_transfer_params"]["remote_engine_id"] == engine_of[got.headers["X-Request-Id"]]
        assert [d.info_fetches for d in c.daemons] == [1, 1]


@pytest.mark.asyncio
async def test_daemon_info_is_cached_and_refetched_after_a_failure() -> None:
    async with cluster() as c:
        for _ in range(2):
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert c.daemons[0].info_fetches == 1
        c.p.status, c.p.error_message = 503, "busy"
        assert (await c.post("/v1/completions", COMPLETION))[0] == 503
        c.p.status = 200
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert c.daemons[0].info_fetches == 2


@pytest.mark.asyncio
async def test_unreachable_daemon_is_502() -> None:
    async with cluster() as c:
        c.server.proxy.prefill.backends[0].daemon_url = closed_port_url()
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 502 and "daemon" in doc["error"]["message"]
        await wait_until(lambda: outstanding(c) == [0, 0])


@pytest.mark.asyncio
async def test_prefill_and_its_daemon_both_down_leaves_no_unretrieved_task_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with cluster(prefill_urls=[closed_port_url()]) as c:
        c.server.proxy.prefill.backends[0].daemon_url = closed_port_url()
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 502 and "prefill daemon" in doc["error"]["message"]
        assert not c.d.received
    gc.collect()  # asyncio reports an unretrieved task exception when the task is collected
    assert "never retrieved" not in caplog.text


# ======================================================================== other routes


@pytest.mark.asyncio
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2, 3]"])
async def test_invalid_json_is_400(raw: bytes) -> None:
    async with cluster() as c:
        status, _, doc = await c.post("/v1/completions", raw)
        assert status == 400 and doc["error"]["type"] == "invalid_request_error"
        assert not c.p.received and not c.d.received


@pytest.mark.asyncio
async def test_unknown_path_is_404_and_wrong_method_405() -> None:
    async with cluster() as c:
        async with c.client.get(c.url + "/v2/nothing") as r:
            assert r.status == 404 and (await r.json())["error"] == {
                "message": "no route for /v2/nothing", "type": "not_found_error", "code": 404}
        async with c.client.get(c.url + "/v1/completions") as r:
            assert r.status == 405 and "POST" in r.headers["Allow"]


@pytest.mark.asyncio
async def test_models_is_forwarded_to_a_decode_backend() -> None:
    async with cluster() as c, c.client.get(c.url + "/v1/models") as r:
        assert r.status == 200 and (await r.json())["data"][0] == {"id": "tiny", "owned_by": "d0"}


@pytest.mark.asyncio
async def test_healthz_lists_backends_and_follows_the_probe() -> None:
    async with cluster(health_interval_s=0.05) as c:
        async with c.client.get(c.url + "/healthz") as r:
            doc = await r.json()
            assert r.status == 200 and doc["status"] == "ok"
        assert doc["prefill"][0]["url"] == c.p.url and doc["prefill"][0]["outstanding"] == 0
        assert doc["decode"][0]["url"] == c.d.url and doc["decode"][0]["healthy"] is True
        await wait_until(lambda: c.server.proxy.prefill.backends[0].coordinates is not None)  # probe warms it
        c.d.health_status = 500
        await wait_until(lambda: not c.server.proxy.decode.any_healthy())
        async with c.client.get(c.url + "/healthz") as r:
            assert r.status == 503
        c.d.health_status = 200
        await wait_until(lambda: c.server.proxy.decode.any_healthy())


@pytest.mark.asyncio
async def test_metrics_count_requests_errors_and_latency() -> None:
    async with cluster() as c:
        async with c.client.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            await r.read()
        await c.post("/v1/chat/completions", CHAT)
        await c.post("/v1/completions", b"{")
        text = await c.metrics()
    for line in [
        'pushsvc_proxy_requests_total{endpoint="completions",status="200"} 1.0',
        'pushsvc_proxy_requests_total{endpoint="chat_completions",status="200"} 1.0',
        'pushsvc_proxy_requests_total{endpoint="completions",status="400"} 1.0',
        'pushsvc_proxy_ttft_seconds_count{endpoint="completions"} 1.0',
        'pushsvc_proxy_request_seconds_count{endpoint="chat_completions"} 1.0',
        'pushsvc_proxy_backend_errors_total{kind="connect",leg="prefill"} 0.0',
        "pushsvc_proxy_outstanding{backend=",
    ]:
        assert line in text, line


@pytest.mark.asyncio
async def test_proxy_server_start_and_close_are_idempotent() -> None:
    cfg = ProxyConfig(prefill=["http://127.0.0.1:1"], prefill_daemon=["http://127.0.0.1:2"],
                      decode=["http://127.0.0.1:3"], port=0, health_interval_s=0)
    server = ProxyServer(cfg)
    port = await server.start()
    assert port > 0 and await server.start() == port
    await server.close()
    await server.close()


# ======================================================================== CLI

_CLI_BASE = ["proxy", "--prefill-daemon", "http://127.0.0.1:8471", "--decode", "http://127.0.0.1:8200",
             "--port", "8000"]


def test_cli_proxy_with_a_bad_url_exits_2() -> None:
    argv = [sys.executable, "-m", "pushsvc", *_CLI_BASE, "--prefill", "not-a-url"]
    out = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "invalid configuration" in out.stderr and "prefill" in out.stderr


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--prefill", "http://127.0.0.1:8100", "--port", "70000"], "port"),
        (["--prefill", "http://127.0.0.1:8100", "--prefill", "http://127.0.0.1:8101"], "prefill_daemon"),
        (["--prefill", "http://127.0.0.1:8100", "--timeout-s", "-1"], "timeout_s"),
    ],
)
def test_cli_proxy_invalid_values_exit_2_naming_the_field(
    args: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*_CLI_BASE, *args]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and f"{field}:" in err
