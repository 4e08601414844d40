"""Request ids and match keys: the client's ``X-Request-Id`` passed on only within the rule
(at most 200 printable ASCII characters), and one fresh ``transfer_id`` per exchange on both
legs, whatever the client's ``X-Request-Id`` or body says."""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

import msgspec
import pytest
import structlog
from proxy_standins import CHAT, COMPLETION, StandIn, cluster, transfer_id_of, wait_until

from pushsvc.protocol import worker as wp
from pushsvc.proxy import legs


# ------------------------------------------------------------------ the X-Request-Id rule


def test_request_id_passes_through_or_is_generated() -> None:
    assert legs.request_id({"X-Request-Id": " abc "}) == "abc"
    fresh = legs.request_id({})
    assert len(fresh) == 32 and int(fresh, 16) >= 0 and fresh != legs.request_id({})


def test_request_id_of_200_characters_passes_and_201_is_refused_naming_the_limit() -> None:
    at_limit = "r" * legs.MAX_REQUEST_ID
    assert legs.MAX_REQUEST_ID == 200
    assert legs.request_id({"X-Request-Id": at_limit}) == at_limit
    assert legs.request_id({"X-Request-Id": f"  {at_limit}\t"}) == at_limit  # counted once stripped
    with pytest.raises(legs.BadRequestId, match="201 characters long; at most 200 are allowed") as info:
        legs.request_id({"X-Request-Id": at_limit + "r"})
    assert info.value.reason == legs.TOO_LONG


def test_ids_the_daemons_see_for_the_longest_request_id_fit_their_cap() -> None:
    cap = typing.get_args(wp.RequestId)[1].max_length  # what the daemons take
    rid = "r" * legs.MAX_REQUEST_ID
    # What vLLM makes of it (docs/vllm-connector-notes.md, section 5), with a large batch index.
    for vllm_id in (f"cmpl-{rid}-99999-deadbeef", f"chatcmpl-{rid}_99999-deadbeef"):
        assert msgspec.convert(vllm_id, wp.RequestId) == vllm_id and len(vllm_id) < cap


@pytest.mark.parametrize("given", ["a b", "~!#$%&'()*+,-./:;<=>?@[]^_`{|}", "0123456789ABCxyz", '"quoted"\\'])
def test_every_printable_ascii_character_may_be_in_a_request_id(given: str) -> None:
    assert legs.request_id({"X-Request-Id": given}) == given


@pytest.mark.parametrize(
    ("given", "shown"),
    [("caf\u00e9", "'\\xe9'"), ("id-\u65e5", "'\\u65e5'"), ("a\tb", "'\\t'"), ("a\x7fb", "'\\x7f'"),
     ("\udcff", "'\\udcff'")],  # the last: a byte that is not UTF-8, as aiohttp decodes it
)
def test_request_id_beyond_printable_ascii_is_refused_naming_the_character(given: str, shown: str) -> None:
    with pytest.raises(legs.BadRequestId, match="printable ASCII") as info:
        legs.request_id({"X-Request-Id": given})
    assert info.value.reason == legs.NOT_PRINTABLE_ASCII
    assert str(info.value).endswith(f"is {shown}")


def test_a_long_id_is_refused_as_too_long_whatever_its_characters() -> None:
    with pytest.raises(legs.BadRequestId) as info:
        legs.request_id({"X-Request-Id": "\u00e9" * 300})
    assert info.value.reason == legs.TOO_LONG


# ------------------------------------------------------------------ match keys


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


# ------------------------------------------------------------------ through the app


@pytest.mark.asyncio
async def test_request_id_is_generated_when_the_client_sends_none() -> None:
    async with cluster() as c:
        status, headers, _ = await c.post("/v1/completions", COMPLETION)
        rid = headers["X-Request-Id"]
        assert status == 200 and len(rid) == 32
        assert c.p.received[0].headers["X-Request-Id"] == c.d.received[0].headers["X-Request-Id"] == rid


@pytest.mark.asyncio
async def test_request_id_of_200_characters_reaches_both_legs() -> None:
    rid = "x" * 200
    async with cluster() as c:
        status, headers, _ = await c.post("/v1/chat/completions", CHAT, {"X-Request-Id": rid})
        assert status == 200 and headers["X-Request-Id"] == rid
        assert c.p.received[0].headers["X-Request-Id"] == c.d.received[0].headers["X-Request-Id"] == rid


@pytest.mark.asyncio
@pytest.mark.parametrize(("length", "path"), [(201, "/v1/completions"), (400, "/v1/chat/completions")])
async def test_too_long_request_id_is_400_at_once_logged_and_counted(length: int, path: str) -> None:
    async with cluster() as c:
        with structlog.testing.capture_logs() as events:
            status, headers, doc = await c.post(path, COMPLETION if "chat" not in path else CHAT,
                                                {"X-Request-Id": "y" * length})
        assert status == 400 and "X-Request-Id" not in headers
        assert doc == {"error": {"message": f"X-Request-Id is {length} characters long; at most 200 are allowed",
                                 "type": "invalid_request_error", "code": 400}}
        assert not c.p.received and not c.d.received and c.daemons[0].info_fetches == 0
        endpoint = legs.CHAT if "chat" in path else legs.COMPLETIONS
        (refused,) = [e for e in events if e["event"] == "request_id_refused"]
        assert refused == {**refused, "reason": "too_long", "length": length, "endpoint": endpoint,
                           "head": "y" * 48, "log_level": "info"}
        text = await c.metrics()
        assert 'pushsvc_proxy_request_id_refused_total{reason="too_long"} 1.0' in text
        assert 'pushsvc_proxy_request_id_refused_total{reason="not_printable_ascii"} 0.0' in text
        assert f'pushsvc_proxy_requests_total{{endpoint="{endpoint}",status="400"}} 1.0' in text


async def _raw_post(url: str, request_id: bytes) -> tuple[int, Any]:
    """POST a completion with ``request_id``'s bytes as they are (aiohttp's client would encode
    a str); the status and the JSON body."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(COMPLETION).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nX-Request-Id: %s\r\nConnection: close\r\n\r\n" % (len(body), request_id)
                 + body)
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.mark.asyncio
@pytest.mark.parametrize("raw", ["caf\u00e9".encode(), b"\xff\xfe-id", b"a\tb", "\u65e5\u672c".encode()])
async def test_non_ascii_request_id_is_400_and_counted(raw: bytes) -> None:
    async with cluster() as c:
        status, doc = await _raw_post(c.url, raw)
        assert status == 400 and doc["error"]["type"] == "invalid_request_error"
        assert "printable ASCII (0x20-0x7E)" in doc["error"]["message"]
        assert not c.p.received and not c.d.received
        assert 'pushsvc_proxy_request_id_refused_total{reason="not_printable_ascii"} 1.0' in await c.metrics()
