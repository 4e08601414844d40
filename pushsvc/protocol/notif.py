"""NIXL notification payloads exchanged between daemons' agents.

Two formats kept from the seed design so D-side accounting matches pull mode, and one
of ours:

* ``PUSH_REG:<msgpack map>``: D registers pre-allocated blocks with P (``PushReg``).
* ``<request_id>:<tp_size>``: P's completion notification, attached to the WRITE so it
  is delivered only after the data landed (``request_id`` is D's own id).
* ``PUSH_PART:<i>/<k>:<request_id>:<tp_size>``: the completion of part ``i`` of ``k`` of
  a WRITE split into parts (side channel 1.3, only to an agent that advertised
  ``parts``); the request is complete when all ``k`` have arrived.

Notifications come from whatever agent can reach ours, so both decoders treat the
payload as hostile: size-capped, unknown fields rejected, every value bounded.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pushsvc.errors import ProtocolError
from pushsvc.protocol.framing import DECODE_ERRORS
from pushsvc.protocol.worker import BlockIds, MatchKey, Name, Port, RequestId

PUSH_REG_PREFIX = b"PUSH_REG:"
PART_PREFIX = b"PUSH_PART:"
MAX_PARTS = 32
# A request id is at most 256 characters, so at most 1024 UTF-8 bytes, plus ":<tp>".
_MAX_COMPLETION_BYTES = 4 * 256 + 8
MAX_NOTIF_BYTES = 4 << 20

_TP = Annotated[int, msgspec.Meta(ge=1, le=1024)]


class PushReg(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The seed's PUSH_REG fields. New fields go at the end with defaults."""

    request_id: RequestId
    decode_engine_id: Name
    decode_host: Name
    decode_port: Port
    decode_tp_size: _TP
    # P's daemon keeps groups of over 64 ids as arrays once the sender is known (``layout.id_arrays``).
    local_block_ids: BlockIds
    remote_engine_id: Name
    remote_host: Name
    remote_port: Port
    remote_tp_size: _TP
    # Extensions (absent from seed-format senders).
    decode_rank: Annotated[int, msgspec.Meta(ge=0, le=1023)] = 0
    decode_daemon_id: Name = ""
    # Side channel 1.2: the exchange's match key. Encoded only when set (omit_defaults),
    # which D does only for a P whose side-channel minor says it knows the field.
    match_key: MatchKey = ""
    # Side channel 1.8: P copies into D's worker KV itself (same host, ``AgentInfo.ipc``,
    # after P's ``IpcReady``): the blocks are the worker's, not landing slots.
    ipc: bool = False


_encoder = msgspec.msgpack.Encoder()
_push_reg_decoder = msgspec.msgpack.Decoder(PushReg)


def encode_push_reg(reg: PushReg) -> bytes:
    return PUSH_REG_PREFIX + _encoder.encode(reg)


def is_push_reg(payload: bytes) -> bool:
    return payload.startswith(PUSH_REG_PREFIX)


def decode_push_reg(payload: bytes, max_bytes: int = MAX_NOTIF_BYTES) -> PushReg:
    if len(payload) > max_bytes:
        raise ProtocolError(f"PUSH_REG of {len(payload)} bytes exceeds {max_bytes}")
    if not payload.startswith(PUSH_REG_PREFIX):
        raise ProtocolError("not a PUSH_REG notification")
    try:
        return _push_reg_decoder.decode(payload[len(PUSH_REG_PREFIX) :])
    except DECODE_ERRORS as exc:
        raise ProtocolError(f"malformed PUSH_REG: {exc}") from None


def encode_completion(request_id: str, tp_size: int) -> bytes:
    return f"{request_id}:{tp_size}".encode()


def decode_completion(payload: bytes) -> tuple[str, int]:
    """Split ``<request_id>:<tp_size>``; the id itself may contain colons."""
    if len(payload) > _MAX_COMPLETION_BYTES:
        raise ProtocolError("completion notification too long")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("completion notification is not UTF-8") from None
    request_id, sep, tp = text.rpartition(":")
    if not sep or not request_id or not (tp.isascii() and tp.isdigit()) or not 1 <= int(tp) <= 1024:
        raise ProtocolError(f"malformed completion notification {text[:80]!r}")
    return request_id, int(tp)


def encode_part(request_id: str, tp_size: int, index: int, parts: int) -> bytes:
    return PART_PREFIX + f"{index}/{parts}:".encode() + encode_completion(request_id, tp_size)


def decode_notification(payload: bytes) -> tuple[str, int, int, int]:
    """A completion in either form, as (request_id, tp_size, part, parts); a whole
    WRITE's completion is part 0 of 1."""
    if not payload.startswith(PART_PREFIX):
        rid, tp = decode_completion(payload)
        return rid, tp, 0, 1
    head, sep, rest = payload[len(PART_PREFIX) :].partition(b":")
    index, slash, parts = head.partition(b"/")
    if not (sep and slash and index.isdigit() and parts.isdigit() and len(head) <= 8):
        raise ProtocolError(f"malformed part notification {payload[:80]!r}")
    i, k = int(index), int(parts)
    if not 1 <= k <= MAX_PARTS or i >= k:
        raise ProtocolError(f"part {i} of {k}: out of range (at most {MAX_PARTS} parts)")
    rid, tp = decode_completion(rest)
    return rid, tp, i, k
