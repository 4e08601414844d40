"""A proxy without ``--prefill-daemon`` learns each P's daemon from P's answers: the first
exchange with a P runs P's leg, then D's; later ones run both at once; every answer refreshes
what is kept; an answer without usable coordinates fails its exchange; a daemon URL, when
given, still decides."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from aiohttp import web
from proxy_standins import (
    COMPLETION,
    WAIT_S,
    Cluster,
    StandIn,
    cluster,
    connector_params,
    hang,
    outstanding,
    transfer_id_of,
    wait_until,
)

from pushsvc.proxy import legs

PROTOCOL_ERRORS = 'pushsvc_proxy_backend_errors_total{kind="protocol",leg="prefill"}'


def _d_params(c: Cluster, i: int = -1) -> dict[str, Any]:
    return c.d.received[i].body["kv_transfer_params"]


def _where(params: dict[str, Any]) -> tuple[str, str, int, int]:
    return params["remote_engine_id"], params["remote_host"], params["remote_port"], params["remote_tp_size"]


def _ran_p_then_d(c: Cluster, i: int = -1) -> bool:
    """D's leg of exchange ``i`` reached D only once P had answered its leg."""
    return c.d.received[i].at >= c.p.answered_at[i]


async def _d_first(c: Cluster) -> None:
    """Let P answer only once D has its leg: a proxy that waits for P's answer fails this."""
    async def wait_for_d(standin: StandIn, body: dict[str, Any]) -> None:
        await asyncio.wait_for(c.d.got_request.wait(), WAIT_S)

    c.d.got_request.clear()
    c.p.gate = wait_for_d


def _metric(text: str, series: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(series + " ")]
    return float(line.split()[-1])


@pytest.mark.asyncio
async def test_first_exchange_runs_p_then_d_with_ps_coordinates_then_both_at_once() -> None:
    async with cluster(prefill_daemon=[]) as c:
        c.p.side_channel_host, c.p.side_channel_port = "10.1.2.3", 5601  # said only in P's answers
        with structlog.testing.capture_logs() as events:
            status, _, doc = await c.post("/v1/completions", COMPLETION)
            assert status == 200 and doc["choices"][0]["text"] == "from d0"
            assert _ran_p_then_d(c, 0)
            assert _d_params(c, 0) == {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p0",
                "remote_host": "10.1.2.3", "remote_port": 5601, "remote_tp_size": 1,
                "transfer_id": transfer_id_of(c.p.received[0].body)}

            await _d_first(c)
            status, _, _ = await c.post("/v1/completions", COMPLETION)
            assert status == 200
            assert c.d.received[1].at < c.p.answered_at[1]  # sent while P computed
            assert _where(_d_params(c, 1)) == ("engine-p0", "10.1.2.3", 5601, 1)
            assert transfer_id_of(c.d.received[1].body) == transfer_id_of(c.p.received[1].body)
        learned = [e for e in events if e["event"] == "prefill_coordinates_learned"]
        assert len(learned) == 1 and learned[0]["previous"] is None and learned[0]["port"] == 5601
        assert c.daemons[0].info_fetches == 0
        await wait_until(lambda: outstanding(c) == [0, 0])


@pytest.mark.asyncio
async def test_every_answer_refreshes_the_coordinates() -> None:
    async with cluster(prefill_daemon=[]) as c:
        c.p.side_channel_port = 5601
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        c.p.side_channel_port, c.p.engine_id = 5602, "engine-p0-restarted"  # P's daemon came back elsewhere
        with structlog.testing.capture_logs() as events:
            await _d_first(c)
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200
            assert _where(_d_params(c, 1))[:3] == ("engine-p0", "127.0.0.9", 5601)  # sent before P answered
            await _d_first(c)
            assert (await c.post("/v1/completions", COMPLETION))[0] == 200  # still both at once
            assert _where(_d_params(c, 2))[:3] == ("engine-p0-restarted", "127.0.0.9", 5602)
        (learned,) = [e for e in events if e["event"] == "prefill_coordinates_learned"]
        assert learned["previous"]["side_channel_port"] == 5601 and learned["port"] == 5602


@pytest.mark.asyncio
async def test_ps_tp_size_from_its_answer_wins_over_the_configured_one() -> None:
    async with cluster(prefill_daemon=[], remote_tp_size=4) as c:
        c.p.answer_params = lambda standin, body: {**connector_params(standin, body), "remote_tp_size": 2}
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert _d_params(c)["remote_tp_size"] == 2


