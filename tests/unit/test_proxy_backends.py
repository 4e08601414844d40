"""Backend selection and P daemons' coordinates: the pure pool and cache, then through the app."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from proxy_standins import COMPLETION, COORDS, StandIn, closed_port_url, cluster, outstanding, wait_until

from pushsvc.proxy.backends import (
    DECODE,
    PREFILL,
    Backend,
    BackendPool,
    DaemonInfoCache,
)
from pushsvc.proxy.legs import PrefillCoordinates


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
