"""Worker <-> daemon messages, carried over the daemon's Unix socket.

Every message is a ``msgspec.Struct`` in one tagged union per direction, decoded by a
decoder built once. New fields go at the end with defaults (minor version bump);
removing or retyping a field is a major bump. See docs/protocol.md.
"""

from __future__ import annotations

import array
import sys
from typing import Annotated, Literal, Sequence, Union

import msgspec
import numpy as np

from pushsvc.errors import ProtocolError

# Bounds checked while decoding, before any handler sees the value.
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
U64 = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_FDS = 250
Text = Annotated[str, msgspec.Meta(max_length=4096)]
MAX_GROUP_IDS = 1 << 20
GroupIds = Annotated[list[U32], msgspec.Meta(max_length=MAX_GROUP_IDS)]
BlockIds = Annotated[list[GroupIds], msgspec.Meta(max_length=64)]
# 1.7: a group of P's finished blocks may come packed, its ids as little-endian u32s
# (``pack_ids``): the daemon reads them as one array instead of a list of ints.
PackedIds = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_GROUP_IDS)]
FinishedIds = Annotated[list[Union[GroupIds, PackedIds]], msgspec.Meta(max_length=64)]
# A transfer's match key: minted once per P/D exchange (by the proxy, or by P's connector
# when no proxy did) and carried by both legs, so P pairs D's registration with exactly
# the blocks of the same exchange whatever the request ids are. "" = none (match by id).
MATCH_KEY_MAX = 64
MatchKey = Annotated[str, msgspec.Meta(max_length=MATCH_KEY_MAX, pattern=r"^[A-Za-z0-9._:-]*$")]

MAGIC = b"PSVW"
MAJOR = 1
MINOR = 7  # 1.1: RegisterRecv.match_key, SendReady.match_key; 1.2: CudaIpcBuffers; 1.3: Region.heads/replicated;
# 1.4: Reported; 1.5: Hello.pp_rank/pp_size; 1.6: SendStart, LayerSaved, StepSaved, RegisterKV.layer_events
# (layer-wise push); 1.7: packed ids in SendReady/SendStart
# The first minor whose daemon accepts ``match_key``; a client sets it only for such a daemon.
MATCH_KEY_MINOR = 1
# The first minor whose daemon takes CUDA KV memory (``CudaIpcBuffers``).
CUDA_IPC_MINOR = 2
HEADS_MINOR = 3  # a client sends Region.heads and .replicated only to a daemon at this minor or later
REPORTED_MINOR = 4  # ... and ``Reported`` from this one on
STAGES_MINOR = 5  # ... and ``Hello.pp_rank``/``pp_size`` (a worker of a pipeline-parallel engine needs it)
LAYERWISE_MINOR = 6  # ... and ``SendStart``, ``LayerSaved``, ``StepSaved`` (layer-wise push)
PACKED_IDS_MINOR = 7  # ... and packed groups of finished blocks (``pack_ids``)
# A group of fewer ids goes as a list. Up to ~64 ids packing gains nothing (a numpy array's
# fixed cost makes the daemon's check slower at 16 ids) and doubles the worker's encode; at
# 128 the daemon gains ~6 us for ~0.7 us in the worker, at 256 ~8 us for ~1 us (2-core host,
# benchmarks/block_ids.py). 256 leaves every request below 4096 tokens (16-token blocks) as it was.
PACK_MIN_IDS = 256
CUDA_IPC_HANDLE_BYTES = 64

Role = Literal["producer", "consumer", "both"]

_opts = dict(forbid_unknown_fields=True, omit_defaults=True, tag_field="t")


# ---------------------------------------------------------------- memory descriptions


class Region(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """One KV region: ``num_blocks`` blocks of ``block_len`` bytes, ``block_stride`` apart.

    A region lives in buffer ``buffer`` of the registration, starting ``offset`` bytes
    in. Layers whose K and V halves are separate tensors are two regions. ``group`` is
    the KV-cache group whose block ids address this region.
    """

    buffer: U32
    offset: U64
    block_len: Annotated[int, msgspec.Meta(ge=1, le=2**32 - 1)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    block_stride: U64 = 0  # 0 means block_len (dense)
    group: Annotated[int, msgspec.Meta(ge=0, lt=64)] = 0
    layer_names: Annotated[list[Name], msgspec.Meta(max_length=4096)] = []
    # 1.3: each block holds this many KV heads outermost (head-major: head h is the
    # h-th of ``heads`` equal byte ranges of the block); 0 = not head-major, or unknown.
    heads: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    # 1.3: every TP rank holds these same bytes (MLA's latent rows): one P rank writes them.
    replicated: bool = False

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_len

    def __post_init__(self) -> None:
        check_stride(self.block_stride, self.block_len, self.num_blocks)


def check_stride(block_stride: int, block_len: int, num_blocks: int) -> None:
    """Blocks closer together than their length overlap: a copy or WRITE into one block
    would touch its neighbour, which another request may hold. Refused at decoding."""
    if block_stride and block_stride < block_len and num_blocks > 1:
        raise ValueError(f"block_stride {block_stride} is below block_len {block_len}: the blocks would overlap")


class MemfdBuffers(msgspec.Struct, tag="memfd", **_opts):
    """CPU memory shared as memfds; the fds ride on this frame via SCM_RIGHTS.

    Buffer ``i`` of the regions is the i-th fd, mapped whole by the daemon. One frame
    carries at most 250 fds (the kernel's SCM_MAX_FD is 253).
    """

    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_FDS)]


