"""Worker <-> daemon messages: round trips, bounds, and what the decoders refuse."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from pushsvc.errors import ProtocolError
from pushsvc.protocol import worker

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

# ---------------------------------------------------------------- worker <-> daemon

REGIONS = [
    worker.Region(buffer=0, offset=0, block_len=4096, num_blocks=128),
    worker.Region(
        buffer=1, offset=4096, block_len=2048, num_blocks=64, block_stride=8192, group=1, layer_names=["l0.k", "l0.v"]
    ),
]

WORKER_MESSAGES = [
    worker.Hello(engine_id="prefill-0", rank=3, tp_size=8, role="producer", pid=4242),
    worker.Hello(engine_id="decode-0", rank=0, tp_size=1, role="consumer"),
    worker.Hello(engine_id="both", rank=0, tp_size=1, role="both"),
    worker.Hello(engine_id="prefill-pp", rank=1, tp_size=2, role="producer", pp_rank=3, pp_size=4),
    worker.RegisterKV(memory=worker.MemfdBuffers(count=2), regions=REGIONS, blocks_per_logical=4),
    worker.RegisterKV(memory=worker.CudaIpcBuffers(device_uuid=bytes(range(16)), buffers=[
        worker.CudaIpcBuffer(handle=b"\x01" * 64, size=1 << 30), worker.CudaIpcBuffer(handle=b"\xff" * 64, size=7)]),
        regions=REGIONS),
    worker.RegisterRecv(
        request_id="cmpl-abc-0-deadbeef",
        local_block_ids=[[1, 2, 3], [9]],
        remote_engine_id="prefill-0",
        remote_host="10.0.0.1",
        remote_port=5600,
        remote_tp_size=4,
    ),
    worker.SendReady(request_id="cmpl-abc-0-1a2b3c4d", block_ids=[[0, 2**32 - 1], []]),
    worker.SendReady(request_id="packed", block_ids=[np.arange(300, dtype="<u4").tobytes(), [7], b""]),
    worker.Evict(request_ids=["a", "b", "c"]),
    worker.Evict(request_ids=[]),
    worker.Ping(token=2**63 - 1),
    worker.Describe(),
    worker.Ping(),
    worker.Reported(sending=["a"], recving=["b", "c"], at=12345.678),
    worker.Reported(),
    worker.RegisterKV(memory=worker.CudaIpcBuffers(device_uuid=bytes(range(16)), buffers=[
        worker.CudaIpcBuffer(handle=b"\x02" * 64, size=1 << 20)]), regions=REGIONS,
        layer_events=[b"\x03" * 64, b"\x04" * 64]),
    worker.SendStart(request_id="cmpl-p-1", block_ids=[[4, 5], [1]], step=2**63 - 1, match_key="xfer-1"),
    worker.SendStart(request_id="r", block_ids=[], step=0),
    worker.LayerSaved(step=3, layer=16383),
    worker.StepSaved(step=3),
]

DAEMON_MESSAGES = [
    worker.Welcome(daemon_id="d-1", engine_id="e", side_channel_host="h", side_channel_port=5600, max_frame=1 << 26),
    worker.KVRegistered(agent_name="agent-0", regions=2, bytes=1 << 33),
    worker.KVRegistered(agent_name="agent-1", regions=64, bytes=1 << 33, mem_type="VRAM", landing_slots=1024),
    worker.RecvDone(request_id="r"),
    worker.RecvFailed(request_id="r", block_ids=[1, 2, 3], reason="handshake failed"),
    worker.SendDone(request_id="r"),
    worker.SendFailed(request_id="r", reason="lease expired"),
    worker.Pong(token=7),
    worker.Pong(),
    worker.Error(code="bad_request", message="what", request_id="r"),
    worker.Error(code="bad_request", message="what"),
]

WORKER_TAGS = {
    worker.Hello: "hello",
    worker.RegisterKV: "register_kv",
    worker.RegisterRecv: "register_recv",
    worker.SendReady: "send_ready",
    worker.Evict: "evict",
    worker.Ping: "ping",
    worker.Describe: "describe",
    worker.Reported: "reported",
    worker.SendStart: "send_start",
    worker.LayerSaved: "layer_saved",
    worker.StepSaved: "step_saved",
    worker.Welcome: "welcome",
    worker.KVRegistered: "kv_registered",
    worker.RecvDone: "recv_done",
    worker.RecvFailed: "recv_failed",
    worker.SendDone: "send_done",
    worker.SendFailed: "send_failed",
    worker.Pong: "pong",
    worker.Error: "error",
}


def test_every_message_type_is_exercised() -> None:
    union_types = set(worker.WorkerMessage.__args__) | set(worker.DaemonMessage.__args__)
    assert {type(m) for m in WORKER_MESSAGES + DAEMON_MESSAGES} == union_types == set(WORKER_TAGS)


@pytest.mark.parametrize("msg", WORKER_MESSAGES, ids=lambda m: type(m).__name__)
def test_worker_message_round_trip(msg: msgspec.Struct) -> None:
    data = worker.encode(msg)
    assert worker.worker_decoder.decode(data) == msg
    assert unpack(data)["t"] == WORKER_TAGS[type(msg)]


@pytest.mark.parametrize("msg", DAEMON_MESSAGES, ids=lambda m: type(m).__name__)
def test_daemon_message_round_trip(msg: msgspec.Struct) -> None:
    data = worker.encode(msg)
    assert worker.daemon_decoder.decode(data) == msg
    assert unpack(data)["t"] == WORKER_TAGS[type(msg)]


def test_defaults_are_omitted_on_the_wire() -> None:
    assert unpack(worker.encode(worker.Ping())) == {"t": "ping"}
    hello = unpack(worker.encode(worker.Hello(engine_id="e", rank=0, tp_size=1, role="producer")))
    assert hello == {"t": "hello", "engine_id": "e", "rank": 0, "tp_size": 1, "role": "producer"}
    region = unpack(worker.encode(worker.RegisterKV(memory=worker.MemfdBuffers(count=1), regions=REGIONS[:1])))
    assert region["regions"] == [{"buffer": 0, "offset": 0, "block_len": 4096, "num_blocks": 128}]


def test_region_stride_defaults_to_block_len() -> None:
    assert REGIONS[0].stride == 4096
    assert REGIONS[1].stride == 8192


def test_a_region_whose_blocks_overlap_does_not_decode() -> None:
    """A stride below the block length: a copy into one block would write its neighbour,
    which another request may hold."""
    raw = {"t": "register_kv", "memory": {"t": "memfd", "count": 1},
           "regions": [{"buffer": 0, "offset": 0, "block_len": 4096, "num_blocks": 128, "block_stride": 2048}]}
    with pytest.raises(msgspec.ValidationError, match="overlap"):
        worker.worker_decoder.decode(msgspec.msgpack.encode(raw))
    raw["regions"][0]["block_stride"] = 4096
    assert worker.worker_decoder.decode(msgspec.msgpack.encode(raw)).regions[0].stride == 4096


def test_directions_do_not_decode_each_others_messages() -> None:
    with pytest.raises(msgspec.ValidationError):
        worker.worker_decoder.decode(worker.encode(worker.Pong(token=1)))
    with pytest.raises(msgspec.ValidationError):
        worker.daemon_decoder.decode(worker.encode(worker.Ping(token=1)))


def _hello(**changes: Any) -> dict[str, Any]:
    return {"t": "hello", "engine_id": "e", "rank": 0, "tp_size": 1, "role": "producer", **changes}


def _send_ready(**changes: Any) -> dict[str, Any]:
    return {"t": "send_ready", "request_id": "r", "block_ids": [[1, 2]], **changes}


def _register_recv(**changes: Any) -> dict[str, Any]:
    return {
        "t": "register_recv",
        "request_id": "r",
        "local_block_ids": [[1]],
        "remote_engine_id": "p",
        "remote_host": "h",
        "remote_port": 5600,
        **changes,
    }


def _register_kv(memory: Any = None, region: Any = None, **changes: Any) -> dict[str, Any]:
    r = {"buffer": 0, "offset": 0, "block_len": 16, "num_blocks": 4, **(region or {})}
    return {"t": "register_kv", "memory": memory or {"t": "memfd", "count": 1}, "regions": [r], **changes}


def _ipc(**changes: Any) -> dict[str, Any]:
    return {"handle": b"\x07" * 64, "size": 1 << 20, **changes}


def _cuda(**changes: Any) -> dict[str, Any]:
    return {"t": "cuda_ipc", "device_uuid": b"\x0a" * 16, "buffers": [_ipc()], **changes}


def test_valid_raw_maps_decode() -> None:
    """The builders below are valid as-is, so every rejection is due to the one change."""
    for raw in (_hello(), _send_ready(), _register_recv(), _register_kv(), _register_kv(memory=_cuda())):
        worker.worker_decoder.decode(pack(raw))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_hello(extra=1), id="unknown-field"),
        pytest.param(_register_kv(region={"extra": 1}), id="unknown-nested-region-field"),
        pytest.param(_register_kv(memory={"t": "memfd", "count": 1, "fds": [3]}), id="unknown-memory-field"),
        pytest.param({**_hello(), "t": "goodbye"}, id="unknown-tag"),
        pytest.param({k: v for k, v in _hello().items() if k != "t"}, id="missing-tag"),
        pytest.param({"t": 1}, id="tag-wrong-type"),
        pytest.param(_register_kv(memory={"t": "shm", "count": 1}), id="unknown-memory-tag"),
        pytest.param({k: v for k, v in _hello().items() if k != "rank"}, id="missing-field"),
        pytest.param(_hello(rank="0"), id="rank-as-string"),
        pytest.param(_hello(tp_size=True), id="bool-as-int"),
        pytest.param(_hello(tp_size=1.0), id="float-as-int"),
        pytest.param(_hello(role="leader"), id="role-not-in-literal"),
        pytest.param(_hello(tp_size=0), id="tp-zero"),
        pytest.param(_hello(tp_size=1025), id="tp-too-large"),
        pytest.param(_hello(rank=-1), id="negative-rank"),
        pytest.param(_hello(pid=2**32), id="pid-over-u32"),
        pytest.param(_hello(pp_size=0), id="pp-zero"),
        pytest.param(_hello(pp_size=257), id="pp-too-large"),
        pytest.param(_hello(pp_rank=-1), id="pp-rank-negative"),
        pytest.param(_hello(pp_rank=256), id="pp-rank-too-large"),
        pytest.param(_hello(engine_id="e" * 257), id="name-too-long"),
        pytest.param(_send_ready(block_ids=[[1, -1]]), id="negative-block-id"),
        pytest.param(_send_ready(block_ids=[[2**32]]), id="block-id-over-u32"),
        pytest.param(_send_ready(block_ids=[["1"]]), id="block-id-as-string"),
        pytest.param(_send_ready(block_ids=[1, 2]), id="block-ids-not-grouped"),
        pytest.param(_send_ready(block_ids=[[]] * 65), id="too-many-groups"),
        pytest.param(_register_recv(local_block_ids=[[-3]]), id="recv-negative-block-id"),
        pytest.param(_register_recv(remote_port=65536), id="port-too-large"),
        pytest.param(_register_recv(remote_port=-1), id="port-negative"),
        pytest.param(_register_recv(remote_port="5600"), id="port-as-string"),
        pytest.param(_register_recv(remote_tp_size=0), id="recv-tp-zero"),
        pytest.param({"t": "evict", "request_ids": ["r"] * 65537}, id="evict-list-too-long"),
        pytest.param({"t": "evict", "request_ids": "r"}, id="evict-not-a-list"),
        pytest.param({"t": "ping", "token": -1}, id="token-negative"),
        pytest.param({"t": "ping", "token": 2**63}, id="token-over-u63"),
        pytest.param(_register_kv(regions=[]), id="no-regions"),
        pytest.param(_register_kv(region={"block_len": 0}), id="region-block-len-zero"),
        pytest.param(_register_kv(region={"num_blocks": 0}), id="region-num-blocks-zero"),
        pytest.param(_register_kv(region={"num_blocks": 2**31}), id="region-num-blocks-too-large"),
        pytest.param(_register_kv(region={"group": 64}), id="region-group-too-large"),
        pytest.param(_register_kv(region={"offset": -1}), id="region-offset-negative"),
        pytest.param(_register_kv(region={"layer_names": ["x" * 257]}), id="layer-name-too-long"),
        pytest.param(_register_kv(blocks_per_logical=0), id="blocks-per-logical-zero"),
        pytest.param(_register_kv(blocks_per_logical=1025), id="blocks-per-logical-too-large"),
        pytest.param(_register_kv(memory={"t": "memfd", "count": 0}), id="memfd-count-zero"),
        pytest.param(_register_kv(memory={"t": "memfd", "count": 251}), id="memfd-count-too-large"),
        pytest.param(_register_kv(memory={"t": "daemon_arena", "device": 0, "sizes": [1 << 30]}),
                     id="arena-no-longer-a-kind"),
        pytest.param(_register_kv(memory=_cuda(buffers=[])), id="cuda-no-buffers"),
        pytest.param(_register_kv(memory=_cuda(buffers=[_ipc()] * 4097)), id="cuda-too-many-buffers"),
        pytest.param(_register_kv(memory=_cuda(device_uuid=b"\0" * 15)), id="cuda-uuid-short"),
        pytest.param(_register_kv(memory=_cuda(device_uuid=b"\0" * 17)), id="cuda-uuid-long"),
        pytest.param(_register_kv(memory=_cuda(buffers=[_ipc(handle=b"\0" * 63)])), id="cuda-handle-short"),
        pytest.param(_register_kv(memory=_cuda(buffers=[_ipc(handle=b"\0" * 65)])), id="cuda-handle-long"),
        pytest.param(_register_kv(memory=_cuda(buffers=[_ipc(size=0)])), id="cuda-size-zero"),
        pytest.param(_register_kv(memory=_cuda(buffers=[_ipc(size=-1)])), id="cuda-size-negative"),
        pytest.param(_register_kv(memory=_cuda(buffers=[{**_ipc(), "extra": 1}])), id="cuda-unknown-field"),
        pytest.param(_register_kv(memory=_cuda(device_uuid="0" * 16)), id="cuda-uuid-not-bytes"),
        pytest.param({**_register_kv(memory=_cuda()), "layer_events": [b"\0" * 63]}, id="layer-event-short"),
        pytest.param({**_register_kv(memory=_cuda()), "layer_events": [b"\0" * 65]}, id="layer-event-long"),
        pytest.param({**_register_kv(memory=_cuda()), "layer_events": [b"\0" * 64] * 16386},
                     id="too-many-layer-events"),
        pytest.param({**_register_kv(memory=_cuda()), "layer_events": "x" * 64}, id="layer-events-not-a-list"),
        pytest.param({"t": "send_start", "request_id": "r", "block_ids": [[1]]}, id="send-start-no-step"),
        pytest.param({"t": "send_start", "request_id": "r", "block_ids": [[1]], "step": -1}, id="step-negative"),
        pytest.param({"t": "send_start", "request_id": "", "block_ids": [[1]], "step": 1}, id="send-start-empty-id"),
        pytest.param({"t": "layer_saved", "step": 1, "layer": 16384}, id="layer-too-large"),
        pytest.param({"t": "layer_saved", "step": 1, "layer": -1}, id="layer-negative"),
        pytest.param({"t": "layer_saved", "step": 1}, id="layer-missing"),
        pytest.param({"t": "step_saved", "step": 2**63}, id="step-over-u63"),
        pytest.param({"t": "step_saved", "step": 1, "layer": 0}, id="step-saved-unknown-field"),
        pytest.param([1, 2, 3], id="array-not-map"),
        pytest.param("hello", id="string-not-map"),
    ],
)
def test_worker_decoder_rejects_invalid_messages(raw: Any) -> None:
    with pytest.raises(msgspec.ValidationError):
        worker.worker_decoder.decode(pack(raw))


def test_worker_decoder_accepts_bounds() -> None:
    ok = [
        _hello(tp_size=1024, rank=2**32 - 1, pid=2**32 - 1),
        _hello(pp_rank=255, pp_size=256),
        _send_ready(block_ids=[[0, 2**32 - 1]] + [[]] * 63),
        _register_recv(remote_port=65535),
        _register_recv(remote_port=0),
        _hello(engine_id="e" * 256),
        _register_kv(region={"group": 63, "num_blocks": 2**31 - 1}, blocks_per_logical=1024),
        _register_kv(memory={"t": "memfd", "count": 64}),
        {"t": "evict", "request_ids": ["r"] * 65536},
        {"t": "send_start", "request_id": "r" * 256, "block_ids": [[2**32 - 1]], "step": 2**63 - 1},
        {"t": "layer_saved", "step": 0, "layer": 16383},
    ]
    for raw in ok:
        worker.worker_decoder.decode(pack(raw))


def test_block_group_longer_than_cap_is_rejected() -> None:
    ok = pack(_send_ready(block_ids=[list(range(1 << 20))]))
    assert len(worker.worker_decoder.decode(ok).block_ids[0]) == 1 << 20
    with pytest.raises(msgspec.ValidationError):
        worker.worker_decoder.decode(pack(_send_ready(block_ids=[list(range((1 << 20) + 1))])))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x81\xa1t", b"\xff\xff\xff\xff"], ids=repr)
def test_worker_decoder_rejects_garbage(data: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        worker.worker_decoder.decode(data)


def test_worker_decoder_rejects_trailing_bytes() -> None:
    with pytest.raises(msgspec.DecodeError):
        worker.worker_decoder.decode(worker.encode(worker.Ping()) + b"\x00")


def test_daemon_decoder_rejects_unknown_fields_and_tags() -> None:
    with pytest.raises(msgspec.ValidationError):
        worker.daemon_decoder.decode(pack({"t": "recv_done", "request_id": "r", "x": 1}))
    with pytest.raises(msgspec.ValidationError):
        worker.daemon_decoder.decode(pack({"t": "recv_maybe", "request_id": "r"}))


# ---------------------------------------------------------------- packed ids (1.7)


def test_long_groups_are_packed_short_ones_stay_lists() -> None:
    long, short = list(range(worker.PACK_MIN_IDS, 2 * worker.PACK_MIN_IDS)), [5, 3]
    packed = worker.pack_ids([long, short, []])
    assert packed[0] == np.asarray(long, dtype="<u4").tobytes() and packed[1:] == [short, []]
    assert [list(map(int, g)) for g in worker.unpack_ids(packed)] == [long, short, []]


def test_packed_ids_survive_the_wire_and_keep_every_u32() -> None:
    ids = [2**32 - 1, 0] + list(range(1, worker.PACK_MIN_IDS))
    msg = worker.SendReady(request_id="r", block_ids=worker.pack_ids([ids]))
    got = worker.worker_decoder.decode(worker.encode(msg))
    unpacked = worker.unpack_ids(got.block_ids)[0]
    assert isinstance(unpacked, np.ndarray) and unpacked.dtype == np.int64 and unpacked.tolist() == ids


def test_a_group_that_does_not_fit_u32_is_not_packed() -> None:
    """It stays a list, which the decoder refuses, naming it; packing never wraps it."""
    bad = [-1] + list(range(worker.PACK_MIN_IDS))
    assert worker.pack_ids([bad]) == [bad]
    with pytest.raises(msgspec.ValidationError, match=r"block_ids\[0\]\[0\]"):
        worker.worker_decoder.decode(worker.encode(worker.SendReady(request_id="r", block_ids=worker.pack_ids([bad]))))


@pytest.mark.parametrize("size", [1, 5, 1023])
def test_packed_ids_that_are_not_whole_u32s_are_refused(size: int) -> None:
    with pytest.raises(ProtocolError, match=f"group 1: {size} bytes"):
        worker.unpack_ids([[1], b"\0" * size])


def test_a_packed_group_longer_than_the_cap_is_refused() -> None:
    cap = 4 * worker.MAX_GROUP_IDS
    ok = worker.worker_decoder.decode(pack(_send_ready(block_ids=[b"\0" * cap])))
    assert len(worker.unpack_ids(ok.block_ids)[0]) == worker.MAX_GROUP_IDS
    with pytest.raises(msgspec.ValidationError):
        worker.worker_decoder.decode(pack(_send_ready(block_ids=[b"\0" * (cap + 4)])))
    with pytest.raises(msgspec.ValidationError):  # packed ids only where P hands its blocks over
        worker.worker_decoder.decode(pack(_register_recv(local_block_ids=[b"\0" * 4])))


def test_packing_without_a_native_u32_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = [2**32 - 1, 0] + list(range(1, worker.PACK_MIN_IDS))
    native = worker.pack_ids([ids])
    monkeypatch.setattr(worker, "_NATIVE_U32", False)
    assert worker.pack_ids([ids]) == native == [np.asarray(ids, dtype="<u4").tobytes()]
    assert worker.pack_ids([[-1] + ids]) == [[-1] + ids]  # does not fit: stays a list here too
