"""What the connector accepts from ``kv_transfer_params`` and request ids, checked
before any scheduler hook acts on them.

These values come from the HTTP request (the proxy, a router, or a client calling an
instance directly), so none is trusted. An exception in a scheduler hook kills vLLM's
engine core, and a value the worker protocol cannot carry makes the daemon answer an
``Error`` it cannot tie to a request; so each check here *returns* its verdict, and
the bounds are the protocol's own types (``pushsvc.protocol.worker``), converted with
msgspec exactly as the daemon's decoder will check them.

Pure functions, no I/O: the scheduler turns a ``Refusal`` into its fallback (a local
prefill on D, no held blocks on P), a warning and a count.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from pushsvc.protocol import worker as wp
from pushsvc_connector.counters import BAD_PARAMS, ID_TOO_LONG

_EngineId = Annotated[str, msgspec.Meta(min_length=1)]  # within wp.Name's bound, checked too
_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_TP = Annotated[int, msgspec.Meta(ge=1, le=1024)]
_CONVERT_ERRORS = (msgspec.ValidationError, UnicodeError)


@dataclass(frozen=True)
class Refusal:
    reason: str  # the metrics label: BAD_PARAMS or ID_TOO_LONG
    detail: str  # for the log line


@dataclass(frozen=True)
class RemotePrefill:
    """D side: where P's daemon is, from a request's ``kv_transfer_params``."""

    engine_id: str
    host: str
    port: int
    tp_size: int


def params_of(request: Any) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params`` if it is a dict (anything else is ignored)."""
    params = getattr(request, "kv_transfer_params", None)
    return params if isinstance(params, dict) else None


def check_request_id(request_id: Any) -> Refusal | None:
    """Whether the worker protocol can carry ``request_id`` (``RequestId``: 1 to 256
    characters; vLLM accepts ids of any length)."""
    try:
        _encodable(msgspec.convert(request_id, wp.RequestId))
    except _CONVERT_ERRORS as exc:
        return Refusal(ID_TOO_LONG, f"request id {_shown(request_id)} cannot be sent to the daemon: {exc}")
    return None


def remote_prefill(params: dict[str, Any]) -> RemotePrefill | Refusal:
    """P's coordinates from a D request's params, or why they cannot be used.

    Required: ``remote_engine_id`` and ``remote_host`` (non-empty strings within the
    protocol's ``Name``), ``remote_port`` (an int, 1..65535). Optional:
    ``remote_tp_size`` (or the older ``tp_size``; an int, 1..1024, default 1). Params
    that carry block ids were made for a pull-mode connector (nothing will push
    into D), and a ``transfer_mode`` other than ``push`` is refused as well.
    """
    try:
        engine_id = _convert(params, "remote_engine_id", _EngineId)
        host = _convert(params, "remote_host", _EngineId)
        port = _convert(params, "remote_port", _Port)
        tp_key = "remote_tp_size" if "remote_tp_size" in params else "tp_size"
        tp_size = _convert(params, tp_key, _TP) if tp_key in params else 1
    except _Bad as exc:
        return Refusal(BAD_PARAMS, str(exc))
    if params.get("remote_block_ids"):
        return Refusal(BAD_PARAMS, "remote_block_ids given: these are a pull-mode prefill's params")
    mode = params.get("transfer_mode", "push")
    if mode != "push":
        return Refusal(BAD_PARAMS, f"transfer_mode {_shown(mode)}, this connector only receives pushes")
    return RemotePrefill(engine_id=engine_id, host=host, port=port, tp_size=tp_size)


def given_match_key(params: dict[str, Any]) -> tuple[str, str]:
    """``(transfer_id, problem)``: the client's ``transfer_id`` if it is a valid
    ``MatchKey`` (at most 64 of ``[A-Za-z0-9._:-]``), else ``""`` with what is wrong
    (``problem`` is ``""`` when there was nothing to check)."""
    value = params.get("transfer_id")
    if value is None or value == "":
        return "", ""
    try:
        return msgspec.convert(value, wp.MatchKey), ""
    except _CONVERT_ERRORS as exc:
        return "", f"transfer_id {_shown(value)} is not a valid match key: {exc}"


def mint_match_key() -> str:
    return uuid.uuid4().hex


class _Bad(Exception):
    pass


def _convert(params: dict[str, Any], key: str, kind: Any) -> Any:
    if key not in params:
        raise _Bad(f"{key} missing")
    value = params[key]
    try:
        value = msgspec.convert(value, kind)
        if isinstance(value, str):
            _encodable(msgspec.convert(value, wp.Name))
    except _CONVERT_ERRORS as exc:
        raise _Bad(f"{key} {_shown(value)}: {exc}") from None
    return value


def _encodable(text: str) -> None:
    """msgspec checks lengths, not encodability: a lone surrogate (valid in a Python str,
    and in JSON as an escape) would raise only when the worker encodes the message."""
    text.encode("utf-8")


def _shown(value: Any) -> str:
    """A client's value, short enough for a log line."""
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"{text[:60]}... ({len(value)} characters)" if isinstance(value, str) else f"{text[:60]}..."