class CudaIpcBuffer(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """One CUDA allocation of the worker, exported with ``cuIpcGetMemHandle``."""

    handle: Annotated[bytes, msgspec.Meta(min_length=CUDA_IPC_HANDLE_BYTES, max_length=CUDA_IPC_HANDLE_BYTES)]
    size: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]  # the allocation's size, as the worker sees it


class CudaIpcBuffers(msgspec.Struct, tag="cuda_ipc", **_opts):
    """GPU memory of the worker, shared by CUDA IPC handle (1.2).

    Buffer ``i`` of the regions is the allocation of ``buffers[i]``, on the device whose
    UUID is ``device_uuid``; region offsets count from the allocation's start. The daemon
    opens the handles itself and checks every region against its own mapping's size.
    """

    device_uuid: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    buffers: Annotated[list[CudaIpcBuffer], msgspec.Meta(min_length=1, max_length=4096)]


Memory = Union[MemfdBuffers, CudaIpcBuffers]


# ---------------------------------------------------------------- worker -> daemon


class Hello(msgspec.Struct, tag="hello", **_opts):
    engine_id: Name  # "" = the daemon's engine, whatever it is
    rank: U32
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    role: Role
    pid: U32 = 0
    # 1.5: the worker's pipeline stage, of ``pp_size`` (a producer's; a consumer runs one stage).
    pp_rank: Annotated[int, msgspec.Meta(ge=0, lt=256)] = 0
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1


IpcHandle = Annotated[bytes, msgspec.Meta(min_length=CUDA_IPC_HANDLE_BYTES, max_length=CUDA_IPC_HANDLE_BYTES)]


class RegisterKV(msgspec.Struct, tag="register_kv", **_opts):
    memory: Memory
    regions: Annotated[list[Region], msgspec.Meta(min_length=1, max_length=16384)]
    blocks_per_logical: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1  # physical kernel blocks per scheduler block
    # 1.6, a CUDA worker pushing layer by layer: the IPC handles of its interprocess
    # events, one per layer (``LayerSaved``'s numbering) and one for the forward pass's end,
    # each recorded on its compute stream before the message that names it.
    layer_events: Annotated[list[IpcHandle], msgspec.Meta(max_length=16385)] = []


class RegisterRecv(msgspec.Struct, tag="register_recv", **_opts):
    """D side: a request whose KV P must push into ``local_block_ids`` (logical ids)."""

    request_id: RequestId
    local_block_ids: BlockIds
    remote_engine_id: Name
    remote_host: Name
    remote_port: Port
    remote_tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    match_key: MatchKey = ""  # 1.1


class SendReady(msgspec.Struct, tag="send_ready", **_opts):
    """P side: prefill of ``request_id`` is done; its KV lives in ``block_ids``."""

    request_id: RequestId
    block_ids: FinishedIds  # a group packed (bytes) from 1.7 on
    match_key: MatchKey = ""  # 1.1


class SendStart(msgspec.Struct, tag="send_start", **_opts):
    """1.6, P side, layer-wise push: the prefill of ``request_id`` ends in the forward pass
    of step ``step``, which is starting; its KV lives in ``block_ids`` and becomes final
    layer by layer (``LayerSaved``), all of it at the step's ``StepSaved``. Stands in for
    ``SendReady``: the worker sends no ``SendReady`` for it."""

    request_id: RequestId
    block_ids: FinishedIds  # a group packed (bytes) from 1.7 on
    step: U64
    match_key: MatchKey = ""


class LayerSaved(msgspec.Struct, tag="layer_saved", **_opts):
    """1.6: layer ``layer`` (the index among the distinct layer names of the worker's
    registered regions, in their order) is final for the requests of step ``step``."""

    step: U64
    layer: Annotated[int, msgspec.Meta(ge=0, lt=16384)]


class StepSaved(msgspec.Struct, tag="step_saved", **_opts):
    """1.6: step ``step``'s forward pass ended: every layer of its requests is final."""

    step: U64


