"""The hostile inputs every decoder must refuse, spelled out: nesting far deeper than the
interpreter's recursion limit, unknown fields, lying lengths inside msgpack. Each case
is what the fuzz tests reach at random; here they run on every commit, fast."""

from __future__ import annotations

import msgspec
import pytest
from fuzzing import deep
from prometheus_client import CollectorRegistry, Counter

from pushsvc.errors import MalformedInput, ProtocolError
from pushsvc.protocol import notif
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.protocol.framing import DECODE_ERRORS, HEADER, CountingDecoder

DECODERS = {
    "worker": wp.worker_decoder,
    "daemon": wp.daemon_decoder,
    "peer": pp.peer_decoder,
}
VALID = {
    "worker": wp.encode(wp.Ping(token=7)),
    "daemon": wp.encode(wp.Pong(token=7)),
    "peer": pp.encode(pp.Heartbeat(seq=7)),
}


def _tagged_map(tag: str, **fields: bytes) -> bytes:
    """A msgpack map with ``t`` first and then ``fields``, values already encoded."""
    items = [(b"t", msgspec.msgpack.encode(tag))] + [(k.encode(), v) for k, v in fields.items()]
    out = bytearray([0x80 | len(items)])
    for k, v in items:
        out += msgspec.msgpack.encode(k.decode()) + v
    return bytes(out)


def _unknown_first(tag: str, value: bytes) -> bytes:
    """An unknown key before the tag: msgspec must skip (walk) ``value`` to find the tag."""
    return b"\x82" + msgspec.msgpack.encode("zz") + value + msgspec.msgpack.encode("t") + msgspec.msgpack.encode(tag)


def _tag(name: str) -> str:
    return VALID_TAGS[name]


VALID_TAGS = {"worker": "ping", "daemon": "pong", "peer": "hb"}


@pytest.mark.parametrize("name", sorted(DECODERS))
@pytest.mark.parametrize("kind", ["array", "map"])
@pytest.mark.parametrize("where", ["top", "unknown_first", "unknown_after_tag"])
def test_deep_nesting_is_a_decode_error_never_a_crash(name: str, kind: str, where: str) -> None:
    nest = deep(100_000, kind)
    payload = {
        "top": nest,
        "unknown_first": _unknown_first(_tag(name), nest),
        "unknown_after_tag": _tagged_map(_tag(name), zz=nest),
    }[where]
    with pytest.raises(DECODE_ERRORS):
        DECODERS[name].decode(payload)
    assert DECODERS[name].decode(VALID[name]) is not None  # the decoder is still fine


def test_skipping_a_deep_unknown_value_raises_recursion_error_which_decoders_catch() -> None:
    # The case that escaped before RecursionError was one of DECODE_ERRORS: msgspec
    # walks an unknown value that comes before the tag and hits its depth guard.
    with pytest.raises(RecursionError):
        wp.worker_decoder.decode(_unknown_first("ping", deep(100_000, "array")))


@pytest.mark.parametrize("kind", ["array", "map"])
def test_deep_nesting_in_a_field(kind: str) -> None:
    payload = _tagged_map("evict", request_ids=deep(100_000, kind))
    with pytest.raises(msgspec.ValidationError):
        wp.worker_decoder.decode(payload)


@pytest.mark.parametrize("kind", ["array", "map"])
def test_deep_nesting_in_push_reg_and_completion(kind: str, push_reg) -> None:
    good = msgspec.to_builtins(push_reg())
    body = msgspec.msgpack.encode({**good, "local_block_ids": msgspec.Raw(deep(100_000, kind))})
    with pytest.raises(ProtocolError):
        notif.decode_push_reg(notif.PUSH_REG_PREFIX + body)
    body = b"\x81" + msgspec.msgpack.encode("zz") + deep(100_000, kind)
    with pytest.raises(ProtocolError):
        notif.decode_push_reg(notif.PUSH_REG_PREFIX + body)
    with pytest.raises(ProtocolError):
        notif.decode_completion(deep(100_000, kind))


def _all_structs(union) -> list[type[msgspec.Struct]]:
    seen: list[type[msgspec.Struct]] = []

    def walk(t: msgspec.inspect.Type) -> None:
        if isinstance(t, msgspec.inspect.StructType):
            if t.cls in seen:
                return
            seen.append(t.cls)
            for f in t.fields:
                walk(f.type)
        elif isinstance(t, msgspec.inspect.UnionType):
            for u in t.types:
                walk(u)
        elif isinstance(t, msgspec.inspect.ListType):
            walk(t.item_type)

    walk(msgspec.inspect.type_info(union))
    return seen


@pytest.mark.parametrize(
    "cls", [*_all_structs(wp.WorkerMessage), *_all_structs(wp.DaemonMessage), *_all_structs(pp.PeerMessage),
            notif.PushReg], ids=lambda c: c.__name__)
def test_every_wire_struct_forbids_unknown_fields(cls: type[msgspec.Struct]) -> None:
    # The protocol's versioning rule (docs/protocol.md) relies on it: a field an older
    # receiver does not know must be refused, not silently dropped.
    assert msgspec.inspect.type_info(cls).forbid_unknown_fields, cls.__name__


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_unknown_field_is_rejected(name: str) -> None:
    fields = msgspec.msgpack.decode(VALID[name])
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        DECODERS[name].decode(msgspec.msgpack.encode({**fields, "extra": 1}))


@pytest.mark.parametrize("header", [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                                    b"\xc6\xff\xff\xff\xff"])
def test_lying_lengths_inside_msgpack_are_refused_without_allocating(header: bytes) -> None:
    # A 4 GiB array/map/str/bin header followed by nothing: msgspec compares the length
    # with the bytes left before it allocates, so this is a plain decode error.
    for name, decoder in DECODERS.items():
        with pytest.raises(DECODE_ERRORS):
            decoder.decode(_tagged_map(_tag(name), zz=header))
        with pytest.raises(DECODE_ERRORS):
            decoder.decode(header)


def _counter() -> tuple[Counter, CollectorRegistry]:
    registry = CollectorRegistry()
    return Counter("m", "m", ["source", "reason"], registry=registry), registry


def _sample(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("m_total", {"source": "side_channel", "reason": reason}) or 0.0


def test_counting_decoder_counts_each_refusal_once_and_passes_good_frames() -> None:
    counter, registry = _counter()
    frames = CountingDecoder(pp.peer_decoder, source="side_channel", max_frame=1024, malformed=counter)
    assert frames.frame_length(HEADER.pack(1024)) == 1024
    assert frames.decode(VALID["peer"]) == pp.Heartbeat(seq=7)
    assert _sample(registry, "too_large") == _sample(registry, "decode") == 0
    for length in (1025, 2**31, 2**32 - 1):
        with pytest.raises(MalformedInput, match="exceeds cap 1024"):
            frames.frame_length(HEADER.pack(length))
    for bad in (b"", b"\xc1", deep(100_000, "map"), _unknown_first("hb", deep(100_000, "array"))):
        with pytest.raises(MalformedInput, match="malformed side_channel message"):
            frames.decode(bad)
    assert _sample(registry, "too_large") == 3
    assert _sample(registry, "decode") == 4
    assert repr(frames) == "<CountingDecoder side_channel max=1024>"

