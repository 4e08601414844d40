"""Wire messages: worker <-> daemon, daemon <-> daemon, and NIXL notification payloads."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushsvc.errors import ProtocolError
from pushsvc.protocol import peer, worker
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
    worker.RegisterKV(memory=worker.MemfdBuffers(count=2), regions=REGIONS, blocks_per_logical=4),
    worker.RegisterKV(memory=worker.DaemonArena(device=1, sizes=[1 << 30, 2 << 30]), regions=REGIONS[:1]),
    worker.RegisterRecv(
        request_id="cmpl-abc-0-deadbeef",
        local_block_ids=[[1, 2, 3], [9]],
        remote_engine_id="prefill-0",
        remote_host="10.0.0.1",
        remote_port=5600,
        remote_tp_size=4,
    ),
    worker.SendReady(request_id="cmpl-abc-0-1a2b3c4d", block_ids=[[0, 2**32 - 1], []]),
    worker.Evict(request_ids=["a", "b", "c"]),
    worker.Evict(request_ids=[]),
    worker.Ping(token=2**63 - 1),
    worker.Describe(),
    worker.Ping(),
]

DAEMON_MESSAGES = [
    worker.Welcome(daemon_id="d-1", engine_id="e", side_channel_host="h", side_channel_port=5600, max_frame=1 << 26),
    worker.KVRegistered(agent_name="agent-0", regions=2, bytes=1 << 33),
    worker.ArenaGranted(ipc_handles=[b"\x00" * 64, b"\xff" * 64]),
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
    worker.Welcome: "welcome",
    worker.KVRegistered: "kv_registered",
    worker.ArenaGranted: "arena_granted",
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


def test_valid_raw_maps_decode() -> None:
    """The builders below are valid as-is, so every rejection is due to the one change."""
    for raw in (_hello(), _send_ready(), _register_recv(), _register_kv()):
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
        pytest.param(_register_kv(memory={"t": "daemon_arena", "device": 0, "sizes": []}), id="arena-no-sizes"),
        pytest.param(_register_kv(memory={"t": "daemon_arena", "device": 0, "sizes": [1] * 65}), id="arena-too-many"),
        pytest.param(_register_kv(memory={"t": "daemon_arena", "device": 0, "sizes": [-1]}), id="arena-negative"),
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
        _send_ready(block_ids=[[0, 2**32 - 1]] + [[]] * 63),
        _register_recv(remote_port=65535),
        _register_recv(remote_port=0),
        _hello(engine_id="e" * 256),
        _register_kv(region={"group": 63, "num_blocks": 2**31 - 1}, blocks_per_logical=1024),
        _register_kv(memory={"t": "memfd", "count": 64}),
        {"t": "evict", "request_ids": ["r"] * 65536},
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


# ---------------------------------------------------------------- daemon <-> daemon

AGENT = peer.AgentInfo(
    rank=1,
    tp_size=2,
    agent_name="prefill-0-rank1",
    metadata=b"\x00nixl-md\xff",
    regions=[
        peer.RegionInfo(base=0x7F0000000000, block_len=4096, num_blocks=100),
        peer.RegionInfo(base=2**63 - 1, block_len=1, num_blocks=1, block_stride=64, group=3, layer_names=["a", "b"]),
    ],
    blocks_per_logical=2,
    mem_type="VRAM",
)

PEER_MESSAGES = [
    peer.PeerHello(
        daemon_id="d-1",
        engine_id="prefill-0",
        side_channel_host="10.0.0.1",
        side_channel_port=5600,
        agents=[AGENT, peer.AgentInfo(rank=0, tp_size=2, agent_name="a0", metadata=b"", regions=[])],
        heartbeat_interval_s=0.25,
    ),
    peer.PeerHello(daemon_id="d", engine_id="e", side_channel_host="h", side_channel_port=0, agents=[]),
    peer.AgentsUpdate(agents=[AGENT]),
    peer.PushFailed(request_id="cmpl-abc-0-deadbeef", rank=3, reason="handshake failed"),
    peer.CancelPush(request_id="cmpl-abc-0-deadbeef", rank=1),
    peer.PushCancelled(request_id="cmpl-abc-0-deadbeef", rank=1),
    peer.WriteStarted(request_id="cmpl-abc-0-deadbeef", rank=1, nbytes=1 << 20),
    peer.Heartbeat(seq=12),
    peer.Heartbeat(),
    peer.Goodbye(reason="shutdown"),
    peer.Goodbye(),
    peer.AuthChallenge(nonce=bytes(range(32)), daemon_id="d-1"),
    peer.AuthProof(mac=b"\xab" * 32),
]

PEER_TAGS = {
    peer.PeerHello: "hello",
    peer.AgentsUpdate: "agents",
    peer.PushFailed: "push_failed",
    peer.CancelPush: "cancel",
    peer.PushCancelled: "cancelled",
    peer.WriteStarted: "writing",
    peer.Heartbeat: "hb",
    peer.Goodbye: "bye",
    peer.AuthChallenge: "auth_challenge",
    peer.AuthProof: "auth_proof",
}


def test_every_peer_message_type_is_exercised() -> None:
    assert {type(m) for m in PEER_MESSAGES} == set(peer.PeerMessage.__args__) == set(PEER_TAGS)


@pytest.mark.parametrize("msg", PEER_MESSAGES, ids=lambda m: type(m).__name__)
def test_peer_message_round_trip(msg: msgspec.Struct) -> None:
    data = peer.encode(msg)
    assert peer.peer_decoder.decode(data) == msg
    assert unpack(data)["t"] == PEER_TAGS[type(msg)]


def test_region_info_stride() -> None:
    assert AGENT.regions[0].stride == 4096
    assert AGENT.regions[1].stride == 64


def test_agent_info_defaults() -> None:
    agent = peer.AgentInfo(rank=0, tp_size=1, agent_name="a", metadata=b"m", regions=[])
    assert agent.blocks_per_logical == 1
    assert agent.mem_type == "DRAM"


def test_protocol_magics_differ() -> None:
    """A worker dialling the side-channel port (or a peer the socket) fails at the preamble."""
    assert len(worker.MAGIC) == len(peer.MAGIC) == 4
    assert worker.MAGIC != peer.MAGIC


def _agent(**changes: Any) -> dict[str, Any]:
    return {"rank": 0, "tp_size": 1, "agent_name": "a", "metadata": b"m", "regions": [], **changes}


def _peer_hello(**changes: Any) -> dict[str, Any]:
    return {
        "t": "hello",
        "daemon_id": "d",
        "engine_id": "e",
        "side_channel_host": "h",
        "side_channel_port": 5600,
        "agents": [_agent()],
        **changes,
    }


def _region_info(**changes: Any) -> dict[str, Any]:
    return {"base": 0, "block_len": 16, "num_blocks": 4, **changes}


def test_valid_raw_peer_maps_decode() -> None:
    peer.peer_decoder.decode(pack(_peer_hello()))
    peer.peer_decoder.decode(pack(_peer_hello(agents=[_agent(regions=[_region_info()])])))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_peer_hello(extra=1), id="unknown-field"),
        pytest.param(_peer_hello(agents=[_agent(extra=1)]), id="unknown-agent-field"),
        pytest.param(_peer_hello(agents=[_agent(regions=[_region_info(extra=1)])]), id="unknown-region-field"),
        pytest.param({**_peer_hello(), "t": "helo"}, id="unknown-tag"),
        pytest.param(_peer_hello(side_channel_port=65536), id="port-too-large"),
        pytest.param(_peer_hello(side_channel_port=-1), id="port-negative"),
        pytest.param(_peer_hello(heartbeat_interval_s=0), id="heartbeat-zero"),
        pytest.param(_peer_hello(heartbeat_interval_s=3601), id="heartbeat-too-long"),
        pytest.param(_peer_hello(heartbeat_interval_s="1"), id="heartbeat-as-string"),
        pytest.param(_peer_hello(agents=[_agent()] * 1025), id="too-many-agents"),
        pytest.param(_peer_hello(agents=[_agent(tp_size=0)]), id="agent-tp-zero"),
        pytest.param(_peer_hello(agents=[_agent(rank=-1)]), id="agent-rank-negative"),
        pytest.param(_peer_hello(agents=[_agent(mem_type="HBM")]), id="mem-type-unknown"),
        pytest.param(_peer_hello(agents=[_agent(mem_type="dram")]), id="mem-type-lower-case"),
        pytest.param(_peer_hello(agents=[_agent(metadata="text")]), id="metadata-not-bytes"),
        pytest.param(_peer_hello(agents=[_agent(blocks_per_logical=0)]), id="agent-ratio-zero"),
        pytest.param(_peer_hello(agents=[_agent(regions=[_region_info(base=-1)])]), id="region-base-negative"),
        pytest.param(_peer_hello(agents=[_agent(regions=[_region_info(block_len=0)])]), id="region-block-len-zero"),
        pytest.param(_peer_hello(agents=[_agent(regions=[_region_info(group=64)])]), id="region-group-too-large"),
        pytest.param({"t": "push_failed", "request_id": "r", "rank": -1, "reason": "x"}, id="push-failed-rank"),
        pytest.param({"t": "push_failed", "request_id": "r", "rank": 0, "reason": "x" * 4097}, id="reason-too-long"),
        pytest.param({"t": "push_failed", "request_id": "r", "rank": 0}, id="push-failed-missing-reason"),
        pytest.param({"t": "hb", "seq": -1}, id="heartbeat-seq-negative"),
        pytest.param({"t": "agents", "agents": {}}, id="agents-not-a-list"),
    ],
)
def test_peer_decoder_rejects_invalid_messages(raw: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        peer.peer_decoder.decode(pack(raw))


def test_peer_decoder_does_not_accept_worker_hello() -> None:
    with pytest.raises(msgspec.ValidationError):
        peer.peer_decoder.decode(worker.encode(worker.Hello(engine_id="e", rank=0, tp_size=1, role="producer")))


def test_peer_decoder_rejects_garbage() -> None:
    with pytest.raises(msgspec.DecodeError):
        peer.peer_decoder.decode(b"\xc1\x00")


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
    assert set(body) - SEED_FIELDS <= {"decode_rank", "decode_daemon_id"}


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