class Evict(msgspec.Struct, tag="evict", **_opts):
    """Drop all daemon state of these requests (aborted, lease reaped by the scheduler)."""

    request_ids: Annotated[list[RequestId], msgspec.Meta(max_length=65536)]


class Ping(msgspec.Struct, tag="ping", **_opts):
    token: U64 = 0


class Describe(msgspec.Struct, tag="describe", **_opts):
    """Instead of ``Hello``: ask who the daemon is (engine id, side channel) without
    becoming a worker. The daemon answers ``Welcome`` and closes the connection."""


class Reported(msgspec.Struct, tag="reported", **_opts):
    """1.4: the worker handed these finished transfers to vLLM (``get_finished``:
    ``finished_sending`` / ``finished_recving``) at ``at``, seconds on the host's monotonic
    clock. Only for the request timelines: the daemon's state does not depend on it."""

    sending: Annotated[list[RequestId], msgspec.Meta(max_length=65536)] = []
    recving: Annotated[list[RequestId], msgspec.Meta(max_length=65536)] = []
    at: Annotated[float, msgspec.Meta(ge=0.0, le=1e12)] = 0.0


WorkerMessage = Union[Hello, RegisterKV, RegisterRecv, SendReady, Evict, Ping, Describe, Reported, SendStart,
                      LayerSaved, StepSaved]


# ---------------------------------------------------------------- daemon -> worker


class Welcome(msgspec.Struct, tag="welcome", **_opts):
    daemon_id: str
    engine_id: str
    side_channel_host: str
    side_channel_port: int
    max_frame: int


class KVRegistered(msgspec.Struct, tag="kv_registered", **_opts):
    agent_name: str
    regions: int
    bytes: int
    mem_type: str = ""  # 1.2: "DRAM" or "VRAM"
    landing_slots: int = 0  # 1.2: logical blocks D's landing buffer holds (0: none)


class RecvDone(msgspec.Struct, tag="recv_done", **_opts):
    request_id: str


class RecvFailed(msgspec.Struct, tag="recv_failed", **_opts):
    request_id: str
    block_ids: list[int]
    reason: str


class SendDone(msgspec.Struct, tag="send_done", **_opts):
    request_id: str


class SendFailed(msgspec.Struct, tag="send_failed", **_opts):
    """P side: the daemon gave up on pushing ``request_id``; the worker frees the lease."""

    request_id: str
    reason: str


class Pong(msgspec.Struct, tag="pong", **_opts):
    token: int = 0


class Error(msgspec.Struct, tag="error", **_opts):
    code: str
    message: str
    request_id: str = ""


DaemonMessage = Union[
    Welcome, KVRegistered, RecvDone, RecvFailed, SendDone, SendFailed, Pong, Error
]

_encoder = msgspec.msgpack.Encoder()
worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
daemon_decoder = msgspec.msgpack.Decoder(DaemonMessage)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def pack_ids(groups: Sequence[Sequence[int]]) -> list[Sequence[int] | bytes]:
    """``FinishedIds`` as a 1.7 daemon takes them: each group of ``PACK_MIN_IDS`` ids or
    more packed as little-endian u32s. A group that does not fit u32 stays a list, which
    the daemon's decoder refuses, naming it."""
    out: list[Sequence[int] | bytes] = []
    for ids in groups:
        if len(ids) >= PACK_MIN_IDS and not isinstance(ids, bytes):
            try:
                out.append(_packed(ids))
                continue
            except (OverflowError, TypeError, ValueError):
                pass
        out.append(ids)
    return out


def _packed(ids: Sequence[int]) -> bytes:
    # The stdlib's array reads a list of ints 3x faster than numpy (23 against 80 us for
    # 4096 ids on a 2-core host). Its "I" is the C unsigned int: 4 bytes, little-endian,
    # on every platform vLLM runs on; numpy where it is not.
    if _NATIVE_U32:
        return array.array("I", ids).tobytes()
    return np.asarray(ids, dtype="<u4").tobytes()


_NATIVE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def unpack_ids(groups: Sequence[Sequence[int] | bytes]) -> list[Sequence[int]]:
    """``FinishedIds`` as the daemon works with them: a packed group as an int64 array
    (its ids are then checked like any others, ``state/layout.check_block_ids``)."""
    out: list[Sequence[int]] = []
    for g, ids in enumerate(groups):
        if isinstance(ids, bytes):
            if len(ids) % 4:
                raise ProtocolError(f"group {g}: {len(ids)} bytes of packed block ids, not whole u32s")
            ids = np.frombuffer(ids, dtype="<u4").astype(np.int64)
        out.append(ids)
    return out
