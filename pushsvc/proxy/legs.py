"""The two backend requests of one P/D exchange, derived from the client's request.

Pure functions: no I/O, no clock. The prefill leg asks P to compute the prompt's KV and
keep it for a remote decoder (``do_remote_decode``); the decode leg asks D to receive that
KV from P (``do_remote_prefill``) and names where P's daemon listens, so D's daemon can
register its blocks with P while P computes (push mode). Where P's daemon listens comes
from P's daemon (``--prefill-daemon``) or from P's own answers: P's connector returns its
daemon's coordinates in the ``kv_transfer_params`` of every answer, and
``answered_coordinates`` checks them.

Both legs of one exchange carry one match key, ``transfer_id`` in ``kv_transfer_params``,
minted per exchange by the proxy. The connectors hand it to their daemons and P's daemon
pairs D's registration with P's blocks by it. It is not derived from the client's
``X-Request-Id``: two clients (or one client retrying) may send the same id at once, and
pairing by it could let D decode on the KV of another request's prompt.

The client's own ``kv_transfer_params`` never reach a backend: each leg gets a dict built
here, not the client's with ours merged in. Those keys steer the connectors:
``transfer_id`` says whose KV D decodes on, ``remote_engine_id``/``remote_host``/
``remote_port`` which daemon D registers its blocks with (so who WRITEs into D's memory),
``do_remote_*`` which role a leg plays. A client that could set them could pair its decode
with another client's prefill and read what that prompt's KV makes the model say, point
D at a daemon of its choosing, or have P hold KV that no D will claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import DECODE_ERRORS

COMPLETIONS = "completions"
CHAT = "chat_completions"
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}

REQUEST_ID_HEADER = "X-Request-Id"
TRANSFER_ID = "transfer_id"  # the match key's name in both legs' kv_transfer_params

# The longest X-Request-Id the proxy forwards. The daemons refuse a request id over 256
# characters (``RequestId``, pushsvc/protocol/worker.py), and the id they get is vLLM's,
# built from ours (docs/vllm-connector-notes.md, section 5): ``cmpl-<id>-<prompt index>-<8 hex>``
# for completions, 15 characters more plus the index's digits, and ``chatcmpl-<id>-<8 hex>``
# for chat, 18 more (plus ``_<index>`` for several prompts). 200 leaves 56: room for either,
# for a batch of any size, and for a longer prefix in a later vLLM.
MAX_REQUEST_ID = 200
# What a refused X-Request-Id is counted as (``pushsvc_proxy_request_id_refused_total``).
TOO_LONG = "too_long"
NOT_PRINTABLE_ASCII = "not_printable_ascii"
REQUEST_ID_REFUSALS = (TOO_LONG, NOT_PRINTABLE_ASCII)


class PrefillCoordinates(msgspec.Struct, frozen=True):
    """Where D's daemon finds P's: the keys of a P daemon's ``GET /v1/info`` we use, or
    what P's answer said (``answered_coordinates``)."""

    engine_id: str
    side_channel_host: str
    side_channel_port: int
    # P's tensor-parallel size when P's answer said it; None: the proxy's ``remote_tp_size``.
    tp_size: int | None = None

    def check(self) -> None:
        """Raise ValueError unless these coordinates can be dialed."""
        if not self.engine_id:
            raise ValueError("engine_id is empty")
        if not self.side_channel_host:
            raise ValueError("side_channel_host is empty")
        if not 1 <= self.side_channel_port <= 65535:
            raise ValueError(f"side_channel_port {self.side_channel_port} is not in 1..65535")


class BadPrefillAnswer(ValueError):
    """P's answer does not say where its daemon is, or says it in a form D cannot use."""


# Bounds as D's connector checks them (pushsvc_connector/params.py), which are the worker
# protocol's: what passes here, D's connector takes and its daemon can be sent.
_Name = Annotated[wp.Name, msgspec.Meta(min_length=1)]
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_TpSize = Annotated[int, msgspec.Meta(ge=1, le=1024)]


class _AnsweredParams(msgspec.Struct):
    """The ``kv_transfer_params`` of P's answer, as P's connector writes them
    (``request_finished``); keys not named here are ignored."""

    remote_engine_id: _Name
    remote_host: _Name
    remote_port: _Port
    transfer_id: str
    remote_tp_size: _TpSize | msgspec.UnsetType = msgspec.UNSET
    tp_size: _TpSize | msgspec.UnsetType = msgspec.UNSET  # the older name, as D's connector takes it
    transfer_mode: str = "push"
    remote_block_ids: Any = None


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: _AnsweredParams | None = None


_answer_decoder = msgspec.json.Decoder(_PrefillAnswer)


def answered_coordinates(raw: bytes, transfer_id: str) -> PrefillCoordinates:
    """P's daemon coordinates from P's answer to the prefill leg of exchange ``transfer_id``;
    BadPrefillAnswer (naming the key) unless D's connector would accept them as they are.

    Nothing else of P's answer is decoded. The answer must be this exchange's (its
    ``transfer_id``) and for a push (no ``remote_block_ids``, no other ``transfer_mode``).
    """
    try:
        params = _answer_decoder.decode(raw).kv_transfer_params
    except DECODE_ERRORS as exc:
        raise BadPrefillAnswer(f"unusable kv_transfer_params: {exc}") from None
    if params is None:
        raise BadPrefillAnswer("no kv_transfer_params in its answer, so it holds no KV for D "
                               "(is it a kv_producer with PushsvcConnector, and did its daemon answer it?)")
    if params.remote_block_ids:
        raise BadPrefillAnswer("remote_block_ids in its kv_transfer_params: a pull-mode prefill's params")
    if params.transfer_mode != "push":
        raise BadPrefillAnswer(f"transfer_mode {_shown(params.transfer_mode)} in its kv_transfer_params, not push")
    if params.transfer_id != transfer_id:
        raise BadPrefillAnswer(f"transfer_id {_shown(params.transfer_id)} in its kv_transfer_params, "
                               f"not this exchange's {transfer_id!r}")
    tp_size = params.remote_tp_size if params.remote_tp_size is not msgspec.UNSET else params.tp_size
    return PrefillCoordinates(params.remote_engine_id, params.remote_host, params.remote_port,
                              None if tp_size is msgspec.UNSET else tp_size)


