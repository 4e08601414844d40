"""One P/D exchange through the proxy: what each leg gets, concurrency, streaming."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from proxy_standins import CHAT, COMPLETION, WAIT_S, StandIn, cluster, outstanding, transfer_id_of, wait_until

from pushsvc.proxy import legs


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
        match_key = transfer_id_of(p_got.body)
        assert len(match_key) == 32
        assert p_got.body == legs.prefill_body(body, endpoint, match_key)
        assert d_got.body == {**body, "kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
            "remote_host": "127.0.0.9", "remote_port": 5600, "remote_tp_size": 1, "transfer_id": match_key}}
        await wait_until(lambda: outstanding(c) == [0, 0])


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
