"""NIXL notification payloads: PUSH_REG (the seed's format and our extensions) and completions."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.errors import ProtocolError
from pushsvc.protocol import notif, worker
from pushsvc.protocol.notif import (
    MAX_NOTIF_BYTES,
    PUSH_REG_PREFIX,
    PushReg,
    decode_completion,
    decode_push_reg,
    encode_completion,
    encode_push_reg,
    is_push_reg,
)

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

# ---------------------------------------------------------------- PUSH_REG notification

SEED_FIELDS = {
    "request_id",
    "decode_engine_id",
    "decode_host",
    "decode_port",
    "decode_tp_size",
    "local_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_tp_size",
}


def _reg_map(**changes: Any) -> dict[str, Any]:
    return {
        "request_id": "cmpl-abc-0-deadbeef",
        "decode_engine_id": "decode-0",
        "decode_host": "10.0.0.2",
        "decode_port": 5601,
        "decode_tp_size": 2,
        "local_block_ids": [[4, 5, 6]],
        "remote_engine_id": "prefill-0",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_tp_size": 4,
        **changes,
    }


def test_push_reg_round_trip(push_reg) -> None:
    reg = push_reg(local_block_ids=[[1, 2], [], [2**32 - 1]], decode_rank=3, decode_daemon_id="d-7")
    data = encode_push_reg(reg)
    assert data.startswith(b"PUSH_REG:")  # the seed's wire prefix
    assert is_push_reg(data)
    assert decode_push_reg(data) == reg


def test_push_reg_is_a_plain_map_with_the_seed_keys(push_reg) -> None:
    """A seed-format P decodes the payload as a dict and reads these keys."""
    body = unpack(encode_push_reg(push_reg())[len(PUSH_REG_PREFIX) :])
    assert isinstance(body, dict)
    assert SEED_FIELDS <= set(body)
    assert set(body) - SEED_FIELDS <= {"decode_rank", "decode_daemon_id", "match_key"}


def test_seed_format_push_reg_decodes_with_default_extensions() -> None:
    reg = decode_push_reg(PUSH_REG_PREFIX + pack(_reg_map()))
    assert reg.request_id == "cmpl-abc-0-deadbeef"
    assert reg.local_block_ids == [[4, 5, 6]]
    assert (reg.decode_tp_size, reg.remote_tp_size) == (2, 4)
    assert reg.decode_rank == 0
    assert reg.decode_daemon_id == ""


def test_push_reg_accepts_bounds() -> None:
    reg = decode_push_reg(
        PUSH_REG_PREFIX
        + pack(_reg_map(decode_port=65535, remote_port=0, decode_tp_size=1024, remote_tp_size=1, decode_rank=1023))
    )
    assert reg.decode_port == 65535 and reg.decode_rank == 1023


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(pack(_reg_map()), id="missing-prefix"),
        pytest.param(b"PUSH_REG" + pack(_reg_map()), id="prefix-without-colon"),
        pytest.param(b"push_reg:" + pack(_reg_map()), id="prefix-wrong-case"),
        pytest.param(b"cmpl-abc-0-deadbeef:1", id="completion-notif"),
        pytest.param(b"", id="empty"),
    ],
)
def test_decode_push_reg_requires_prefix(payload: bytes) -> None:
    assert not is_push_reg(payload)
    with pytest.raises(ProtocolError, match="not a PUSH_REG"):
        decode_push_reg(payload)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty-body"),
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"{\"request_id\": \"r\"}", id="json"),
        pytest.param(pack(_reg_map())[:-3], id="truncated"),
        pytest.param(pack(_reg_map()) + b"\x00", id="trailing-bytes"),
        pytest.param(pack([1, 2, 3]), id="array"),
        pytest.param(pack(_reg_map(surprise=1)), id="unknown-field"),
        pytest.param(pack({k: v for k, v in _reg_map().items() if k != "decode_port"}), id="missing-field"),
        pytest.param(pack(_reg_map(request_id=7)), id="id-not-string"),
        pytest.param(pack(_reg_map(decode_port="5601")), id="port-as-string"),
        pytest.param(pack(_reg_map(decode_tp_size=True)), id="tp-as-bool"),
        pytest.param(pack(_reg_map(local_block_ids=[[1, -2]])), id="negative-block-id"),
        pytest.param(pack(_reg_map(local_block_ids=[[2**32]])), id="block-id-over-u32"),
        pytest.param(pack(_reg_map(local_block_ids=[4, 5])), id="flat-block-ids"),
        pytest.param(pack(_reg_map(local_block_ids=[[1.0]])), id="float-block-id"),
        pytest.param(pack(_reg_map(local_block_ids=[[0]] * 65)), id="too-many-groups"),
        pytest.param(pack(_reg_map(decode_port=65536)), id="decode-port-too-large"),
        pytest.param(pack(_reg_map(remote_port=-1)), id="remote-port-negative"),
        pytest.param(pack(_reg_map(decode_tp_size=0)), id="decode-tp-zero"),
        pytest.param(pack(_reg_map(remote_tp_size=1025)), id="remote-tp-too-large"),
        pytest.param(pack(_reg_map(decode_rank=1024)), id="rank-too-large"),
        pytest.param(pack(_reg_map(decode_rank=-1)), id="rank-negative"),
        pytest.param(pack(_reg_map(request_id="r" * 257)), id="id-too-long"),
        pytest.param(pack(_reg_map(decode_host="h" * 257)), id="host-too-long"),
    ],
)
def test_decode_push_reg_rejects_malformed_body(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed PUSH_REG"):
        decode_push_reg(PUSH_REG_PREFIX + body)


def test_decode_push_reg_rejects_oversized_payload_before_decoding() -> None:
    payload = PUSH_REG_PREFIX + b"\x00" * (MAX_NOTIF_BYTES - len(PUSH_REG_PREFIX) + 1)
    assert len(payload) == MAX_NOTIF_BYTES + 1
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_push_reg(payload)


def test_decode_push_reg_errors_are_translated() -> None:
    """Callers handle one exception family: no msgspec error escapes, and no chained cause."""
    with pytest.raises(ProtocolError) as info:
        decode_push_reg(PUSH_REG_PREFIX + b"\xc1")
    assert not isinstance(info.value, msgspec.MsgspecError)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


# ---------------------------------------------------------------- completion notification


def test_encode_completion_format() -> None:
    assert encode_completion("cmpl-abc-0-deadbeef", 4) == b"cmpl-abc-0-deadbeef:4"


@pytest.mark.parametrize(
    ("request_id", "tp"),
    [
        ("cmpl-abc-0-deadbeef", 1),
        ("r", 1024),
        ("a:b:c", 2),  # ids may contain colons: the last one separates the tp
        ("ends-with-colon:", 3),
        ("::", 8),
        ("12", 12),
        ("naïve-ü-请求", 4),
        ("x" * 256, 1024),
    ],
)
def test_completion_round_trip(request_id: str, tp: int) -> None:
    assert decode_completion(encode_completion(request_id, tp)) == (request_id, tp)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"no-separator",
        b":4",  # empty id
        b"r:",  # empty tp
        b"r:0",
        b"r:1025",
        b"r:-1",
        b"r:+2",
        b"r: 2",
        b"r:2 ",
        b"r:2\n",
        b"r:1.0",
        b"r:0x10",
        b"r:two",
        b"r:1_0",
        "r:\u00b2".encode(),  # superscript two: isdigit() but not a number
        "r:\u0663".encode(),  # Arabic-Indic three: isdigit() but not ASCII
        b"r:" + b"9" * 40,
        b"r:\xff",  # not UTF-8
        b"\xff\xfe:1",
    ],
    ids=repr,
)
def test_decode_completion_rejects_malformed(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_completion(payload)


def test_decode_completion_length_cap() -> None:
    # Room for the longest request id (256 characters of 4 UTF-8 bytes) plus ":<tp>".
    at_cap = b"r" * 1030 + b":1"
    assert len(at_cap) == 4 * 256 + 8
    assert decode_completion(at_cap) == ("r" * 1030, 1)
    with pytest.raises(ProtocolError, match="too long"):
        decode_completion(b"r" * 1031 + b":1")


def test_push_reg_is_not_a_completion(push_reg) -> None:
    with pytest.raises(ProtocolError):
        decode_completion(encode_push_reg(push_reg()))


def test_completion_round_trips_for_every_valid_request_id(push_reg) -> None:
    rid = "\U0001f600" * 256  # 256 characters, the longest Name; 4 bytes each in UTF-8
    reg = decode_push_reg(encode_push_reg(push_reg(rid)))  # D may register it ...
    assert decode_completion(encode_completion(reg.request_id, 1024)) == (rid, 1024)  # ... and must finish it


@settings(max_examples=300, deadline=None)
@given(
    request_id=st.text(st.characters(codec="utf-8"), min_size=1, max_size=256).filter(
        lambda s: len(s.encode()) <= 1018
    ),
    tp=st.integers(1, 1024),
)
def test_completion_round_trip_property(request_id: str, tp: int) -> None:
    assert decode_completion(encode_completion(request_id, tp)) == (request_id, tp)


# ---------------------------------------------------------------- PUSH_REG, property based

NAMES = st.text(st.characters(codec="utf-8"), max_size=256)
REQUEST_IDS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=256)
PORTS = st.integers(0, 65535)
TPS = st.integers(1, 1024)
BLOCK_IDS = st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=20), max_size=4)


@settings(max_examples=200, deadline=None)
@given(
    reg=st.builds(
        PushReg,
        request_id=REQUEST_IDS,
        decode_engine_id=NAMES,
        decode_host=NAMES,
        decode_port=PORTS,
        decode_tp_size=TPS,
        local_block_ids=BLOCK_IDS,
        remote_engine_id=NAMES,
        remote_host=NAMES,
        remote_port=PORTS,
        remote_tp_size=TPS,
        decode_rank=st.integers(0, 1023),
        decode_daemon_id=NAMES,
    )
)
def test_push_reg_round_trip_property(reg: PushReg) -> None:
    assert decode_push_reg(encode_push_reg(reg)) == reg


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200))
def test_decode_push_reg_never_leaks_other_errors(body: bytes) -> None:
    try:
        decode_push_reg(PUSH_REG_PREFIX + body)
    except ProtocolError:
        pass


def test_empty_request_ids_are_rejected_everywhere(push_reg) -> None:
    with pytest.raises(ProtocolError):
        decode_push_reg(encode_push_reg(push_reg("")))
    for msg in (
        worker.RegisterRecv(request_id="", local_block_ids=[[1]], remote_engine_id="p", remote_host="h", remote_port=1),
        worker.SendReady(request_id="", block_ids=[[1]]),
        worker.Evict(request_ids=[""]),
    ):
        with pytest.raises(msgspec.ValidationError):
            worker.worker_decoder.decode(worker.encode(msg))


def test_extensions_at_their_defaults_are_not_encoded(push_reg) -> None:
    """An older P refuses a field it does not know: a field left at its default is not
    sent at all, so a D speaks to an older P by leaving the newer fields unset."""
    body = unpack(encode_push_reg(push_reg(decode_rank=0, decode_daemon_id="", match_key=""))[len(PUSH_REG_PREFIX):])
    assert set(body) == SEED_FIELDS
    keyed = unpack(encode_push_reg(push_reg(match_key="k-1"))[len(PUSH_REG_PREFIX):])
    assert keyed["match_key"] == "k-1"


class _PushRegOfSideChannel11(msgspec.Struct, forbid_unknown_fields=True):
    """PushReg as a side-channel 1.1 P decoded it: everything but ``match_key``."""

    request_id: str
    decode_engine_id: str
    decode_host: str
    decode_port: int
    decode_tp_size: int
    local_block_ids: list[list[int]]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int
    decode_rank: int = 0
    decode_daemon_id: str = ""


def test_a_11_p_decodes_a_push_reg_without_key_and_refuses_one_with_it(push_reg) -> None:
    old = msgspec.msgpack.Decoder(_PushRegOfSideChannel11)
    assert old.decode(encode_push_reg(push_reg())[len(PUSH_REG_PREFIX):]).request_id
    with pytest.raises(msgspec.ValidationError, match="match_key"):
        old.decode(encode_push_reg(push_reg(match_key="k"))[len(PUSH_REG_PREFIX):])


@pytest.mark.parametrize(("key", "ok"), [("", True), ("a" * 64, True), ("a" * 65, False), ("0f3a-9.b_c:d", True),
                                         ("with space", False), ("ü", False), ("a/b", False)])
def test_match_key_bounds(push_reg, key: str, ok: bool) -> None:
    body = {**msgspec.to_builtins(push_reg()), "match_key": key}
    if ok:
        assert decode_push_reg(PUSH_REG_PREFIX + pack(body)).match_key == key
        worker.worker_decoder.decode(pack({"t": "send_ready", "request_id": "r", "block_ids": [[1]], "match_key": key}))
    else:
        with pytest.raises(ProtocolError):
            decode_push_reg(PUSH_REG_PREFIX + pack(body))
        with pytest.raises(msgspec.ValidationError):
            worker.worker_decoder.decode(pack({"t": "register_recv", "request_id": "r", "local_block_ids": [[1]],
                                               "remote_engine_id": "p", "remote_host": "h", "remote_port": 1,
                                               "match_key": key}))


# ---------------------------------------------------------------- parts (side channel 1.3)


@pytest.mark.parametrize(("rid", "i", "k"), [("r", 0, 1), ("cmpl-a:b:c", 3, 7), ("x", 31, 32)])
def test_part_round_trips_and_a_whole_completion_is_part_0_of_1(rid: str, i: int, k: int) -> None:
    assert notif.decode_notification(notif.encode_part(rid, 4, i, k)) == (rid, 4, i, k)
    assert notif.decode_notification(notif.encode_completion(rid, 2)) == (rid, 2, 0, 1)


@pytest.mark.parametrize("payload", [
    b"PUSH_PART:1/0:r:1",  # no parts
    b"PUSH_PART:2/2:r:1",  # index past the last part
    b"PUSH_PART:0/33:r:1",  # more than 32 parts
    b"PUSH_PART:-1/2:r:1",
    b"PUSH_PART:1:r:1",  # no count
    b"PUSH_PART:1/2",  # no completion
    b"PUSH_PART:1/2:r",  # completion without tp
    b"PUSH_PART:1/2::1",  # empty request id
    b"PUSH_PART:000000001/2:r:1",  # overlong head
    b"PUSH_PART:\xff/2:r:1",
])
def test_malformed_parts_are_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        notif.decode_notification(payload)


def test_a_part_never_completes_the_request_at_an_older_decoder() -> None:
    """A D before 1.3 (``decode_completion`` only) reads a part as the completion of a
    request id it does not have, never of the request itself (P sends parts only to a D
    that advertised them)."""
    rid, _ = notif.decode_completion(notif.encode_part("r", 1, 0, 2))
    assert rid != "r" and rid.startswith("PUSH_PART:")
