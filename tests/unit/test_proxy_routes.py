"""The proxy's other routes and answers: bad JSON, 404/405, models, health, metrics, lifecycle."""

from __future__ import annotations

import pytest
from proxy_standins import CHAT, COMPLETION, cluster, wait_until

from pushsvc.proxy.server import ProxyServer
from pushsvc.proxy.config import ProxyConfig


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
