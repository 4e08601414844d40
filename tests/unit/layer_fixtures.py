"""A layer-wise P worker and pairs of real daemons around it (fake engine, real sockets
and memfds): shared by the layer-wise push tests."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import AsyncIterator

import numpy as np
from daemon_fixtures import D_ENGINE, P_ENGINE, Worker, metric, running_daemon, wait_until
from gpu_fixtures import UUID

from pushsvc.devmem.fake import FakeDeviceMemory, FakeEvent
from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.shm import SharedBuffer

LAYERS = 4
BLOCK = 64
P_BLOCKS, D_BLOCKS = 8, 12


class LayerWorker(Worker):
    """A worker whose regions are the K and V of ``LAYERS`` named layers (or of
    ``layers``: a pipeline stage's), in one buffer; with ``gpu``, its KV is (fake) device
    memory exported by handle, and ``events`` are its layer events (one per layer and one
    for the forward pass's end). ``kw`` goes to ``Worker`` (a stage's ``pp_rank``)."""

    def __init__(self, daemon, role, gpu: FakeDeviceMemory | None = None, events: int = LAYERS + 1,
                 layers: list[str] | None = None, **kw) -> None:
        super().__init__(daemon, role, **kw)
        self.gpu = gpu
        self.events: list[FakeEvent] = []
        self._event_count = events
        self.layers = layers or [f"model.layers.{i}.self_attn" for i in range(LAYERS)]

    async def start_layers(self, blocks: int, seed: int) -> wp.KVRegistered:
        await self.connect()
        self.num_blocks, self.block_len = blocks, BLOCK
        count = 2 * len(self.layers)
        self.buffer = SharedBuffer.create(count * blocks * BLOCK)
        data = np.random.default_rng(seed).integers(0, 256, self.buffer.size, dtype=np.uint8).tobytes()
        ctypes.memmove(self.buffer.address, data, len(data))
        self.initial = self.snapshot()
        regions = [wp.Region(buffer=0, offset=r * blocks * BLOCK, block_len=BLOCK, num_blocks=blocks,
                             layer_names=[self.layers[r // 2]]) for r in range(count)]
        if self.gpu is None:
            return await asyncio.to_thread(self.client.register_kv, [self.buffer.fd], regions)
        handle = self.gpu.export(self.buffer.address, self.buffer.size)
        memory = wp.CudaIpcBuffers(device_uuid=UUID, buffers=[wp.CudaIpcBuffer(handle=handle, size=self.buffer.size)])
        handles = []
        for _ in range(self._event_count):
            event, h = self.gpu.export_event()
            self.events.append(event)
            handles.append(h)
        return await asyncio.to_thread(self.client.register_kv, [], regions, memory=memory, layer_events=handles)

    def compute(self, layer: int, blocks: list[int], salt: int) -> None:
        """The forward pass writes layer ``layer``'s final KV into ``blocks``."""
        assert self.buffer is not None
        for region in (2 * layer, 2 * layer + 1):
            for b in blocks:
                data = bytes([(salt + region * 7 + b) % 256]) * BLOCK
                ctypes.memmove(self.buffer.address + (region * self.num_blocks + b) * BLOCK, data, BLOCK)

    def region_block(self, image: np.ndarray, region: int, block: int) -> bytes:
        start = (region * self.num_blocks + block) * BLOCK
        return image[start:start + BLOCK].tobytes()


@contextlib.asynccontextmanager
async def layer_pair(*, gpu: bool = False, same_host: bool = False, **config) -> AsyncIterator[tuple]:
    """P and D daemons (``config`` for both), each with a ``LayerWorker``; with ``gpu``,
    P's KV is on a (fake) GPU and has layer events, D's stays in host memory (so each
    layer's landing is seen in D's blocks as it happens). With ``same_host`` D's KV is
    on the (fake) GPU too, with a landing buffer, and offered to P for same-host copies."""
    fake = FakeEngine()
    devmem = FakeDeviceMemory() if gpu or same_host else None
    if devmem is not None:
        devmem.add_device(UUID)
    d_config = {"devmem": devmem, "landing_mib": 1} if same_host else {}
    async with running_daemon(fake, P_ENGINE, devmem=devmem, **config) as p, \
            running_daemon(fake, D_ENGINE, **d_config, **config) as d:
        pw = LayerWorker(p, "producer", gpu=devmem)
        dw = LayerWorker(d, "consumer", gpu=devmem, events=0) if same_host else LayerWorker(d, "consumer")
        try:
            await pw.start_layers(P_BLOCKS, seed=1)
            await dw.start_layers(D_BLOCKS, seed=2)
            yield p, d, pw, dw
        finally:
            pw.close()
            dw.close()


def recv_into(p, dw: LayerWorker, rid: str, blocks: list[int]) -> None:
    dw.send(wp.RegisterRecv(request_id=rid, local_block_ids=[blocks], remote_engine_id=P_ENGINE,
                            remote_host="127.0.0.1", remote_port=p.service.peers.port))


async def pushregs_at(p, n: int = 1) -> None:
    await wait_until(lambda: metric(p, "pushsvc_notifications_total", kind="push_reg") >= n, "PUSH_REG at P")


def landed(pw: LayerWorker, dw: LayerWorker, p_blocks: list[int], d_blocks: list[int], layer: int) -> bool:
    """Whether D's blocks hold P's current bytes of ``layer`` (both of its regions)."""
    p_now, d_now = pw.snapshot(), dw.snapshot()
    return all(pw.region_block(p_now, r, s) == dw.region_block(d_now, r, t)
               for r in (2 * layer, 2 * layer + 1) for s, t in zip(p_blocks, d_blocks))


def untouched(dw: LayerWorker, d_blocks: list[int], layer: int) -> bool:
    d_now = dw.snapshot()
    assert dw.initial is not None
    return all(dw.region_block(d_now, r, t) == dw.region_block(dw.initial, r, t)
               for r in (2 * layer, 2 * layer + 1) for t in d_blocks)


def others_untouched(dw: LayerWorker, d_blocks: list[int]) -> bool:
    """Whether every block of D but ``d_blocks`` still holds its first bytes, in every layer."""
    others = [b for b in range(dw.num_blocks) if b not in d_blocks]
    return all(untouched(dw, others, layer) for layer in range(LAYERS))


async def stop_mid_step(who: str, pw: LayerWorker, dw: LayerWorker, rid: str, d_blocks: list[int]) -> None:
    """End ``rid``'s push while its layers compute, as ``who`` says: P's worker evicts it
    ("p_evicts"), P's worker leaves ("p_worker_leaves"), or D's worker withdraws it
    ("d_withdraws"); and check that both workers hear of it."""
    if who == "p_evicts":
        pw.send(wp.Evict(request_ids=[rid]))
        failed = await pw.wait_for(wp.SendFailed, rid)
        assert failed.reason.startswith("cancelled: P's request ended before its last layer was final"), failed
        event = await dw.wait_for(wp.RecvFailed, rid)
        assert "push_failed_remote" in event.reason and sorted(event.block_ids) == sorted(d_blocks)
    elif who == "p_worker_leaves":
        pw.close()
        event = await dw.wait_for(wp.RecvFailed, rid)
        assert "worker_gone" in event.reason, event
    else:
        assert who == "d_withdraws", who
        dw.send(wp.Evict(request_ids=[rid]))
        event = await dw.wait_for(wp.RecvFailed, rid)
        assert event.reason == "cancelled", event
        failed = await pw.wait_for(wp.SendFailed, rid)
        assert failed.reason.startswith("cancelled: D withdrew the registration before the last layer"), failed


async def same_host_met(p, d, pw: LayerWorker, dw: LayerWorker) -> None:
    """A first push (whole, over NIXL into D's landing slots: D does not know P yet), then
    P's IpcReady at D, so D's next registrations ask P to copy."""
    recv_into(p, dw, "first", [0])
    await pushregs_at(p)
    pw.send(wp.SendReady(request_id="first", block_ids=[[0]]))
    assert await dw.wait_for(wp.RecvDone, "first")
    assert await pw.wait_for(wp.SendDone, "first")
    agent = d.service.ranks.current[0].agent.name
    await wait_until(lambda: (peer := d.service.peers.find_engine(p.config.engine_id)) is not None
                     and agent in peer.ipc_ready, "P's IpcReady at D")
    dw.initial = dw.snapshot()
