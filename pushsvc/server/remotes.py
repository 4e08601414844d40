"""The remote agents one local agent has loaded: NIXL metadata, prepared descriptor
lists, and whether each remote's layout fits ours.

Loading a remote costs a NIXL ``add_remote_agent`` and, where the local agent WRITEs to
it (P's), the preparation of one descriptor per remote block, on the event loop. D's
agents only notify P's, so they load the metadata and prepare nothing: P's regions may
not even be registered with NIXL (P's staging), and preparing millions of descriptors
nobody uses would stall D's loop for nothing. A remote describing more blocks than
``max_descriptors`` is refused before anything is built (a 711-byte hello once asked
for 768 GiB of descriptors). A remote that failed to load, or whose layout does not fit,
keeps its error, which every WRITE to it then reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from pushsvc.engine.base import Agent, DListHandle
from pushsvc.errors import LayoutError, TransferError
from pushsvc.protocol.notif import PushReg
from pushsvc.protocol.peer import AgentInfo
from pushsvc.protocol.worker import check_stride
from pushsvc.state import tp
from pushsvc.state.stages import LayerKey, keys, stage_view
from pushsvc.state.layout import (
    Layout,
    RegionSpec,
    check_block_ids,
    check_compatible,
    descriptor_table,
    source_view,
)

if TYPE_CHECKING:
    from pushsvc.server.ipcpush import IpcTargets

log = structlog.get_logger("pushsvc.remotes")


def layout_of_agent(info: AgentInfo) -> Layout:
    """A remote agent's layout, as its daemon described it in the hello."""
    return Layout(
        tuple(RegionSpec(r.base, r.block_len, r.num_blocks, r.stride, r.group, r.heads, r.replicated)
              for r in info.regions),
        info.blocks_per_logical,
    )


def worker_view(info: AgentInfo, bases: list[int]) -> Layout:
    """D's worker KV as ``info.ipc`` describes it, at the addresses of its buffers mapped
    here (``bases``): region ``i`` keeps ``info.regions[i]``'s block length, group and
    heads. LayoutError where a region lies outside its buffer."""
    ipc = info.ipc
    assert ipc is not None
    if len(ipc.regions) != len(info.regions):
        raise LayoutError(f"{len(ipc.regions)} regions of worker KV for {len(info.regions)} advertised regions")
    regions = []
    for r, w in zip(info.regions, ipc.regions):
        if w.buffer >= len(ipc.buffers):
            raise LayoutError(f"a region names buffer {w.buffer}, only {len(ipc.buffers)} sent")
        try:
            check_stride(w.block_stride, r.block_len, w.num_blocks)  # the worker protocol's own rule
        except ValueError as exc:
            raise LayoutError(f"a region's {exc}") from None
        stride = w.block_stride or r.block_len
        end = w.offset + (w.num_blocks - 1) * stride + r.block_len
        if end > ipc.buffers[w.buffer].size:
            raise LayoutError(f"a region ends at {end}, past buffer {w.buffer} of {ipc.buffers[w.buffer].size} bytes")
        regions.append(RegionSpec(bases[w.buffer] + w.offset, r.block_len, w.num_blocks, stride, r.group, r.heads,
                                  r.replicated))
    return Layout(tuple(regions), info.blocks_per_logical)


def view_of(info: AgentInfo, rank: int, tp_size: int, layers: tuple[LayerKey, ...] | None = None) -> Layout:
    """What local (P) rank ``rank`` of ``tp_size`` WRITEs into of the remote agent
    ``info``: its whole layout at equal TP; with P TP = k x D TP, the head slice of its
    blocks that this rank's heads fill (``state/tp.py``). A rank of a pipeline stage
    (``layers``: its regions' layers) writes only the remote regions of its layers, in its
    own order (``state/stages.py``; a joint agent's regions are its members' in turn)."""
    why = tp.refusal(tp_size, info.tp_size)
    if why:
        raise LayoutError(why)
    d_rank, index = tp.served(rank, tp_size, info.tp_size)
    if info.rank != d_rank:
        raise LayoutError(f"remote rank {info.rank} is not the D rank {d_rank} that rank {rank} writes into")
    layout = layout_of_agent(info)
    if layers is not None:
        layout = stage_view(layout, keys(r.layer_names for r in info.regions), layers * info.members,
                            f"D agent {info.agent_name}")
    return source_view(layout, tp.ratio(tp_size, info.tp_size), index)


def registration_error(engine_id: str, info: AgentInfo, reg: PushReg, rank: int, tp_size: int,
                       described: Layout | None = None) -> tuple[str, str] | None:
    """Why the known agent ``info`` of engine ``engine_id`` may not send ``reg`` to local
    rank ``rank`` of ``tp_size``, as (reason, message), or None. An agent registers only
    for its own engine, rank and TP size (so it cannot squat on a request id the real D
    will use), with the P rank that writes into it, naming P's TP as it is, and only
    blocks inside the layout it advertised (blocks outside it could never be written;
    ``described``: that layout, if the caller kept it)."""
    if engine_id != reg.decode_engine_id or info.rank != reg.decode_rank or info.tp_size != reg.decode_tp_size:
        return ("push_reg_sender_mismatch",
                f"agent of {engine_id} rank {info.rank} sent a PUSH_REG for {reg.decode_engine_id} rank {reg.decode_rank}")
    if reg.remote_tp_size != tp_size:
        return "push_reg_tp", f"PUSH_REG says P TP {reg.remote_tp_size}, P runs TP {tp_size}"
    if not tp.pairs(rank, tp_size, info.rank, info.tp_size) or tp.refusal(tp_size, info.tp_size):
        return ("push_reg_tp", tp.refusal(tp_size, info.tp_size)
                or f"D rank {info.rank} of TP {info.tp_size} does not take KV from P rank {rank} of TP {tp_size}")
    try:
        if reg.ipc:  # the blocks are the worker's (same-host push), not those the agent advertised
            if info.ipc is None:
                return "push_reg_ipc", "PUSH_REG asks for a copy into KV its agent did not offer"
            described = worker_view(info, [0] * len(info.ipc.buffers))
        check_block_ids(described if described is not None else layout_of_agent(info), reg.local_block_ids,
                        "PUSH_REG")
    except LayoutError as exc:
        return "push_reg_blocks", str(exc)
    return None


