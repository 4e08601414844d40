"""The proxy's pure leg builders: both legs' bodies, the client's body, backend errors."""

from __future__ import annotations

import pytest
from proxy_standins import COORDS

from pushsvc.proxy import legs


def test_prefill_body_for_completions() -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
              "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0}
    leg = legs.prefill_body(client, legs.COMPLETIONS, "key-1")
    assert leg == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False, "temperature": 0,
                   "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                          "transfer_id": "key-1"}}
    assert client["max_tokens"] == 50 and "stream_options" in client  # not mutated


def test_prefill_body_for_chat_caps_max_completion_tokens_too() -> None:
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 40}
    leg = legs.prefill_body(client, legs.CHAT, "key-1")
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1 and leg["stream"] is False
    assert leg["messages"] == client["messages"]
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "key-1"}
    # Only chat knows max_completion_tokens, and only a client that sent it gets it capped.
    assert "max_completion_tokens" not in legs.prefill_body({"messages": []}, legs.CHAT, "key-1")
    completion = legs.prefill_body({"prompt": "x", "max_completion_tokens": 9}, legs.COMPLETIONS, "key-1")
    assert completion["max_completion_tokens"] == 9


@pytest.mark.parametrize("endpoint", [legs.COMPLETIONS, legs.CHAT])
def test_decode_body_keeps_the_client_body_and_names_p(endpoint: str) -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
              "stream_options": {"include_usage": True}, "kv_transfer_params": {"bogus": 1}}
    leg = legs.decode_body(client, COORDS, remote_tp_size=2, transfer_id="key-1")
    assert {k: v for k, v in leg.items() if k != "kv_transfer_params"} == {
        k: v for k, v in client.items() if k != "kv_transfer_params"}
    assert leg["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
        "remote_host": "10.0.0.1", "remote_port": 5600, "remote_tp_size": 2, "transfer_id": "key-1",
    }
    assert client["kv_transfer_params"] == {"bogus": 1}


# What a client might try to steer: another exchange's key, a daemon of its own, the roles.
INJECTED = {"transfer_id": "someone-elses-key", "remote_engine_id": "evil-engine", "remote_host": "203.0.113.9",
            "remote_port": 1, "remote_tp_size": 8, "do_remote_prefill": True, "do_remote_decode": True,
            "remote_block_ids": [1, 2], "extra": "x"}


@pytest.mark.parametrize("endpoint", [legs.COMPLETIONS, legs.CHAT])
def test_client_kv_transfer_params_reach_neither_leg(endpoint: str) -> None:
    client = {"model": "m", "prompt": "hi", "max_tokens": 5, "kv_transfer_params": dict(INJECTED)}
    prefill = legs.prefill_body(client, endpoint, "minted")
    decode = legs.decode_body(client, COORDS, remote_tp_size=1, transfer_id="minted")
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                             "transfer_id": "minted"}
    assert decode["kv_transfer_params"] == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-engine",
        "remote_host": "10.0.0.1", "remote_port": 5600, "remote_tp_size": 1, "transfer_id": "minted",
    }
    assert client["kv_transfer_params"] == INJECTED  # not mutated either


@pytest.mark.parametrize(
    ("raw", "words"),
    [(b"", "empty"), (b"{nope", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'"text"', "JSON object")],
)
def test_parse_body_rejects_non_objects(raw: bytes, words: str) -> None:
    with pytest.raises(legs.BadRequestBody, match=words):
        legs.parse_body(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b'{"error": {"message": "too long", "type": "BadRequestError", "code": 400}}',
         ("too long", "BadRequestError")),
        (b'{"object": "error", "message": "old shape", "type": "X", "code": 400}', ("old shape", "X")),
        (b'{"detail": "Not Found"}', ("Not Found", None)),
        (b"Internal Server Error", ("Internal Server Error", None)),
        (b"", ("(empty response body)", None)),
    ],
)
def test_backend_error_message_shapes(raw: bytes, expected: tuple[str, str | None]) -> None:
    assert legs.backend_error_message(raw) == expected