def _changed(**changes: Any) -> Callable[[StandIn, dict[str, Any]], Any]:
    """P's answer params with keys replaced (``None``: removed)."""
    def params(standin: StandIn, body: dict[str, Any]) -> Any:
        good = connector_params(standin, body)
        assert good is not None
        out = {**good, **changes}
        return {k: v for k, v in out.items() if v is not None}

    return params


# Each: what P answers with, and the key the error must name.
BAD_ANSWERS = {
    "no params": (lambda standin, body: None, "no kv_transfer_params"),
    "params not an object": (lambda standin, body: [1, 2], "kv_transfer_params"),
    "no engine id": (_changed(remote_engine_id=None), "remote_engine_id"),
    "empty engine id": (_changed(remote_engine_id=""), "remote_engine_id"),
    "engine id too long": (_changed(remote_engine_id="e" * 257), "remote_engine_id"),
    "no host": (_changed(remote_host=None), "remote_host"),
    "host a number": (_changed(remote_host=12), "remote_host"),
    "no port": (_changed(remote_port=None), "remote_port"),
    "port 0": (_changed(remote_port=0), "remote_port"),
    "port 65536": (_changed(remote_port=65536), "remote_port"),
    "port a string": (_changed(remote_port="5600"), "remote_port"),
    "port a bool": (_changed(remote_port=True), "remote_port"),
    "port a float": (_changed(remote_port=5600.0), "remote_port"),
    "tp size 0": (_changed(remote_tp_size=0), "remote_tp_size"),
    "tp size too big": (_changed(remote_tp_size=None, tp_size=1025), "tp_size"),
    "pull mode": (_changed(transfer_mode="pull"), "transfer_mode"),
    "pull-mode block ids": (_changed(remote_block_ids=[1, 2]), "remote_block_ids"),
    "no transfer id": (_changed(transfer_id=None), "transfer_id"),
    "another exchange's transfer id": (_changed(transfer_id="someone-elses-key"), "transfer_id"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(BAD_ANSWERS))
async def test_first_answer_without_usable_coordinates_fails_that_request_clearly(case: str) -> None:
    answer, key = BAD_ANSWERS[case]
    async with cluster(prefill_daemon=[]) as c:
        c.p.answer_params = answer
        with structlog.testing.capture_logs() as events:
            status, headers, doc = await c.post("/v1/completions", COMPLETION, {"X-Request-Id": "bad-answer"})
        assert status == 502 and headers["X-Request-Id"] == "bad-answer"
        assert doc["error"]["type"] == "upstream_protocol_error" and doc["error"]["code"] == 502
        message = doc["error"]["message"]
        assert message.startswith(f"prefill backend {c.p.url} did not say where its daemon is") and key in message
        assert not c.d.received  # D never got a leg it could not have used
        (failed,) = [e for e in events if e["event"] == "backend_failed"]
        assert failed["phase"] == "prefill_coordinates" and failed["backend"] == c.p.url
        assert failed["kind"] == "protocol" and failed["request_id"] == "bad-answer" and key in failed["error"]
        assert _metric(await c.metrics(), PROTOCOL_ERRORS) == 1
        await wait_until(lambda: outstanding(c) == [0, 0])
        c.p.answer_params = connector_params  # P fixed: the next request learns and succeeds
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert _ran_p_then_d(c)


@pytest.mark.asyncio
async def test_a_bad_answer_once_coordinates_are_known_fails_that_exchange_and_closes_d() -> None:
    async with cluster(prefill_daemon=[]) as c:
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        c.p.answer_params, c.d.gate = _changed(remote_port=0), hang
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 502 and "remote_port" in doc["error"]["message"]
        await asyncio.wait_for(c.d.cancelled.wait(), WAIT_S)  # D's leg, sent in parallel, is closed
        assert _metric(await c.metrics(), PROTOCOL_ERRORS) == 1
        await wait_until(lambda: outstanding(c) == [0, 0])
        # What P said before is no longer trusted: the next exchange learns again.
        c.p.answer_params, c.d.gate, c.p.side_channel_port = connector_params, None, 5609
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert _ran_p_then_d(c) and _d_params(c)["remote_port"] == 5609


@pytest.mark.asyncio
async def test_a_decode_that_cannot_reach_ps_daemon_makes_the_next_exchange_learn_again() -> None:
    async with cluster(prefill_daemon=[]) as c:
        async def only_ps_current_daemon(standin: StandIn, body: dict[str, Any]) -> None:
            if body["kv_transfer_params"]["remote_port"] != c.p.side_channel_port:
                error = {"error": {"message": "P's daemon unreachable", "type": "BackendError", "code": 503}}
                raise web.HTTPServiceUnavailable(text=json.dumps(error), content_type="application/json")

        c.d.gate = only_ps_current_daemon
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        c.p.side_channel_port = 5700  # P's daemon restarted: a new side-channel port
        await _d_first(c)
        status, _, doc = await c.post("/v1/completions", COMPLETION)
        assert status == 503 and doc["error"]["message"] == "P's daemon unreachable"
        c.p.gate = None
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert _ran_p_then_d(c) and _d_params(c)["remote_port"] == 5700


@pytest.mark.asyncio
async def test_a_daemon_url_still_decides_whatever_p_answers() -> None:
    async with cluster() as c:  # with --prefill-daemon
        c.p.answer_params = _changed(remote_engine_id="elsewhere", remote_port=5999)
        await _d_first(c)  # both legs at once from the first exchange, as before
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert _where(_d_params(c)) == ("engine-p0", "127.0.0.9", 5600, 1)  # the daemon's /v1/info
        c.p.answer_params = lambda standin, body: None  # P's answer is not consulted
        await _d_first(c)
        assert (await c.post("/v1/completions", COMPLETION))[0] == 200
        assert c.daemons[0].info_fetches == 1
        assert _metric(await c.metrics(), PROTOCOL_ERRORS) == 0


@pytest.mark.asyncio
async def test_probe_of_a_p_without_daemon_url_checks_only_p() -> None:
    async with cluster(prefill_daemon=[], health_interval_s=0.01) as c:
        with structlog.testing.capture_logs() as events:
            await wait_until(lambda: c.p.health_checks >= 3)
        assert not [e for e in events if e["event"] in ("probe_failed", "backend_unhealthy")]
        assert c.daemons[0].info_fetches == 0
        async with c.client.get(c.url + "/healthz") as r:
            health = await r.json()
        assert r.status == 200 and health["prefill"][0]["healthy"] is True
        assert health["prefill"][0]["daemon_url"] is None


# ------------------------------------------------------------------ the pure check


def _answer(**params: Any) -> bytes:
    return json.dumps({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": params}).encode()


GOOD = {"remote_engine_id": "e", "remote_host": "h", "remote_port": 1, "transfer_id": "k"}


def test_answered_coordinates_takes_the_connectors_keys_and_ignores_others() -> None:
    coords = legs.answered_coordinates(_answer(**GOOD, do_remote_prefill=True, transfer_mode="push", extra=[1]), "k")
    assert coords == legs.PrefillCoordinates("e", "h", 1, tp_size=None)
    assert legs.answered_coordinates(_answer(**GOOD, tp_size=3), "k").tp_size == 3  # the older name
    assert legs.answered_coordinates(_answer(**GOOD, remote_tp_size=2, tp_size=3), "k").tp_size == 2
    longest = legs.answered_coordinates(_answer(**{**GOOD, "remote_engine_id": "e" * 256, "remote_port": 65535}), "k")
    assert longest.engine_id == "e" * 256 and longest.side_channel_port == 65535


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1]", b'{"kv_transfer_params": null}',
                                 b'{"kv_transfer_params": "x"}',
                                 b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_answered_coordinates_refuses_answers_that_carry_none(raw: bytes) -> None:
    with pytest.raises(legs.BadPrefillAnswer):
        legs.answered_coordinates(raw, "k")


def test_decode_body_takes_ps_tp_size_over_the_configured_one() -> None:
    coords = legs.PrefillCoordinates("e", "h", 1, tp_size=2)
    assert legs.decode_body({}, coords, remote_tp_size=8, transfer_id="k")["kv_transfer_params"]["remote_tp_size"] == 2
    unsaid = legs.PrefillCoordinates("e", "h", 1)
    assert legs.decode_body({}, unsaid, remote_tp_size=8, transfer_id="k")["kv_transfer_params"]["remote_tp_size"] == 8
