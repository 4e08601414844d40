"""What the daemon holds for each worker rank: the NIXL agent, the registered KV
memory and its layout, the loaded remote agents, the worker's connection.

These are resources; what a rank is *doing* (P's matches and WRITEs, D's
registrations) lives in the sending and receiving sides (``sender.py``,
``receiver.py``), which keep one state per ``Rank``.

A rank whose worker is replaced *retires*: the new worker gets a fresh ``Rank`` (new
memory, new agent name) while the old one stays until both sides say nothing of it is
in flight any more; then its agent and mapping are released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from pushsvc.devmem.base import Copier, Device, DeviceEvent
from pushsvc.engine.base import Agent, DListHandle
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.remotes import RemoteAgents
from pushsvc.state.landing import LandingGeometry
from pushsvc.errors import LayoutError
from pushsvc.state.layout import MAX_DESCRIPTORS, Layout, RegionSpec, descriptor_table, joint_source


class WorkerLink(Protocol):
    """The connection of the worker that owns a rank (``workers.WorkerConn``)."""

    pid: int
    minor: int

    def send(self, msg: wp.DaemonMessage) -> None: ...


class MappedBuffer(Protocol):
    """Memory this daemon mapped or allocated: a memfd mapping, a CUDA import or allocation."""

    address: int
    size: int

    def close(self) -> None: ...


@dataclass(eq=False)
class LandingMemory:
    """D's landing buffer for a rank with CUDA KV (docs/gpu.md): allocated and registered
    by this daemon, advertised to P instead of the worker's layout."""

    buffer: MappedBuffer
    geometry: LandingGeometry
    layout: Layout  # the buffer as P addresses it
    copier: Copier  # its copies into the worker's KV


@dataclass(eq=False)
class StagingMemory:
    """P's staging buffer for a rank with CUDA KV (``staging_mib``, docs/gpu.md): allocated
    and registered by this daemon; a request's blocks are copied into its slots and its
    WRITE goes from there. The worker's own memory is then never registered with NIXL."""

    buffer: MappedBuffer
    geometry: LandingGeometry
    layout: Layout  # the buffer as WRITEs read it: the worker's regions, ``slots`` blocks each
    copier: Copier  # worker blocks -> slots
    descs: np.ndarray  # Nx3 of every slot of every region, behind ``dlist``
    dlist: DListHandle


@dataclass(eq=False)
class RankMemory:
    """The worker's KV memory as this daemon mapped and registered it."""

    buffers: list[MappedBuffer]
    regions: list[wp.Region]
    layout: Layout
    descs: np.ndarray  # Nx3 (address, length, device) of every block, behind ``dlist``
    dlist: DListHandle | None  # None where this rank never WRITEs (a consumer of CUDA KV)
    mem_type: str = "DRAM"
    device: Device | None = None
    landing: LandingMemory | None = None
    staging: StagingMemory | None = None
    # P: the worker's blocks as WRITEs into a D joint agent of k members read them (k ->
    # layout, descriptors, prepared list), built on the first such WRITE (``joint_source``).
    joint_sources: dict[int, tuple[Layout, np.ndarray, DListHandle]] = field(default_factory=dict)
    # P, layer-wise push from CUDA KV: the worker's events, one per layer and one for the
    # forward pass's end (``state/layerwise.py``'s numbering), opened here.
    layer_events: list[DeviceEvent] = field(default_factory=list)
    # D with CUDA KV: the worker's KV as same-host P daemons may map it (``AgentInfo.ipc``).
    ipc: pp.IpcKV | None = None

    def joint_view(self, members: int) -> Layout:
        """The worker's blocks as a WRITE into a joint agent of ``members`` D ranks reads
        them (``layout.joint_source``): LayoutError where the blocks do not split, or
        where it would take more descriptors than one agent may describe (a peer names
        ``members``)."""
        kept = self.joint_sources.get(members)
        if kept is not None:
            return kept[0]
        if self.dlist is None:
            raise LayoutError("this rank's KV memory was registered to receive only")
        layout = joint_source(self.layout, members)
        if layout.total_descriptors > MAX_DESCRIPTORS:
            raise LayoutError(f"a joint agent of {members} D ranks takes {layout.total_descriptors} descriptors "
                              f"of this rank's blocks, over the limit of {MAX_DESCRIPTORS}")
        return layout

    def joint_source(self, agent: Agent, members: int) -> tuple[Layout, np.ndarray, DListHandle]:
        """``joint_view`` with its descriptors, prepared on ``agent`` once."""
        kept = self.joint_sources.get(members)
        if kept is None:
            layout = self.joint_view(members)
            descs = descriptor_table(layout, self.device.ordinal if self.device is not None else 0)
            kept = self.joint_sources[members] = (layout, descs, agent.prep_local(descs, self.mem_type))
        return kept

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.buffers)

    @property
    def vram(self) -> Device | None:
        """The device holding the worker's KV (None for host memory)."""
        return self.device if self.mem_type == "VRAM" else None

    @property
    def advertised(self) -> Layout:
        """The layout peers WRITE into: the landing buffer's, where there is one."""
        return self.landing.layout if self.landing is not None else self.layout

    def close(self) -> None:
        for e in self.layer_events:
            e.close()
        self.layer_events.clear()
        for b in self.buffers:
            b.close()
        self.buffers.clear()
        for own in (self.landing, self.staging):
            if own is not None:
                own.copier.close()
                own.buffer.close()


