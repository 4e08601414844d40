"""A backend that closes a kept-alive connection the proxy then sends on (vLLM's uvicorn
closes one idle for 5 s, late when its loop was held up, discarding a request that
arrived meanwhile unread): the POST goes again on a new connection, once, and only where
the connection came from the pool. The stand-in P here is a raw HTTP/1.1 server, so it
can close a connection the way uvicorn does: with a FIN, or with the request unread (a
reset)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from proxy_standins import COMPLETION, cluster, outstanding, wait_until


@dataclass
class RawP:
    """Answers each request with P's one-token answer, keeping the connection; the
    ``drop_nth`` request of each connection (1-based) it drops instead: ``reset`` closes
    with the request unread (RST), else after reading it (FIN)."""

    drop_nth: int
    reset: bool
    answered: int = 0
    dropped: int = 0
    url: str = ""
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        n = 0
        try:
            while True:
                n += 1
                if n == self.drop_nth:
                    await asyncio.sleep(0.05)  # the request has arrived: dropped unanswered
                    self.dropped += 1
                    sock = writer.get_extra_info("socket")
                    if self.reset:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                body = json.dumps({"id": "x", "object": "text_completion", "choices": [
                    {"index": 0, "text": "a", "finish_reason": "length"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n" % len(body) + body)
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.handlers.discard(task)


@asynccontextmanager
async def raw_p(drop_nth: int, reset: bool) -> AsyncIterator[RawP]:
    p = RawP(drop_nth, reset)
    server = await asyncio.start_server(p.handle, "127.0.0.1", 0)
    p.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with server:
            yield p
    finally:
        for task in list(p.handlers):  # the connections the proxy still pools
            task.cancel()
        await asyncio.gather(*p.handlers, return_exceptions=True)


def after(p: RawP, answers: int) -> Callable[[Any, Any], Awaitable[None]]:
    """A D gate: D answers once P has answered ``answers`` requests, as a real D waits for
    the KV of P's prefill (the stand-in D cannot hear from this P otherwise)."""
    async def gate(standin: Any, body: Any) -> None:
        while p.answered < answers:
            await asyncio.sleep(0.005)
    return gate


def _stale(metrics: str, leg: str) -> float:
    line = next(line for line in metrics.splitlines()
                if line.startswith(f'pushsvc_proxy_stale_connections_total{{leg="{leg}"}}'))
    return float(line.split()[-1])


@pytest.mark.asyncio
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "reset"])
async def test_a_post_on_a_pooled_connection_the_backend_closed_goes_again_on_a_new_one(reset: bool) -> None:
    async with raw_p(drop_nth=2, reset=reset) as p, cluster(prefill_urls=[p.url]) as c:
        c.d.gate = after(p, 1)
        first = await c.post("/v1/completions", COMPLETION, {"X-Request-Id": "one"})
        c.d.gate = after(p, 2)
        second = await c.post("/v1/completions", COMPLETION, {"X-Request-Id": "two"})
        assert (first[0], second[0]) == (200, 200), (first, second)
        # The second exchange's P leg: the pooled connection, dropped; then a new one.
        assert (p.answered, p.dropped) == (2, 1)
        metrics = await c.metrics()
        assert _stale(metrics, "prefill") == 1.0 and _stale(metrics, "decode") == 0.0
        assert 'pushsvc_proxy_backend_errors_total{kind="disconnect",leg="prefill"} 0.0' in metrics
        await wait_until(lambda: outstanding(c) == [0, 0])


@pytest.mark.asyncio
async def test_a_new_connection_the_backend_drops_is_not_sent_again() -> None:
    """Nothing says that backend did not read the request: the exchange fails as before."""
    async with raw_p(drop_nth=1, reset=True) as p, cluster(prefill_urls=[p.url]) as c:
        c.d.gate = after(p, 1)  # never: P answers nothing
        status, _, doc = await c.post("/v1/completions", COMPLETION, {"X-Request-Id": "one"})
        assert status == 502 and doc["error"]["type"] == "upstream_disconnected", doc
        assert (p.answered, p.dropped) == (0, 1)
        metrics = await c.metrics()
        assert _stale(metrics, "prefill") == 0.0
        assert 'pushsvc_proxy_backend_errors_total{kind="disconnect",leg="prefill"} 1.0' in metrics
