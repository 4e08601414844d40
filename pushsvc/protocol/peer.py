"""Daemon <-> daemon side-channel messages (TCP).

A session opens with the preamble (``PSVP`` + version), then each side sends one
``PeerHello`` describing its daemon and every local NIXL agent: agent metadata and the
KV layout a remote needs to address blocks. With a shared secret configured, an
``AuthChallenge``/``AuthProof`` exchange (see ``peer_auth``) comes first, and no hello
is sent before the peer's proof checks. Afterwards either side may send
``AgentsUpdate`` (a worker registered KV later), ``PushFailed`` (P cannot WRITE a
registration: D fails the request at once), ``CancelPush``/``PushCancelled`` (D
withdraws a registration and learns when its blocks are safe to reuse), ``RegSent`` and
``WriteStarted`` (a registration's PUSH_REGs went out; a WRITE is being posted: the other
side polls without delay), ``IpcReady``/``IpcWithdrawn`` (same-host push) and
``Heartbeat`` (liveness).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from pushsvc.protocol.peer_auth import MAC_LEN, NONCE_LEN
from pushsvc.protocol.worker import U32, U64, MatchKey, Name, Text, check_stride

MAGIC = b"PSVP"
MAJOR = 1
# 1.1: AuthChallenge, AuthProof (sent only with a secret); 1.2: PushReg.match_key;
# 1.3: AgentInfo.device and AgentInfo.parts (WRITEs in parts, ``PUSH_PART`` notifications);
# 1.4: PeerHello.ucx_error_handling_mode; 1.5: RegionInfo.heads/replicated and ``source_rank`` on
# PushFailed, CancelPush, PushCancelled, WriteStarted (P TP = k x D TP); 1.6: AgentInfo.members
# (a D daemon's joint agent over several of its ranks, D TP = k x P TP); 1.7: AgentInfo.stage and
# AgentInfo.stages (a pipeline-parallel P: each stage's ranks hold some of the layers); 1.8:
# AgentInfo.ipc, IpcReady and IpcWithdrawn (P copies into a same-host D's CUDA KV itself); 1.9: RegSent
MINOR = 9
AUTH_MINOR = 1
MATCH_KEY_MINOR = 2  # a D daemon sets PushReg.match_key only for a P at this minor or later
PARTS_MINOR = 3  # a P daemon splits WRITEs only for a D at this minor or later that asks for it
HETERO_TP_MINOR = 5  # a D daemon registers with several P ranks only at this minor or later
JOINT_MINOR = 6  # a D daemon announces its joint agents only to a P at this minor or later
STAGES_MINOR = 7  # a P daemon announces the agents of a pipeline-parallel engine only to a D at this minor or later
IPC_MINOR = 8  # a D daemon offers its worker's CUDA KV (AgentInfo.ipc) only to a P at this minor or later
REG_SENT_MINOR = 9  # a D daemon sends RegSent only to a P at this minor or later

_opts = dict(forbid_unknown_fields=True, omit_defaults=True, tag_field="t")
# A P rank's source id (``AgentInfo.source``): at most 256 pipeline stages of TP 1024.
SourceRank = Annotated[int, msgspec.Meta(ge=-1, lt=256 * 1024)]


class RegionInfo(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """Where a remote region's blocks live in the remote process's address space."""

    base: U64
    block_len: Annotated[int, msgspec.Meta(ge=1, le=2**32 - 1)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    block_stride: U64 = 0
    group: Annotated[int, msgspec.Meta(ge=0, lt=64)] = 0
    layer_names: Annotated[list[Name], msgspec.Meta(max_length=4096)] = []
    heads: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0  # 1.5: KV heads outermost in a block
    replicated: bool = False  # 1.5: every TP rank holds these same bytes (MLA)

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_len

    def __post_init__(self) -> None:
        check_stride(self.block_stride, self.block_len, self.num_blocks)


class IpcBuffer(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One CUDA allocation of D's worker, as its CUDA IPC handle."""

    handle: Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
    size: Annotated[int, msgspec.Meta(ge=1, le=2**48)]


