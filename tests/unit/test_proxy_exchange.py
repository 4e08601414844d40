"""One P/D exchange through the proxy: what each leg gets, concurrency, streaming."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog
from proxy_standins import CHAT, COMPLETION, WAIT_S, StandIn, cluster, outstanding, transfer_id_of, wait_until

from pushsvc.proxy import legs
from pushsvc.proxy.app import Exchange, Proxy
from pushsvc.proxy.config import ProxyConfig


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


def _phase_count(metrics: str, phase: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'pushsvc_proxy_phase_seconds_count{{phase="{phase}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no phase {phase} in /metrics")


@pytest.mark.asyncio
async def test_each_exchange_leaves_its_timeline_in_the_log_and_the_phase_histogram() -> None:
    async with cluster() as c:
        async def d_waits_for_p(standin: StandIn, body: dict[str, Any]) -> None:  # D needs P's KV first
            await wait_until(lambda: bool(c.p.answered_at))
            await asyncio.sleep(0.05)

        c.d.gate = d_waits_for_p
        with structlog.testing.capture_logs() as events:
            async with c.client.post(c.url + "/v1/completions", json={**COMPLETION, "stream": True},
                                     headers={"X-Request-Id": "timed"}) as r:
                assert r.status == 200
                await r.read()
            await wait_until(lambda: any(e["event"] == "request_timeline" for e in events))
        (line,) = [e for e in events if e["event"] == "request_timeline"]
        assert line["request_id"] == "timed" and line["transfer_id"] == transfer_id_of(c.p.received[0].body)
        assert line["side"] == "proxy" and line["status"] == 200 and line["start"].endswith("+00:00")
        ms = line["events_ms"]
        assert list(ms) == ["prefill_answered", "decode_answered", "decode_first_chunk", "first_chunk_sent", "done"]
        assert ms["decode_first_chunk"] - ms["prefill_answered"] >= 50  # D's gate: P's answer, then 50 ms
        metrics = await c.metrics()
        for phase in ("prefill", "decode_first_chunk", "after_prefill"):
            assert _phase_count(metrics, phase) == 1, phase


def test_moments_out_of_order_are_logged_but_not_observed_as_a_phase() -> None:
    """P may answer after D's first chunk (D streams while P's connection winds down, or D
    computed the prompt itself): that exchange has no ``after_prefill`` phase."""
    cfg = ProxyConfig(prefill=["http://127.0.0.1:1"], prefill_daemon=["http://127.0.0.1:2"],
                      decode=["http://127.0.0.1:3"], port=0, health_interval_s=0)
    proxy = Proxy(cfg)
    backend = proxy.prefill.pick()
    ex = Exchange("late-p", "k" * 32, legs.COMPLETIONS, {}, backend, proxy.decode.pick(), {}, structlog.get_logger())
    ex.moments.update(decode_first_chunk=0.010, prefill_answered=0.020, done=0.030)
    with structlog.testing.capture_logs() as events:
        proxy._timeline(ex, 200)
    (line,) = events
    assert line["events_ms"] == {"decode_first_chunk": 10.0, "prefill_answered": 20.0, "done": 30.0}
    samples = {s.labels["phase"]: s.value for m in proxy.metrics.phase_seconds.collect() for s in m.samples
               if s.name.endswith("_count")}
    assert samples == {"prefill": 1, "decode_first_chunk": 1, "after_prefill": 0}
