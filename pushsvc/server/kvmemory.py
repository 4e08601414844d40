"""A worker's ``RegisterKV``, made into a ``RankMemory``: its buffers mapped, its regions
checked against them, registered with the rank's NIXL agent, and on a GPU consumer the
landing buffer allocated (docs/gpu.md).

CPU: memfds sealed against shrinking, mapped whole, registered as DRAM. GPU: CUDA IPC
handles opened on the device with the worker's UUID, registered as VRAM where this rank
WRITEs from them; a consumer rank gets a landing buffer of its own, which is what peers
WRITE into. Everything acquired is given back if any step fails.
"""

from __future__ import annotations

import fcntl
from dataclasses import dataclass

import structlog

from pushsvc.devmem.base import Device, DeviceEvent, DeviceMemory
from pushsvc.engine.base import Agent
from pushsvc.errors import LayoutError, ProtocolError
from pushsvc.protocol import peer as pp
from pushsvc.protocol import worker as wp
from pushsvc.server.ranks import LandingMemory, MappedBuffer, RankMemory, StagingMemory, layout_from_regions
from pushsvc.shm import SharedBuffer
from pushsvc.state.landing import CopyPlan, LandingGeometry
from pushsvc.state.layerwise import LayerMap
from pushsvc.state.layout import MAX_DESCRIPTORS, Layout, descriptor_table
from pushsvc.state.stages import keys

log = structlog.get_logger("pushsvc.kvmemory")


@dataclass(frozen=True, slots=True)
class MemorySettings:
    landing_bytes: int  # per consumer rank with CUDA KV; 0 = WRITEs go into the imported KV
    staging_bytes: int = 0  # per producer rank with CUDA KV; 0 = WRITEs go from the imported KV
    # This host's boot id: a consumer rank with CUDA KV offers it to same-host P daemons
    # (``AgentInfo.ipc``); "" = never (``ipc_push = "off"``).
    ipc_host: str = ""


def map_kv(msg: wp.RegisterKV, fds: list[int], *, agent: Agent, role: wp.Role, devmem: DeviceMemory | None,
           settings: MemorySettings) -> RankMemory:
    descriptors = sum(r.num_blocks for r in msg.regions)
    if descriptors > MAX_DESCRIPTORS:
        # Each block of each region becomes a NIXL descriptor held in memory.
        raise LayoutError(f"{descriptors} blocks across regions exceed the limit of {MAX_DESCRIPTORS}")
    if isinstance(msg.memory, wp.MemfdBuffers):
        if msg.layer_events:
            raise ProtocolError("layer events come with CUDA KV memory; KV in host memory is final when "
                                "save_kv_layer is called and needs none")
        return _map_memfds(msg, fds, agent)
    if fds:
        raise ProtocolError(f"{len(fds)} fds sent with CUDA memory, which takes none")
    if devmem is None:
        raise ProtocolError("this daemon runs without the GPU path (gpu = \"off\", or no CUDA driver or GPU "
                            "on this host): it cannot take CUDA KV memory")
    return _map_cuda(msg, agent, role, devmem, settings)


def _check_regions(regions: list[wp.Region], buffers: list[MappedBuffer]) -> None:
    for r in regions:
        if r.buffer >= len(buffers):
            raise LayoutError(f"region names buffer {r.buffer}, only {len(buffers)} sent")
        end = r.offset + (r.num_blocks - 1) * r.stride + r.block_len
        if end > buffers[r.buffer].size:
            raise LayoutError(f"region ends at {end}, past buffer {r.buffer} of {buffers[r.buffer].size} bytes")


def _map_memfds(msg: wp.RegisterKV, fds: list[int], agent: Agent) -> RankMemory:
    assert isinstance(msg.memory, wp.MemfdBuffers)
    if len(fds) != msg.memory.count:
        raise ProtocolError(f"expected {msg.memory.count} fds, got {len(fds)}")
    for fd in fds:
        _require_sealed(fd)
    buffers: list[SharedBuffer] = []
    try:
        for fd in fds:
            buffers.append(SharedBuffer.attach(fd))
        fds.clear()  # owned by the buffers now
        _check_regions(msg.regions, buffers)
        agent.register([(b.address, b.size) for b in buffers], "DRAM")
        layout = layout_from_regions(msg.regions, [b.address for b in buffers], msg.blocks_per_logical)
        descs = descriptor_table(layout)
        dlist = agent.prep_local(descs, "DRAM")
    except BaseException:
        for b in buffers:
            b.close()
        raise
    return RankMemory(list(buffers), list(msg.regions), layout, descs, dlist)


