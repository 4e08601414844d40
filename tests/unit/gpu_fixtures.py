"""In-process P/D pairs whose KV is "device" memory: the fake engine moves the bytes and
``FakeDeviceMemory`` stands in for the GPU (host buffers exported by handle, a landing
buffer, gather copies that can be held in flight). Everything else is the real daemon."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from daemon_fixtures import D_ENGINE, P_ENGINE, REGIONS, PushPair, Worker, kv_regions, running_daemon

from pushsvc.devmem.fake import FakeDeviceMemory
from pushsvc.engine.fake import FakeEngine
from pushsvc.protocol import worker as wp
from pushsvc.server.daemon import Daemon
from pushsvc.shm import SharedBuffer

UUID = bytes(range(16))
BIG_BLOCK = 256 << 10  # two regions: one landing slot is 512 KiB, so landing_mib = 1 holds 2


class GpuWorker(Worker):
    """A worker whose KV buffer is exported to the daemon by (fake) CUDA IPC handle."""

    def __init__(self, daemon: Daemon, role: wp.Role, devmem: FakeDeviceMemory, **kw: Any) -> None:
        super().__init__(daemon, role, **kw)
        self.devmem = devmem

    def memory(self) -> wp.CudaIpcBuffers:
        assert self.buffer is not None
        handle = self.devmem.export(self.buffer.address, self.buffer.size)
        return wp.CudaIpcBuffers(device_uuid=UUID, buffers=[wp.CudaIpcBuffer(handle=handle, size=self.buffer.size)])

    async def register(self, num_blocks: int, block_len: int = BIG_BLOCK, seed: int = 0,
                       heads: int = 0) -> wp.KVRegistered:
        self.num_blocks, self.block_len = num_blocks, block_len
        self.buffer = SharedBuffer.create(REGIONS * num_blocks * block_len)
        pattern = np.random.default_rng(seed).integers(0, 256, self.buffer.size, dtype=np.uint8).tobytes()
        ctypes.memmove(self.buffer.address, pattern, len(pattern))
        self.initial = self.snapshot()
        return await asyncio.to_thread(self.client.register_kv, [], kv_regions(num_blocks, block_len, heads),
                                       memory=self.memory())


@contextlib.asynccontextmanager
async def gpu_pair(*, p_blocks: int = 8, d_blocks: int = 16, block_len: int = BIG_BLOCK, landing_mib: int = 4,
                   part_mib: int = 0, copy_polls: int = 1, p_config: dict[str, Any] | None = None,
                   d_config: dict[str, Any] | None = None, ipc: bool = False
                   ) -> AsyncIterator[tuple[PushPair, FakeDeviceMemory]]:
    """``ipc``: same-host push on (both daemons see the same host); off, P always WRITEs."""
    fake = FakeEngine()
    devmem = FakeDeviceMemory(copy_polls=copy_polls)
    devmem.add_device(UUID)
    mode = "auto" if ipc else "off"
    async with running_daemon(fake, P_ENGINE, devmem=devmem, write_part_mib=part_mib,
                              **{"ipc_push": mode, **(p_config or {})}) as p, \
            running_daemon(fake, D_ENGINE, devmem=devmem, landing_mib=landing_mib,
                           **{"ipc_push": mode, **(d_config or {})}) as d:
        pw, dw = GpuWorker(p, "producer", devmem), GpuWorker(d, "consumer", devmem)
        try:
            await pw.start(p_blocks, block_len, seed=1)
            await dw.start(d_blocks, block_len, seed=2)
            yield PushPair(fake, p, d, pw, dw), devmem
        finally:
            pw.close()
            dw.close()
