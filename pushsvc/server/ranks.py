"""Per-worker-rank state owned by the daemon: the NIXL agent, the registered KV memory
and layout, the two matching tables, and the WRITEs in flight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pushsvc.protocol.peer import AgentInfo
from pushsvc.protocol.worker import Region
from pushsvc.shm import SharedBuffer
from pushsvc.state.consumer import ConsumerTable
from pushsvc.state.layout import Layout, RegionSpec
from pushsvc.state.producer import Match, ProducerTable


@dataclass(slots=True)
class Inflight:
    """A posted WRITE. Its blocks stay leased until the handle settles."""

    match: Match
    handle: Any
    remote_agent: str
    nbytes: int
    posted_at: float
    cancelled: bool = False
    write_start: float = 0.0  # perf_counter() just before the WRITE was posted  # D withdrew the registration: acknowledge once settled


@dataclass
class LocalRank:
    engine_id: str
    rank: int
    tp_size: int
    role: str
    agent: Any
    producer: ProducerTable
    consumer: ConsumerTable
    conn: Any = None  # the worker connection that owns this rank, if connected
    layout: Layout | None = None
    regions: list[Region] = field(default_factory=list)
    buffers: list[SharedBuffer] = field(default_factory=list)
    local_dlist: Any = None
    local_descs: Any = None  # Nx3 numpy table behind local_dlist (address, length, device)
    remote_dlists: dict[str, Any] = field(default_factory=dict)  # remote agent -> prepped list
    remote_checked: dict[str, str] = field(default_factory=dict)  # remote agent -> "" ok / error
    inflight: dict[str, Inflight] = field(default_factory=dict)  # by P request id
    staged_at: dict[str, float] = field(default_factory=dict)
    registered_at: dict[str, float] = field(default_factory=dict)  # D request id -> time
    incoming: dict[str, float] = field(default_factory=dict)  # D request id -> WRITE announced at
    digests: dict[str, bytes] = field(default_factory=dict)  # verify: P's digests by D request id
    landed: dict[str, Any] = field(default_factory=dict)  # verify: completed, waiting for digests

    @property
    def ready(self) -> bool:
        return self.layout is not None

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or self.producer.busy or self.consumer.busy

    def forget_recv(self, request_id: str) -> float | None:
        """Drop the D-side timing of a request that reached its final event."""
        self.incoming.pop(request_id, None)
        self.digests.pop(request_id, None)
        self.landed.pop(request_id, None)
        return self.registered_at.pop(request_id, None)

    def hot(self, now: float, hot_max_s: float) -> bool:
        """A WRITE is moving from or into this rank's memory (for at most hot_max_s)."""
        if any(now - f.posted_at < hot_max_s for f in self.inflight.values()):
            return True
        return any(now - t < hot_max_s for t in self.incoming.values())

    def sizes(self) -> dict[str, int]:
        sizes = {**self.producer.sizes(), **self.consumer.sizes(), "inflight": len(self.inflight)}
        sizes["d_pending"] += len(self.landed)  # verify: landed, digests still on the way
        return sizes

    def __repr__(self) -> str:
        return f"<LocalRank {self.engine_id}/r{self.rank} role={self.role} agent={self.agent.name} {self.sizes()}>"


def layout_from_regions(regions: list[Region], bases: list[int], blocks_per_logical: int) -> Layout:
    return Layout(
        tuple(
            RegionSpec(bases[r.buffer] + r.offset, r.block_len, r.num_blocks, r.stride, r.group)
            for r in regions
        ),
        blocks_per_logical,
    )


def layout_of_agent(info: AgentInfo) -> Layout:
    """A remote agent's layout, as its daemon described it in the hello."""
    return Layout(
        tuple(RegionSpec(r.base, r.block_len, r.num_blocks, r.stride, r.group) for r in info.regions),
        info.blocks_per_logical,
    )
