"""A leg that fails, times out or drops, and a client that leaves: the other leg is closed."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from proxy_standins import (
    CHAT,
    COMPLETION,
    WAIT_S,
    StandIn,
    closed_port_url,
    cluster,
    hang,
    outstanding,
    wait_until,
)


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
