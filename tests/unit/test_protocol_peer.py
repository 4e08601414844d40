"""Daemon <-> daemon side-channel messages: round trips, bounds, what the decoder refuses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pushsvc.protocol import peer, worker

pack = msgspec.msgpack.encode
unpack = msgspec.msgpack.decode

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
    device=7,
    parts=True,
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
    peer.RegSent(request_id="cmpl-abc-0-deadbeef", rank=1, match_key="x-7f3a.0"),
    peer.RegSent(request_id="r", rank=0),
    peer.AgentsUpdate(agents=[msgspec.structs.replace(AGENT, ipc=peer.IpcKV(
        host="8f1c2d3e-0000-4000-8000-000000000001", device=bytes(range(16)),
        buffers=[peer.IpcBuffer(handle=bytes(64), size=1 << 30)],
        regions=[peer.IpcRegion(buffer=0, offset=0, num_blocks=900),
                 peer.IpcRegion(buffer=0, offset=1 << 20, num_blocks=3, block_stride=128)]))]),
    peer.IpcReady(agent_name="decode-0/r1/abcd.3"),
    peer.IpcWithdrawn(agent_name="decode-0/r1/abcd.3"),
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
    peer.RegSent: "reg_sent",
    peer.IpcReady: "ipc_ready",
    peer.IpcWithdrawn: "ipc_withdrawn",
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
    # A stride below the block length overlaps only where there is a next block.
    peer.peer_decoder.decode(pack(_peer_hello(agents=[_agent(regions=[_region_info(block_stride=8, num_blocks=1)])])))


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
        pytest.param(_peer_hello(agents=[_agent(regions=[_region_info(block_stride=8)])]), id="region-blocks-overlap"),
        pytest.param({"t": "push_failed", "request_id": "r", "rank": -1, "reason": "x"}, id="push-failed-rank"),
        pytest.param({"t": "push_failed", "request_id": "r", "rank": 0, "reason": "x" * 4097}, id="reason-too-long"),
        pytest.param({"t": "push_failed", "request_id": "r", "rank": 0}, id="push-failed-missing-reason"),
        pytest.param({"t": "hb", "seq": -1}, id="heartbeat-seq-negative"),
        pytest.param({"t": "reg_sent", "request_id": "r", "rank": 0, "match_key": "a b"}, id="reg-sent-key-pattern"),
        pytest.param({"t": "reg_sent", "request_id": "r", "rank": 0, "match_key": "k" * 65}, id="reg-sent-key-long"),
        pytest.param({"t": "reg_sent", "request_id": "r" * 257, "rank": 0}, id="reg-sent-id-long"),
        pytest.param({"t": "reg_sent", "rank": 0}, id="reg-sent-missing-id"),
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


def test_a_cpu_agent_encodes_as_before_1_3() -> None:
    """``device`` and ``parts`` are left out at their defaults, so a CPU agent's hello
    still decodes at a 1.2 peer (whose decoder refuses unknown fields)."""
    cpu = peer.AgentInfo(rank=0, tp_size=1, agent_name="a", metadata=b"m", regions=[])
    assert set(unpack(pack(cpu))) == {"rank", "tp_size", "agent_name", "metadata", "regions"}
    gpu = msgspec.structs.replace(cpu, mem_type="VRAM", device=1, parts=True)
    assert {"device", "parts"} <= set(unpack(pack(gpu)))


@pytest.mark.parametrize("change", [{"handle": bytes(63)}, {"handle": bytes(65)}, {"size": 0}, {"size": 2**48 + 1}])
def test_ipc_buffer_bounds(change: dict) -> None:
    raw = {**msgspec.to_builtins(peer.IpcBuffer(handle=bytes(64), size=1)), **change}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(pack(raw), type=peer.IpcBuffer)


@pytest.mark.parametrize("change", [{"device": bytes(15)}, {"buffers": [{"handle": bytes(64), "size": 1}] * 16385},
                                    {"regions": [{"buffer": 16384, "offset": 0, "num_blocks": 1}]},
                                    {"regions": [{"buffer": 0, "offset": 0, "num_blocks": 0}]}])
def test_ipc_kv_bounds(change: dict) -> None:
    raw = {**msgspec.to_builtins(peer.IpcKV(host="h", device=bytes(16), buffers=[], regions=[])), **change}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(pack(raw), type=peer.IpcKV)


@pytest.mark.parametrize("change", [{"device": -1}, {"device": 1024}, {"parts": "yes"}])
def test_agent_info_1_3_bounds(change: dict) -> None:
    raw = {**msgspec.to_builtins(peer.AgentInfo(rank=0, tp_size=1, agent_name="a", metadata=b"m", regions=[])),
           **change}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(pack(raw), type=peer.AgentInfo)


@pytest.mark.parametrize("message", [
    peer.PushFailed(request_id="r", rank=1, reason="x"),
    peer.CancelPush(request_id="r", rank=1),
    peer.PushCancelled(request_id="r", rank=1),
    peer.WriteStarted(request_id="r", rank=1, nbytes=4),
])
def test_source_rank_is_left_out_at_equal_tp(message: msgspec.Struct) -> None:
    """At equal TP a message is about the P rank of D's rank number: ``source_rank`` is not
    encoded (a 1.4 peer, whose decoder refuses unknown fields, reads it); with P TP
    = k x D TP it names the P rank meant."""
    assert "source_rank" not in unpack(pack(message)) and peer.source_rank(message) == 1
    other = msgspec.structs.replace(message, source_rank=3)
    assert unpack(pack(other))["source_rank"] == 3 and peer.source_rank(other) == 3
    assert peer.peer_decoder.decode(peer.encode(other)) == other


@pytest.mark.parametrize("raw", [{"source_rank": -2}, {"source_rank": 256 * 1024}])
def test_source_rank_bounds(raw: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        peer.peer_decoder.decode(pack({"t": "cancel", "request_id": "r", "rank": 0, **raw}))


def test_a_source_rank_names_a_pipeline_stage_s_rank() -> None:
    """1.7: source ids of a pipeline-parallel P run past one stage's TP."""
    top = peer.CancelPush(request_id="r", rank=0, source_rank=256 * 1024 - 1)
    assert peer.peer_decoder.decode(peer.encode(top)) == top and peer.source_rank(top) == 256 * 1024 - 1