class RemoteAgents:
    def __init__(self, agent: Agent, max_descriptors: int, *, prepare: bool, rank: int = 0, tp_size: int = 1,
                 stages: int = 1) -> None:
        self._agent = agent
        self._max = max_descriptors
        self._prepare = prepare  # prepare each remote's descriptors (the WRITing side)
        self._rank, self._tp_size = rank, tp_size  # the local agent's rank: which slice it writes
        self._stages = stages
        # A rank of one of several pipeline stages: its regions' layers, once its KV is
        # registered (it writes only the remote regions of those layers).
        self.layers: tuple[LayerKey, ...] | None = None
        self._loaded: set[str] = set()
        self._dlists: dict[str, DListHandle] = {}  # remote agent -> prepared list
        self._verdicts: dict[str, str] = {}  # remote agent -> "" (fits) or why not
        self._layouts: dict[str, Layout] = {}  # remote agent -> its layout, once it fits
        # P with CUDA KV: same-host D agents whose worker KV it maps (set once the rank's KV
        # is registered; ``server/ipcpush.py``). Loaded and unloaded with the agents.
        self.ipc: IpcTargets | None = None

    def load(self, info: AgentInfo, map_kv: bool = True) -> bool:
        """Load ``info`` unless it is loaded already; a failure is kept as its verdict.
        True if its worker KV was mapped now (a same-host D, ``map_kv``: P tells D it may ask)."""
        name = info.agent_name
        if name in self._loaded:
            return map_kv and self._map(info)
        loaded = ""
        try:
            blocks = sum(r.num_blocks for r in info.regions)
            if blocks > self._max:
                raise LayoutError(f"describes {blocks} blocks, over the limit of {self._max}")
            loaded = self._agent.add_remote(info.metadata)
            if loaded != name:
                raise TransferError(f"metadata names agent {loaded}, hello said {name}")
            if self._prepare:
                view = view_of(info, self._rank, self._tp_size, self._layers())
                self._dlists[name] = self._agent.prep_remote(name, descriptor_table(view, info.device), info.mem_type)
            self._loaded.add(name)
            self._verdicts.pop(name, None)
            self._layouts.pop(name, None)
            return map_kv and self._map(info)
        except (TransferError, LayoutError, MemoryError) as exc:
            if loaded and loaded not in self._loaded:
                try:  # loaded, but unusable: do not keep NIXL's copy either
                    self._agent.remove_remote(loaded)
                except TransferError:
                    pass
            self._verdicts[name] = f"cannot load remote agent: {exc}"
            log.warning("remote_agent_load_failed", local=self._agent.name, agent=name, error=str(exc))
            return False

    def _map(self, info: AgentInfo) -> bool:
        return self.ipc is not None and info.ipc is not None and self.ipc.load(info)

    def layout(self, info: AgentInfo, local: Layout) -> Layout:
        """The remote's layout, checked against ``local`` once per remote agent (and
        kept: a WRITE plans against the same object every time)."""
        name = info.agent_name
        verdict = self._verdicts.get(name)
        if verdict == "" and name in self._layouts:
            return self._layouts[name]
        remote = layout_of_agent(info)
        if verdict is None:
            try:
                remote = view_of(info, self._rank, self._tp_size, self._layers())
                check_compatible(local, remote)
                if name not in self._dlists:
                    raise LayoutError(f"agent {name} was not loaded" if name not in self._loaded
                                      else f"agent {name} was loaded to be notified only")
                verdict = ""
            except LayoutError as exc:
                verdict = str(exc)
            self._verdicts[name] = verdict
        if verdict:
            raise LayoutError(verdict)
        self._layouts[name] = remote
        return remote

    def _layers(self) -> tuple[LayerKey, ...] | None:
        if self._stages == 1:
            return None
        if self.layers is None:
            raise LayoutError("this rank's KV memory is not registered yet: its layers are unknown")
        return self.layers

    def dlist(self, name: str) -> DListHandle:
        return self._dlists[name]

    def names(self) -> list[str]:
        return list(self._loaded)

    def unload(self, name: str) -> None:
        if self.ipc is not None:
            self.ipc.unload(name)
        handle = self._dlists.pop(name, None)
        self._verdicts.pop(name, None)
        self._layouts.pop(name, None)
        if name not in self._loaded:
            return
        self._loaded.discard(name)
        try:
            if handle is not None:
                self._agent.release_dlist(handle)
            self._agent.remove_remote(name)
        except TransferError as exc:
            log.warning("remote_agent_unload_failed", local=self._agent.name, agent=name, error=str(exc))

    def __len__(self) -> int:
        return len(self._loaded)

    def __repr__(self) -> str:
        return f"<RemoteAgents of {self._agent.name} loaded={len(self._dlists)}>"
