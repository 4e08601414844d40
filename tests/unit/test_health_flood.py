"""The health server under idle, slow and surplus connections (a real aiohttp server on
127.0.0.1, raw sockets as clients)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from daemon_fixtures import WAIT_S, wait_until

from pushsvc.metrics import Metrics
from pushsvc.server.health import HealthServer


class Source:
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        return True, {}

    def info(self) -> dict[str, Any]:
        return {}

    def metrics_text(self) -> bytes:
        return b""

    def requests(self, limit: int, request_id: str) -> list[dict[str, Any]]:
        return []


@contextlib.asynccontextmanager
async def health(**kw: Any) -> AsyncIterator[tuple[HealthServer, Metrics]]:
    metrics = Metrics()
    server = HealthServer(Source(), "127.0.0.1", 0, metrics, **kw)
    await server.start()
    try:
        yield server, metrics
    finally:
        await server.close()


def dropped(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value(
        "pushsvc_rejected_connections_total", {"listener": "health", "reason": "oldest_idle_dropped"})
    return value or 0.0


async def open_conn(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def healthz(port: int) -> bytes:
    reader, writer = await open_conn(port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), WAIT_S) == b""


@pytest.mark.asyncio
async def test_beyond_the_cap_the_oldest_idle_connection_gives_way() -> None:
    async with health(max_connections=4, idle_timeout_s=60.0) as (server, metrics):
        idle = [await open_conn(server.port) for _ in range(4)]
        await wait_until(lambda: server.open_connections == 4, "four open connections")
        assert dropped(metrics) == 0
        answer = await healthz(server.port)  # the fifth connection
        assert answer.startswith(b"HTTP/1.1 200")
        assert await closed_by_server(idle[0][0])
        assert dropped(metrics) == 1
        for _, writer in idle[1:]:
            assert not writer.is_closing()
        for _, writer in idle:
            writer.close()


@pytest.mark.asyncio
async def test_idle_and_trickling_connections_are_closed_after_the_idle_timeout() -> None:
    async with health(idle_timeout_s=0.5) as (server, _):
        idle_reader, idle_writer = await open_conn(server.port)
        slow_reader, slow_writer = await open_conn(server.port)
        slow_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()

        async def trickle() -> None:
            # One more header line every 100 ms: the request never completes.
            with contextlib.suppress(ConnectionError):
                while not slow_writer.is_closing():
                    slow_writer.write(b"X-Slow: 1\r\n")
                    await asyncio.sleep(0.1)

        task = asyncio.create_task(trickle())
        assert await closed_by_server(idle_reader)
        assert await closed_by_server(slow_reader)
        assert time.monotonic() - started < WAIT_S
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        idle_writer.close()
        slow_writer.close()


@pytest.mark.asyncio
async def test_probes_answer_next_to_hundreds_of_idle_connections() -> None:
    async with health(max_connections=64, idle_timeout_s=60.0) as (server, metrics):
        socks = []
        for _ in range(200):
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", server.port))
            socks.append(s)
            await asyncio.sleep(0)
        for _ in range(20):
            assert (await healthz(server.port)).startswith(b"HTTP/1.1 200")
        await wait_until(lambda: server.open_connections <= 64, "the cap to hold")
        assert dropped(metrics) >= 200 - 64
        for s in socks:
            s.close()