class IpcRegion(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """Where region ``i`` of ``AgentInfo.regions`` lies in D's worker's own KV: its block
    length, group and heads are the region's; its blocks are the worker's."""

    buffer: Annotated[int, msgspec.Meta(ge=0, lt=16384)]
    offset: U64
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    block_stride: U64 = 0


class IpcKV(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """1.8: a D agent's worker KV, for a P daemon on the same host to copy into itself
    (docs/gpu.md, "Same-host push"). ``host``: the kernel's boot id of D's host."""

    host: Name
    device: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]  # the GPU's UUID
    buffers: Annotated[list[IpcBuffer], msgspec.Meta(max_length=16384)]
    regions: Annotated[list[IpcRegion], msgspec.Meta(max_length=16384)]


class AgentInfo(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    rank: U32
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    agent_name: Name
    metadata: Annotated[bytes, msgspec.Meta(max_length=32 << 20)]
    regions: Annotated[list[RegionInfo], msgspec.Meta(max_length=16384)]
    blocks_per_logical: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    mem_type: Annotated[str, msgspec.Meta(pattern="^(DRAM|VRAM)$")] = "DRAM"
    # 1.3: the device the regions live on, in the remote's own numbering (NIXL's device id).
    device: Annotated[int, msgspec.Meta(ge=0, le=1023)] = 0
    # 1.3: WRITEs into this agent may come in parts, each with a ``PUSH_PART`` notification
    # (its regions are a landing buffer that its daemon copies out of as parts land).
    parts: bool = False
    # 1.6: a joint agent of ``members`` of the sender's TP ranks (D TP = members x P TP), named
    # as the one rank ``rank`` of TP ``tp_size`` that P rank ``rank`` writes into: its regions
    # are those of D ranks ``rank*members`` .. ``rank*members + members - 1``, in that order.
    members: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    # 1.7: the pipeline stage this agent's worker runs, of ``stages``: its regions hold only
    # that stage's layers (named by ``RegionInfo.layer_names``), and a D rank takes its KV
    # from every stage's agents of the P ranks it pairs with.
    stage: Annotated[int, msgspec.Meta(ge=0, lt=256)] = 0
    stages: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    # 1.8: D's worker KV, which a P daemon on the same host may copy into itself; a P that
    # can answers ``IpcReady``, and only then do D's registrations ask it to (PushReg.ipc).
    ipc: IpcKV | None = None

    @property
    def source(self) -> int:
        """The agent's *source id* among its engine's P ranks: ``stage * tp_size + rank``
        (its TP rank where the engine has one stage)."""
        return self.stage * self.tp_size + self.rank


def announceable(agents: list[AgentInfo], minor: int) -> list[AgentInfo]:
    """The agents a peer of side-channel 1.``minor`` may hear of (joint agents from 1.6, the
    agents of a pipeline-parallel engine from 1.7: an older D would take one stage's layers
    for all of them; a D agent's worker KV from 1.8, without it before)."""
    return [a if minor >= IPC_MINOR or a.ipc is None else msgspec.structs.replace(a, ipc=None)
            for a in agents if (minor >= JOINT_MINOR or a.members == 1) and (minor >= STAGES_MINOR or a.stages == 1)]


_Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_LEN, max_length=NONCE_LEN)]
_Mac = Annotated[bytes, msgspec.Meta(min_length=MAC_LEN, max_length=MAC_LEN)]


class AuthChallenge(msgspec.Struct, tag="auth_challenge", **_opts):
    """First frame of an authenticated handshake: a fresh nonce and who we are."""

    nonce: _Nonce
    daemon_id: Name


class AuthProof(msgspec.Struct, tag="auth_proof", **_opts):
    """HMAC-SHA256 over the transcript for the sender's role (``peer_auth.proof``)."""

    mac: _Mac


class PeerHello(msgspec.Struct, tag="hello", **_opts):
    daemon_id: Name  # changes on every daemon start: a restart is a new incarnation
    engine_id: Name
    side_channel_host: Name
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    agents: Annotated[list[AgentInfo], msgspec.Meta(max_length=1024)]
    heartbeat_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
    # 1.4: the sender's UCX error handling ("peer" before 1.4). UCX endpoints of the two
    # modes do not complete WRITEs between them, so daemons of different modes refuse
    # each other. At its default it is not encoded: a "peer" daemon's hello is 1.3's.
    ucx_error_handling_mode: Literal["peer", "none"] = "peer"


