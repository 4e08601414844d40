"""Request ids and match keys: one fresh ``transfer_id`` per exchange on both legs, whatever
the client's ``X-Request-Id`` or body says."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import structlog
from proxy_standins import COMPLETION, StandIn, cluster, transfer_id_of, wait_until

from pushsvc.protocol import worker as wp
from pushsvc.proxy import legs


def test_minted_transfer_ids_are_fresh_valid_match_keys() -> None:
    keys = {legs.mint_transfer_id() for _ in range(100)}
    assert len(keys) == 100
    for key in keys:
        assert msgspec.convert(key, wp.MatchKey) == key  # what the connectors hand the daemons


@pytest.mark.asyncio
async def test_one_request_id_twice_at_once_gets_two_keys_each_shared_by_its_two_legs() -> None:
    async with cluster() as c:
        async def both_at_p(standin: StandIn, body: dict[str, Any]) -> None:
            await wait_until(lambda: len(standin.received) == 2)  # the two exchanges overlap

        c.p.gate = both_at_p
        prompts = ["first prompt", "second prompt"]
        results = await asyncio.gather(
            *(c.post("/v1/completions", {**COMPLETION, "prompt": p}, {"X-Request-Id": "same-id"}) for p in prompts))
        assert [(status, headers["X-Request-Id"]) for status, headers, _ in results] == [(200, "same-id")] * 2
        p_key = {r.body["prompt"]: transfer_id_of(r.body) for r in c.p.received}
        d_key = {r.body["prompt"]: transfer_id_of(r.body) for r in c.d.received}
        assert all(r.headers["X-Request-Id"] == "same-id" for r in (*c.p.received, *c.d.received))
        assert p_key == d_key  # each exchange's two legs share its key...
        assert len(set(p_key.values())) == 2 and all(len(k) == 32 for k in p_key.values())  # ...and only they do


@pytest.mark.asyncio
async def test_a_client_transfer_id_and_remote_params_are_ignored() -> None:
    async with cluster() as c:
        injected = {"transfer_id": "someone-elses-key", "remote_host": "203.0.113.9", "remote_port": 1,
                    "remote_engine_id": "evil-engine", "do_remote_decode": True}
        status, _, _ = await c.post("/v1/completions", {**COMPLETION, "kv_transfer_params": injected})
        assert status == 200
        (p_got,), (d_got,) = c.p.received, c.d.received
        key = transfer_id_of(p_got.body)
        assert key != "someone-elses-key" and transfer_id_of(d_got.body) == key
        assert p_got.body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                    "transfer_id": key}
        assert d_got.body["kv_transfer_params"] == {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
            "remote_host": "127.0.0.9", "remote_port": 5600, "remote_tp_size": 1, "transfer_id": key}


@pytest.mark.asyncio
async def test_exchange_logs_carry_the_transfer_id_next_to_the_request_id() -> None:
    async with cluster() as c:
        c.p.status, c.p.error_message = 500, "prefill exploded"
        with structlog.testing.capture_logs() as events:
            status, _, _ = await c.post("/v1/completions", COMPLETION, {"X-Request-Id": "logged-id"})
        assert status == 500
        key = transfer_id_of(c.p.received[0].body)
        failed = [e for e in events if e["event"] == "backend_failed"]
        assert failed and all(e["request_id"] == "logged-id" and e["transfer_id"] == key for e in failed)