@dataclass(eq=False)
class Rank:
    number: int
    tp_size: int
    role: wp.Role
    pid: int
    agent: Agent
    remotes: RemoteAgents
    memory: RankMemory | None = None
    conn: WorkerLink | None = None
    stage: int = 0  # a pipeline-parallel producer's: the worker's stage, of ``stages``
    stages: int = 1

    @property
    def ready(self) -> bool:
        return self.memory is not None

    @property
    def source(self) -> int:
        """What peers name this rank by: its *source id* ``stage * tp_size + number``
        (``AgentInfo.source``; its TP rank where the engine has one stage)."""
        return self.stage * self.tp_size + self.number

    def source_rank(self, decode_rank: int) -> int:
        """``source_rank`` for a message to D about a registration of D's rank
        ``decode_rank``: this P rank's source id, where it is not D's rank (else -1)."""
        return self.source if self.source != decode_rank else -1

    def agent_info(self) -> pp.AgentInfo:
        memory = self.memory
        assert memory is not None
        layout = memory.advertised
        return pp.AgentInfo(
            rank=self.number,
            tp_size=self.tp_size,
            agent_name=self.agent.name,
            metadata=self.agent.metadata(),
            regions=[
                pp.RegionInfo(base=s.base, block_len=s.block_len, num_blocks=s.num_blocks,
                              block_stride=0 if s.stride == s.block_len else s.stride, group=s.group,
                              layer_names=r.layer_names, heads=s.heads, replicated=s.replicated)
                for s, r in zip(layout.regions, memory.regions)
            ],
            blocks_per_logical=layout.blocks_per_logical,
            mem_type=memory.mem_type,
            device=memory.device.ordinal if memory.device is not None else 0,
            parts=memory.landing is not None,
            stage=self.stage,
            stages=self.stages,
            ipc=memory.ipc,
        )

    def close(self) -> None:
        """Release the agent (every handle it still holds), the D KV it mapped to copy into
        (same-host push), and then the memory."""
        if self.remotes.ipc is not None:
            self.remotes.ipc.close()
        self.agent.close()
        if self.memory is not None:
            self.memory.close()

    def __repr__(self) -> str:
        stage = f" stage {self.stage}/{self.stages}" if self.stages > 1 else ""
        return (f"<Rank r{self.number}/{self.tp_size}{stage} {self.role} agent={self.agent.name} pid={self.pid} "
                f"ready={self.ready} connected={self.conn is not None}>")


@dataclass
class RankRegistry:
    # By source id (``Rank.source``): the TP rank where the engine has one pipeline stage.
    current: dict[int, Rank] = field(default_factory=dict)
    retiring: list[Rank] = field(default_factory=list)  # replaced, still settling

    def all(self) -> list[Rank]:
        return [*self.current.values(), *self.retiring]

    def numbered(self, source: int) -> list[Rank]:
        """Every rank of this source id: the current one first, then retiring ones."""
        current = self.current.get(source)
        return ([current] if current is not None else []) + [r for r in self.retiring if r.source == source]

    def successor(self, rank: Rank) -> Rank | None:
        """The connected rank that took over from ``rank``'s worker process, if that
        same process reconnected: events of the old connection's requests go to it."""
        current = self.current.get(rank.source)
        if current is None or current is rank or current.conn is None or not rank.pid or current.pid != rank.pid:
            return None
        return current


def layout_from_regions(regions: list[wp.Region], bases: list[int], blocks_per_logical: int) -> Layout:
    return Layout(
        tuple(RegionSpec(bases[r.buffer] + r.offset, r.block_len, r.num_blocks, r.stride, r.group, r.heads,
                         r.replicated)
              for r in regions),
        blocks_per_logical,
    )