class AgentsUpdate(msgspec.Struct, tag="agents", **_opts):
    agents: Annotated[list[AgentInfo], msgspec.Meta(max_length=1024)]


class PushFailed(msgspec.Struct, tag="push_failed", **_opts):
    """P could not WRITE D's registration ``request_id`` (D's own id) on ``rank``."""

    request_id: Name
    rank: U32
    reason: Text
    # 1.5: the P rank meant, where it is not ``rank`` (P TP = k x D TP): its source id (1.7,
    # ``AgentInfo.source``); -1: ``rank``.
    source_rank: SourceRank = -1


class CancelPush(msgspec.Struct, tag="cancel", **_opts):
    """D withdrew registration ``request_id`` (the request was aborted). P drops it,
    or, if a WRITE into D's blocks is in flight, lets it settle first; then it answers
    ``PushCancelled``. Until then D keeps the blocks out of reuse."""

    request_id: Name
    rank: U32
    # 1.5: the P rank meant, where it is not ``rank`` (P TP = k x D TP): its source id (1.7,
    # ``AgentInfo.source``); -1: ``rank``.
    source_rank: SourceRank = -1


class PushCancelled(msgspec.Struct, tag="cancelled", **_opts):
    """P will write nothing more into the blocks of ``request_id``."""

    request_id: Name
    rank: U32
    # 1.5: the P rank meant, where it is not ``rank`` (P TP = k x D TP): its source id (1.7,
    # ``AgentInfo.source``); -1: ``rank``.
    source_rank: SourceRank = -1


class WriteStarted(msgspec.Struct, tag="writing", **_opts):
    """P posted the WRITE for D's ``request_id``: D polls its agent continuously until
    the completion arrives, because the WRITE completes only as both agents progress."""

    request_id: Name
    rank: U32
    nbytes: U64 = 0
    # Verify mode: xxh3-64 of each source block, little-endian, in WRITE order.
    digests: Annotated[bytes, msgspec.Meta(max_length=8 << 24)] = b""
    # 1.5: the P rank meant, where it is not ``rank`` (P TP = k x D TP): its source id (1.7,
    # ``AgentInfo.source``); -1: ``rank``.
    source_rank: SourceRank = -1


def source_rank(msg: PushFailed | CancelPush | PushCancelled | WriteStarted) -> int:
    """The P rank a message is about, by source id: ``source_rank`` where set, else ``rank``."""
    return msg.source_rank if msg.source_rank >= 0 else msg.rank


class RegSent(msgspec.Struct, tag="reg_sent", **_opts):
    """1.9, D -> P: the PUSH_REGs of D's registration ``request_id`` (D's rank ``rank``)
    just went out. P reads its notifications at once, and polls hot while blocks of its own
    that registration would pair with wait for it (for at most ``REG_SENT_HOT_S``)."""

    request_id: Name
    rank: U32
    match_key: MatchKey = ""


class IpcReady(msgspec.Struct, tag="ipc_ready", **_opts):
    """1.8, P -> D: P mapped the worker KV of D's agent ``agent_name`` (``AgentInfo.ipc``)
    and copies into it itself for a registration that asks so (``PushReg.ipc``)."""

    agent_name: Name


class IpcWithdrawn(msgspec.Struct, tag="ipc_withdrawn", **_opts):
    """1.8, D -> P: D's agent ``agent_name`` retired (its worker left or was replaced). P
    unmaps its worker KV once no copy into it is in flight: a mapping kept would hold the
    worker's GPU memory after the worker exited."""

    agent_name: Name


class Heartbeat(msgspec.Struct, tag="hb", **_opts):
    seq: U64 = 0


class Goodbye(msgspec.Struct, tag="bye", **_opts):
    reason: Text = ""


PeerMessage = Union[
    PeerHello, AgentsUpdate, PushFailed, CancelPush, PushCancelled, WriteStarted, RegSent, IpcReady, IpcWithdrawn,
    Heartbeat,
    Goodbye,
    AuthChallenge, AuthProof,
]

_encoder = msgspec.msgpack.Encoder()
peer_decoder = msgspec.msgpack.Decoder(PeerMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