def test_a_stage_agent_says_its_stage_and_is_announced_from_1_7_only() -> None:
    """An agent of one stage is encoded as before 1.7; a pipeline stage's agent names its
    stage, its source id runs over the stages, and a peer before 1.7 never hears of it (it
    would take the stage's layers for all of them)."""
    plain = peer.AgentInfo(rank=1, tp_size=2, agent_name="a", metadata=b"m", regions=[])
    assert "stage" not in unpack(pack(plain)) and "stages" not in unpack(pack(plain)) and plain.source == 1
    staged = msgspec.structs.replace(plain, agent_name="b", stage=2, stages=3)
    assert unpack(pack(staged))["stage"] == 2 and unpack(pack(staged))["stages"] == 3
    assert staged.source == 2 * 2 + 1
    first = msgspec.structs.replace(plain, agent_name="c", stage=0, stages=3)
    assert peer.announceable([plain, staged, first], peer.STAGES_MINOR) == [plain, staged, first]
    assert peer.announceable([plain, staged, first], peer.STAGES_MINOR - 1) == [plain]


@pytest.mark.parametrize("change", [{"stage": -1}, {"stage": 256}, {"stages": 0}, {"stages": 257}])
def test_agent_info_stage_bounds(change: dict) -> None:
    raw = {**msgspec.to_builtins(peer.AgentInfo(rank=0, tp_size=1, agent_name="a", metadata=b"m", regions=[])),
           **change}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(pack(raw), type=peer.AgentInfo)


def test_region_heads_are_left_out_unless_head_major() -> None:
    plain = peer.RegionInfo(base=0, block_len=16, num_blocks=4)
    assert "heads" not in unpack(pack(plain)) and "replicated" not in unpack(pack(plain))
    assert unpack(pack(msgspec.structs.replace(plain, replicated=True)))["replicated"] is True
    assert unpack(pack(msgspec.structs.replace(plain, heads=8)))["heads"] == 8
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(pack(_region_info(heads=-1)), type=peer.RegionInfo)
