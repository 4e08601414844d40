"""Taking a backend out and putting it back (proxy/admin.py): a drained backend gets no new
request while what it has in flight finishes; resumed, it takes requests again; the admin
routes answer only the token's holder, or loopback clients where there is no token."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request
from proxy_standins import COMPLETION, cluster, outstanding, wait_until

from pushsvc.proxy.admin import Admin
from pushsvc.proxy.backends import DECODE, PREFILL, Backend, BackendPool, NoBackend
from pushsvc.proxy.metrics import ProxyMetrics


def _pool(*outstanding: int) -> BackendPool:
    return BackendPool([Backend(f"http://d{i}", DECODE, outstanding=n) for i, n in enumerate(outstanding)])


def test_a_drained_backend_is_never_picked_even_when_it_is_the_least_busy_or_preferred() -> None:
    pool = _pool(0, 5)
    d0, d1 = pool.backends
    d0.draining = True
    assert [pool.pick() for _ in range(3)] == [d1, d1, d1]
    assert pool.pick(preferred=d0, slack=100) is d1
    d1.mark_failed("down")  # an unhealthy backend may still be tried when none is healthy; a drained one not
    assert pool.pick() is d1 and not pool.any_healthy()
    d1.draining = True
    with pytest.raises(NoBackend, match="every decode backend is drained"):
        pool.pick()
    assert [b.outstanding for b in pool.backends] == [0, 10]  # five picks; the refused one counted nothing


@pytest.mark.asyncio
async def test_drain_sends_new_requests_elsewhere_and_resume_brings_the_backend_back() -> None:
    async with cluster(n_prefill=2, n_decode=2) as c:
        d1 = c.decode[1]
        status, _, doc = await c.post("/admin/drain", {"backend": d1.url + "/"})  # the URL as configured or not
        assert status == 200 and doc == {"role": DECODE, "url": d1.url, "healthy": True, "draining": True,
                                         "outstanding": 0}
        for _ in range(6):
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert len(c.decode[0].received) == 6 and not d1.received
        async with c.client.get(c.url + "/healthz") as r:
            health = await r.json()
        assert r.status == 200 and health["decode"][1]["draining"] is True
        text = await c.metrics()
        assert f'pushsvc_proxy_backend_draining{{backend="{d1.url}",role="decode"}} 1.0' in text
        assert 'pushsvc_proxy_admin_actions_total{action="drain",result="ok"} 1.0' in text

        status, _, doc = await c.post("/admin/resume", {"backend": d1.url})
        assert status == 200 and doc["draining"] is False
        for _ in range(4):
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert len(d1.received) == 2 and len(c.decode[0].received) == 8  # least outstanding, ties in turn
        async with c.client.get(c.url + "/admin/backends") as r:
            listed = await r.json()
        assert [(b["role"], b["draining"]) for b in listed] == [(PREFILL, False)] * 2 + [(DECODE, False)] * 2


@pytest.mark.asyncio
async def test_a_request_in_flight_on_a_backend_drained_under_it_finishes() -> None:
    release = asyncio.Event()

    async def slow(standin, body) -> None:
        await release.wait()

    async with cluster(n_prefill=1, n_decode=2) as c:
        c.decode[0].gate = c.decode[1].gate = slow
        first = asyncio.create_task(c.post("/v1/completions", COMPLETION))
        await wait_until(lambda: any(d.received for d in c.decode))
        busy = next(d for d in c.decode if d.received)
        status, _, doc = await c.post("/admin/drain", {"backend": busy.url})
        assert status == 200 and doc["outstanding"] == 1  # the operator waits for 0
        release.set()
        assert (await first)[0] == 200
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert len(busy.received) == 1
        await wait_until(lambda: outstanding(c) == [0, 0, 0])


@pytest.mark.asyncio
async def test_with_every_backend_of_a_role_drained_requests_get_503_and_nothing_is_counted() -> None:
    async with cluster(n_prefill=1, n_decode=1) as c:
        assert (await c.post("/admin/drain", {"backend": c.d.url}))[0] == 200
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 503 and doc["error"]["type"] == "service_unavailable"
        assert "every decode backend is drained" in doc["error"]["message"]
        async with c.client.get(c.url + "/v1/models") as r:
            assert r.status == 503
        async with c.client.get(c.url + "/healthz") as r:
            assert r.status == 503
        assert not c.p.received and not c.d.received and outstanding(c) == [0, 0]
        assert 'pushsvc_proxy_no_backend_total{role="decode"} 2.0' in await c.metrics()


@pytest.mark.asyncio
@pytest.mark.parametrize("body, status", [
    (b"{not json", 400),
    (b'{"backend": "http://127.0.0.1:1", "extra": 1}', 400),
    (b'{"backend": "ftp://somewhere:21"}', 400),
    (b'{"backend": "http://127.0.0.1:1"}', 404),
    (b'{"backend": "' + b"x" * 5000 + b'"}', 413),
])
async def test_bad_admin_bodies_are_refused_and_change_nothing(body: bytes, status: int) -> None:
    async with cluster() as c:
        got, _, doc = await c.post("/admin/drain", body)
        assert got == status and doc["error"]
        assert not any(b.draining for pool in (c.server.proxy.prefill, c.server.proxy.decode) for b in pool)
        assert 'pushsvc_proxy_admin_actions_total{action="drain",result="bad_request"} 1.0' in await c.metrics()


@pytest.mark.asyncio
async def test_with_a_token_only_its_bearer_may_drain(tmp_path) -> None:
    token = tmp_path / "admin.token"
    token.write_text("s3cret-admin-token-0123456789\n")
    token.chmod(0o600)
    async with cluster(admin_token_file=str(token)) as c:
        target = {"backend": c.d.url}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-admin-token-0123456789"}):
            status, wanted, _ = await c.post("/admin/drain", target, headers=headers)
            assert status == 401 and "Bearer" in wanted["WWW-Authenticate"]
        assert not c.d.received and not c.server.proxy.decode.backends[0].draining
        status, _, doc = await c.post("/admin/drain", target,
                                      headers={"Authorization": "Bearer s3cret-admin-token-0123456789"})
        assert status == 200 and doc["draining"] is True
        assert 'pushsvc_proxy_admin_actions_total{action="drain",result="unauthorized"} 3.0' in await c.metrics()


def _request_from(address: str):
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (address, 40000) if name == "peername" \
        else default
    return make_mocked_request("GET", "/admin/backends", transport=transport)


@pytest.mark.asyncio
@pytest.mark.parametrize("address, allowed", [("127.0.0.1", True), ("::1", True), ("10.0.0.7", False),
                                              ("192.168.1.2", False)])
async def test_without_a_token_only_loopback_clients_are_answered(address: str, allowed: bool) -> None:
    admin = Admin([BackendPool([Backend("http://d0:1", DECODE)])], ProxyMetrics(), token=None)
    response = await admin.backends(_request_from(address))
    assert response.status == (200 if allowed else 403)


@pytest.mark.asyncio
async def test_draining_a_p_forgets_the_prompt_prefixes_sent_to_it() -> None:
    async with cluster(n_prefill=2, n_decode=1) as c:
        prompt = {**COMPLETION, "prompt": "alpha " * 400}
        assert (await c.post("/v1/completions", prompt))[0] == 200
        taken = next(p for p in c.prefill if p.received)
        prefixes = c.server.proxy.prefixes
        assert len(prefixes) > 0
        assert (await c.post("/admin/drain", {"backend": taken.url}))[0] == 200
        assert len(prefixes) == 0
        assert (await c.post("/admin/resume", {"backend": taken.url}))[0] == 200
        assert (await c.post("/v1/completions", prompt))[0] == 200  # least outstanding again, then remembered
        assert len(prefixes) > 0