def _map_cuda(msg: wp.RegisterKV, agent: Agent, role: wp.Role, devmem: DeviceMemory,
              settings: MemorySettings) -> RankMemory:
    memory = msg.memory
    assert isinstance(memory, wp.CudaIpcBuffers)
    device = devmem.device(memory.device_uuid)
    buffers: list[MappedBuffer] = []
    owned: list[MappedBuffer] = []  # landing and staging buffers
    try:
        for b in memory.buffers:
            buffers.append(device.import_ipc(b.handle))
        _check_regions(msg.regions, buffers)
        layout = layout_from_regions(msg.regions, [b.address for b in buffers], msg.blocks_per_logical)
        descs = descriptor_table(layout, device.ordinal)
        dlist = None
        staging = None
        # The worker's own KV is registered with NIXL where a WRITE reads it (P without
        # staging) or lands in it (D without a landing buffer), and only there.
        from_kv = role != "consumer" and not settings.staging_bytes
        into_kv = role != "producer" and not settings.landing_bytes
        if from_kv or into_kv:
            agent.register([(b.address, b.size) for b in buffers], "VRAM", device.ordinal)
        if role != "consumer" and settings.staging_bytes:
            geometry = LandingGeometry.build(layout, settings.staging_bytes)
            owned.append(device.allocate(geometry.nbytes))
            staging = _staging(agent, device, layout, geometry, owned[-1])
        elif from_kv:
            dlist = agent.prep_local(descs, "VRAM")
        landing = None
        if role != "producer" and settings.landing_bytes:
            geometry = LandingGeometry.build(layout, settings.landing_bytes)
            owned.append(device.allocate(geometry.nbytes))
            landing = _landing(agent, device, layout, geometry, owned[-1])
        events = _layer_events(msg, role, device, settings, owned)
        offer = _offer(msg, memory, buffers, settings.ipc_host) if role != "producer" and settings.ipc_host else None
    except BaseException:
        for b in [*buffers, *owned]:
            b.close()
        raise
    log.info("cuda_kv_mapped", device=device.ordinal, buffers=len(buffers), imported=sum(b.size for b in buffers),
             landing_slots=landing.geometry.slots if landing else 0,
             landing_bytes=landing.geometry.nbytes if landing else 0,
             staging_slots=staging.geometry.slots if staging else 0,
             copy_width=landing.copier.plan.width if landing else 0)
    return RankMemory(buffers, list(msg.regions), layout, descs, dlist, "VRAM", device, landing, staging,
                      layer_events=events, ipc=offer)


def _offer(msg: wp.RegisterKV, memory: wp.CudaIpcBuffers, buffers: list[MappedBuffer], host: str) -> pp.IpcKV:
    """The worker's KV as a same-host P may map it: its handles, with the sizes this daemon
    mapped (not the worker's word), and where each region lies."""
    return pp.IpcKV(
        host=host, device=memory.device_uuid,
        buffers=[pp.IpcBuffer(handle=b.handle, size=m.size) for b, m in zip(memory.buffers, buffers)],
        regions=[pp.IpcRegion(buffer=r.buffer, offset=r.offset, num_blocks=r.num_blocks,
                              block_stride=0 if r.stride == r.block_len else r.stride) for r in msg.regions])


def _layer_events(msg: wp.RegisterKV, role: wp.Role, device: Device, settings: MemorySettings,
                  owned: list) -> list[DeviceEvent]:
    """Open a layer-wise worker's events (one per layer, one for the forward pass's end);
    each goes into ``owned`` as it opens, so a failure closes what was opened."""
    if not msg.layer_events:
        return []
    if role == "consumer":
        raise ProtocolError("layer events are for a worker that pushes (a producer)")
    if settings.staging_bytes:
        raise ProtocolError("layer-wise push reads the worker's KV as each layer is final; this daemon copies P's "
                            "blocks into its staging buffer first (staging_mib): turn one of them off")
    layers = LayerMap(keys(r.layer_names for r in msg.regions)).layers
    if len(msg.layer_events) != layers + 1:
        raise ProtocolError(f"{len(msg.layer_events)} layer events for {layers} layers: one per layer and one for "
                            "the forward pass's end are needed")
    events = []
    for handle in msg.layer_events:
        events.append(device.import_event(handle))
        owned.append(events[-1])
    return events


def _landing(agent: Agent, device: Device, layout: Layout, geometry: LandingGeometry,
             buffer: MappedBuffer) -> LandingMemory:
    agent.register([(buffer.address, buffer.size)], "VRAM", device.ordinal)
    advertised = geometry.layout(buffer.address)
    copier = device.copier(CopyPlan.build(layout, advertised))
    return LandingMemory(buffer, geometry, advertised, copier)


def _staging(agent: Agent, device: Device, layout: Layout, geometry: LandingGeometry,
             buffer: MappedBuffer) -> StagingMemory:
    own = geometry.layout(buffer.address)
    agent.register([(buffer.address, buffer.size)], "VRAM", device.ordinal)
    descs = descriptor_table(own, device.ordinal)
    dlist = agent.prep_local(descs, "VRAM")
    return StagingMemory(buffer, geometry, own, device.copier(CopyPlan.build_staging(layout, own)), descs, dlist)


def _require_sealed(fd: int) -> None:
    """A memfd whose size can shrink would make our mapping SIGBUS the daemon when the
    worker truncates it: only memfds sealed with F_SEAL_SHRINK are mapped."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ProtocolError("KV memory must be a memfd (it cannot be sealed)") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise ProtocolError("KV memfd is not sealed against shrinking (add F_SEAL_SHRINK before sending it)")