def _shown(value: str) -> str:
    """Another party's string, short enough for an error message."""
    return repr(value) if len(value) <= 80 else f"{value[:60]!r}... ({len(value)} characters)"


class BadRequestBody(ValueError):
    """The client's body is not a JSON object."""


class BadRequestId(ValueError):
    """The client's ``X-Request-Id`` is one the proxy does not forward; ``reason`` is one of
    ``REQUEST_ID_REFUSALS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_decoder = msgspec.json.Decoder()


def parse_body(raw: bytes) -> dict[str, Any]:
    """The client's JSON object; BadRequestBody for anything else."""
    if not raw:
        raise BadRequestBody("request body is empty; expected a JSON object")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequestBody(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestBody(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def encode_body(body: Mapping[str, Any]) -> bytes:
    return msgspec.json.encode(body)


def is_stream(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


def request_id(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id`` (without surrounding whitespace) if it sent one, else a
    fresh id. BadRequestId for one the proxy does not forward.

    Both legs carry it and vLLM derives its request ids from it; the daemons see those ids
    (but pair P and D by the exchange's ``transfer_id``, not by them). The rule: at most
    ``MAX_REQUEST_ID`` characters, each printable ASCII (0x20-0x7E). vLLM itself takes any
    header value, but beyond ASCII the bytes are not one string across the system: aiohttp
    (this proxy) decodes a header as UTF-8 (bytes that are not UTF-8 as lone surrogates, which
    cannot be sent on), Starlette (vLLM) as Latin-1, so an ``é`` is one character here and two
    in vLLM and the daemons, and the length checked here would not be the one they check.
    Control characters have no place in an id nor in the log lines that carry it.
    """
    given = headers.get(REQUEST_ID_HEADER, "").strip()
    if not given:
        return uuid.uuid4().hex
    if len(given) > MAX_REQUEST_ID:
        raise BadRequestId(TOO_LONG, f"{REQUEST_ID_HEADER} is {len(given)} characters long; "
                                     f"at most {MAX_REQUEST_ID} are allowed")
    for i, ch in enumerate(given):
        if not " " <= ch <= "~":
            raise BadRequestId(NOT_PRINTABLE_ASCII, f"{REQUEST_ID_HEADER} must be printable ASCII "
                                                    f"(0x20-0x7E); character {i + 1} is {ascii(ch)}")
    return given


def mint_transfer_id() -> str:
    """A fresh match key for one exchange: 32 hex digits, a valid ``MatchKey``."""
    return uuid.uuid4().hex


def prefill_body(body: Mapping[str, Any], endpoint: str, transfer_id: str) -> dict[str, Any]:
    """P's request: the client's, cut to one token, not streamed, KV kept for D.

    Its ``kv_transfer_params`` are ours alone (module docstring: why).
    """
    leg = dict(body)
    leg["max_tokens"] = 1
    if endpoint == CHAT and "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    # vLLM rejects min_tokens > max_tokens; P's one token is thrown away anyway.
    leg.pop("min_tokens", None)
    leg["stream"] = False
    leg.pop("stream_options", None)
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, TRANSFER_ID: transfer_id}
    return leg


def decode_body(
    body: Mapping[str, Any], prefill: PrefillCoordinates, remote_tp_size: int, transfer_id: str
) -> dict[str, Any]:
    """D's request: the client's unchanged, plus where P's KV comes from.

    ``remote_tp_size`` is P's tensor-parallel size unless ``prefill`` says it. Its
    ``kv_transfer_params`` are ours alone (module docstring: why).
    """
    leg = dict(body)
    leg["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.side_channel_host,
        "remote_port": prefill.side_channel_port,
        "remote_tp_size": remote_tp_size if prefill.tp_size is None else prefill.tp_size,
        TRANSFER_ID: transfer_id,
    }
    return leg


def error_body(message: str, type_: str, code: int) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "code": code}}


def error_sse_event(message: str, type_: str, code: int) -> bytes:
    """An error inside an already-started SSE stream (vLLM reports mid-stream errors so)."""
    return b"data: " + msgspec.json.encode(error_body(message, type_, code)) + b"\n\n"


_MAX_MESSAGE = 2000


def backend_error_message(raw: bytes) -> tuple[str, str | None]:
    """(message, type) from a backend's error body, in any shape vLLM or FastAPI use."""
    try:
        doc = _decoder.decode(raw)
    except msgspec.DecodeError:
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        err = inner if isinstance(inner, dict) else doc
        message = err.get("message")
        if message is None and isinstance(doc.get("detail"), str):
            message = doc["detail"]
        if isinstance(message, str) and message:
            type_ = err.get("type")
            return message[:_MAX_MESSAGE], type_ if isinstance(type_, str) and type_ else None
    text = raw.decode("utf-8", errors="replace").strip()
    return (text[:_MAX_MESSAGE] or "(empty response body)"), None
