"""The real device memory, through CUDA driver calls only (``driver.py``): imports and
owned allocations, and the landing copy (``kernel.py``'s kernel on a stream of our own,
its completion an event the progress loop polls). No torch, no Triton: a daemon starts
without importing either (docs/gpu.md).

Every call runs on the event loop thread; each device's primary context is made current
before driver calls, and kernels go to one copy stream per device (non-blocking: a copy
never waits behind the engine's work or ours).
"""

from __future__ import annotations

import collections
import ctypes

import numpy as np
import structlog

from pushsvc.devmem import kernel
from pushsvc.devmem.driver import Driver, format_uuid
from pushsvc.errors import DeviceError
from pushsvc.state.landing import (COPY_FIELDS, CopyPlan, SlotRun, check_launch, check_pair_ids, check_pairs,
                                   group_entries)

log = structlog.get_logger("pushsvc.devmem")

# Pair-list entries (int64) in each pair copier's ring: a request of up to this many blocks
# per KV group uploads its pairs without an allocation (512 KiB of device and host memory).
_PAIR_RING = 1 << 16
# Copy events kept for reuse per device (creating and destroying one per launch cost
# 56 us of a cold daemon's loop on the H200 host).
_EVENT_POOL = 64


class _Mapping:
    __slots__ = ("address", "size", "_close")

    def __init__(self, address: int, size: int, close) -> None:
        self.address, self.size, self._close = address, size, close

    def close(self) -> None:
        if self.address:
            address, self.address = self.address, 0
            self._close(address)

    def __repr__(self) -> str:
        return f"<device memory {self.address:#x}+{self.size}>"


class _Copy:
    """One launch; its event goes back to the device's pool once seen done."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: CudaDevice, event: int) -> None:
        self._device, self._event = device, event

    def done(self) -> bool:
        if self._event and self._device.driver.event_done(self._event):
            self._release()
        return not self._event

    def wait(self) -> None:
        if self._event:
            self._device.driver.event_synchronize(self._event)
            self._release()

    def _release(self) -> None:
        event, self._event = self._event, 0
        self._device.recycle_event(event)


class _Event:
    """A worker's interprocess event, opened in this process."""

    __slots__ = ("_device", "_event")

    def __init__(self, device: CudaDevice, event: int) -> None:
        self._device, self._event = device, event

    def done(self) -> bool:
        self._device.current()
        return self._device.driver.event_done(self._event)

    def close(self) -> None:
        if self._event:
            event, self._event = self._event, 0
            self._device.current()
            self._device.driver.event_destroy(event)


class _Nothing:
    """A copy with nothing to move."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class _TableMemory:
    """A copy table on the device followed by ``count`` int64 entries the kernel reads (a
    slot -> block map, a ring of pair lists), and those entries' host mirror in page-locked
    memory, so that their uploads on the copy stream are asynchronous."""

    def __init__(self, device: CudaDevice, plan: CopyPlan, count: int) -> None:
        rows = np.ascontiguousarray(plan.table, dtype=np.int64)
        assert rows.shape[1] == COPY_FIELDS
        self._device = device
        self._host = 0
        self.nbytes = rows.nbytes + count * 8
        self._memory = device.allocate(max(self.nbytes, 8))
        self.table = self._memory.address
        self.entries = self.table + rows.nbytes
        try:
            self._host = device.driver.host_alloc(max(count, 1) * 8)
            self._mirror = np.frombuffer((ctypes.c_int64 * max(count, 1)).from_address(self._host), dtype=np.int64)
            device.driver.upload(self.table, rows.ctypes.data, rows.nbytes)
        except DeviceError:
            self.close()
            raise

    def put(self, at: int, values: np.ndarray, to: int) -> None:
        """Write ``values`` into the mirror from entry ``at`` and queue their upload to the
        device address ``to`` on the copy stream. The caller makes the device current."""
        self._mirror[at:at + len(values)] = values
        self._device.driver.upload_async(to, self._host + at * 8, len(values) * 8, self._device.stream)

    def close(self) -> None:
        if self._host:
            host, self._host = self._host, 0
            self._mirror = np.empty(0, dtype=np.int64)
            self._device.current()
            self._device.driver.host_free(host)
        self._memory.close()


class _Copier:
    """A rank's copy table and slot -> block map on the device; the map's host mirror in
    page-locked memory, so its uploads are asynchronous. A slot's map entry is rewritten
    only when the slot is granted again, which is after every copy through it finished."""

    def __init__(self, device: CudaDevice, plan: CopyPlan) -> None:
        self.plan = plan
        self._device = device
        self._memory = _TableMemory(device, plan, plan.groups * plan.slots)
        self._kernel = _Kernel(device, plan.width, self._memory.table, plan.mode)
        self.nbytes = self._memory.nbytes

    def map(self, group: int, slots: np.ndarray, blocks: np.ndarray) -> SlotRun:
        slots = np.asarray(slots, dtype=np.int64)
        blocks = np.asarray(blocks, dtype=np.int64)
        why = check_pairs(self.plan, *self.plan.group_span(group), slots, blocks)
        if why:
            raise DeviceError(f"copy refused: {why}")
        if not len(slots):
            return SlotRun(group, 0, 0)
        device = self._device
        device.current()
        at = group * self.plan.slots + int(slots[0])
        self._memory.put(at, blocks, self._group_map(group) + int(slots[0]) * 8)
        return SlotRun(group, int(slots[0]), len(slots))

    def launch(self, run: SlotRun, first: int, count: int) -> _Copy | _Nothing:
        why = check_launch(self.plan, run, first, count)
        if why:
            raise DeviceError(f"copy refused: {why}")
        if not run.count or not count:
            return _Nothing()
        device = self._device
        device.current()
        chunks = -(-self.plan.max_bytes(first, count) // kernel.CHUNK)
        return self._kernel.run(self._group_map(run.group), run.first, first, (run.count, count, chunks))

    def _group_map(self, group: int) -> int:
        return self._memory.entries + group * self.plan.slots * 8

    def close(self) -> None:
        self._memory.close()


class _Kernel:
    """One copier's launches of the copy kernel: its parameters (a copy table, a mode) in
    ctypes values made once and refilled per launch, since building six values and their
    pointer array took ~20 us a launch, ~110 us after the daemon idled 50 ms. The driver
    reads the parameters during the launch call, so one set serves every launch."""

    def __init__(self, device: CudaDevice, width: int, table: int, mode: int) -> None:
        self._device = device
        self._fn = device.functions[width]
        self._values = (ctypes.c_uint64(table), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint32(),
                        ctypes.c_uint64(kernel.CHUNK), ctypes.c_uint32(mode))
        self._args = (ctypes.c_void_p * len(self._values))(*(ctypes.addressof(v) for v in self._values))

    def run(self, pairs: int, slot_base: int, first: int, grid: tuple[int, int, int]) -> _Copy:
        """Launch on the device's copy stream and record a pooled event behind it."""
        values = self._values
        values[1].value, values[2].value, values[3].value = pairs, slot_base, first
        device = self._device
        device.driver.launch(self._fn, grid, kernel.THREADS, device.stream, self._args)
        return _record(device)


def _record(device: CudaDevice) -> _Copy:
    """A pooled event recorded behind the work queued on the device's copy stream."""
    driver = device.driver
    event = device.pooled_event()
    try:
        driver.event_record(event, device.stream)
    except DeviceError:
        driver.event_destroy(event)
        raise
    return _Copy(device, event)


class _PairCopier:
    """P's copy table into one same-host D's KV on the device, and a ring of pair lists:
    each launch's pairs go into page-locked host memory and up to the device on the copy
    stream (asynchronous), the kernel reading them there. A range of the ring is written
    again only once the launch that read it finished; a launch that finds no free range
    takes a pool allocation instead, freed in stream order."""

    def __init__(self, device: CudaDevice, plan: CopyPlan) -> None:
        self.plan = plan
        self._device = device
        self._memory = _TableMemory(device, plan, _PAIR_RING)
        self._kernel = _Kernel(device, plan.width, self._memory.table, plan.mode)
        self.nbytes = self._memory.nbytes
        self._inflight: collections.deque[tuple[int, int, _Copy]] = collections.deque()
        self._head = 0

    def launch(self, group: int, src: np.ndarray, dst: np.ndarray,
               entries: tuple[int, int] | None = None) -> _Copy | _Nothing:
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        first, count = self.plan.group_span(group) if entries is None else entries
        why = group_entries(self.plan, group, first, count) or check_pair_ids(self.plan, first, count, src, dst)
        if why:
            raise DeviceError(f"copy refused: {why}")
        if not len(src) or not count:
            return _Nothing()
        device, driver = self._device, self._device.driver
        device.current()
        chunks = -(-self.plan.max_bytes(first, count) // kernel.CHUNK)
        grid = (len(src), count, chunks)
        at = self._take(len(src))
        if at is not None:
            ring = self._memory.entries + at * 8
            self._memory.put(at, (dst << 32) | src, ring)
            job = self._kernel.run(ring, 0, first, grid)
            self._inflight.append((at, at + len(src), job))
            return job
        packed = np.ascontiguousarray((dst << 32) | src)
        pairs = driver.alloc_async(packed.nbytes, device.stream)
        try:  # from pageable memory: the driver stages it before the call returns
            driver.upload_async(pairs, packed.ctypes.data, packed.nbytes, device.stream)
            return self._kernel.run(pairs, 0, first, grid)
        finally:
            driver.free_async(pairs, device.stream)

    def _take(self, n: int) -> int | None:
        """The start of ``n`` ring entries no launch in flight reads, or None."""
        while self._inflight and self._inflight[0][2].done():
            self._inflight.popleft()
        if n > _PAIR_RING:
            return None
        start = self._head if self._head + n <= _PAIR_RING else 0
        if any(a < start + n and start < b for a, b, _ in self._inflight):
            return None
        self._head = start + n
        return start

    def close(self) -> None:
        self._memory.close()


class CudaDevice:
    def __init__(self, driver: Driver, ordinal: int, uuid: bytes) -> None:
        self.driver = driver
        self.ordinal = ordinal
        self.uuid = uuid
        self.imported = 0  # bytes mapped from other processes
        self.allocated = 0  # bytes owned
        self._ctx = driver.retain_context(ordinal)
        self.stream = self._module = 0
        self._events: list[int] = []  # copy events done with, for the next launches
        try:
            self.current()
            self.stream = driver.stream()
            self._module = driver.load_module(kernel.ptx())
            self.functions = {w: driver.function(self._module, kernel.kernel_name(w)) for w in kernel.WIDTHS}
            self._self_test()
        except BaseException:
            self.close()
            raise

    def current(self) -> None:
        self.driver.use(self._ctx)

    def pooled_event(self) -> int:
        """An event for a copy's completion: one a finished copy gave back, else a new one."""
        return self._events.pop() if self._events else self.driver.event()

    def recycle_event(self, event: int) -> None:
        if len(self._events) < _EVENT_POOL:
            self._events.append(event)
        else:
            self.driver.event_destroy(event)

    def import_ipc(self, handle: bytes) -> _Mapping:
        self.current()
        address, size = self.driver.ipc_open(handle)
        self.imported += size

        def close(addr: int) -> None:
            self.current()
            self.driver.ipc_close(addr)
            self.imported -= size

        return _Mapping(address, size, close)

    def import_event(self, handle: bytes) -> _Event:
        self.current()
        return _Event(self, self.driver.ipc_open_event(handle))

    def allocate(self, nbytes: int) -> _Mapping:
        self.current()
        address = self.driver.alloc(nbytes)
        self.allocated += nbytes
        try:
            self.driver.memset(address, 0, nbytes)
        except DeviceError:
            self.driver.free(address)
            self.allocated -= nbytes
            raise

        def close(addr: int) -> None:
            self.current()
            self.driver.free(addr)
            self.allocated -= nbytes

        return _Mapping(address, nbytes, close)

    def copier(self, plan: CopyPlan) -> _Copier:
        if len(plan.table) > 65535:
            raise DeviceError(f"{len(plan.table)} KV regions: the landing copy takes at most 65535")
        return _Copier(self, plan)

    def pair_copier(self, plan: CopyPlan) -> _PairCopier:
        if len(plan.table) > 65535:
            raise DeviceError(f"{len(plan.table)} KV regions: the copy takes at most 65535")
        return _PairCopier(self, plan)

    def read(self, address: int, nbytes: int) -> bytes:
        self.current()
        out = ctypes.create_string_buffer(nbytes)
        self.driver.download(ctypes.addressof(out), address, nbytes)
        return out.raw

    def synchronize(self) -> None:
        self.current()
        self.driver.stream_synchronize(self.stream)

    def _self_test(self) -> None:
        """Each width of the kernel copies two blocks of a one-entry plan to the places
        ``CopyPlan`` says (a misaligned base forces the width), or the device is not used."""
        for width in kernel.WIDTHS:
            for gather in (False, True):
                self._check_width(width, gather)
            self._check_pairs(width)
        log.info("copy_kernel_checked", device=self.ordinal, widths=list(kernel.WIDTHS))

    def _check_width(self, width: int, gather: bool) -> None:
        length, slots, blocks = 8 * width, 4, 5
        n_src, n_dst = (blocks, slots) if gather else (slots, blocks)
        pairs = np.array([1, 2]), np.array([4, 0])  # (slots, blocks)
        memory = self.allocate(4096)
        try:
            src, dst = memory.address + width, memory.address + 2048 + width
            pattern = (np.arange(n_src * length) % 251 + 1).astype(np.uint8)
            self.driver.upload(src, pattern.ctypes.data, pattern.nbytes)
            table = np.array([[src, length, n_src, dst, length, n_dst, length, 0]], dtype=np.int64)
            plan = CopyPlan(table, np.zeros(1, np.int64), np.zeros(1, np.int64), 1, slots, width, gather)
            copier = _Copier(self, plan)
            try:
                copier.launch(copier.map(0, *pairs), 0, 1).wait()
            finally:
                copier.close()
            got = np.frombuffer(self.read(dst, n_dst * length), dtype=np.uint8).reshape(n_dst, length)
        finally:
            memory.close()
        want = np.zeros((n_dst, length), dtype=np.uint8)
        rows = pattern.reshape(n_src, length)
        for s, b in zip(*pairs):
            if gather:
                want[s] = rows[b]
            else:
                want[b] = rows[s]
        if not np.array_equal(got, want):
            raise DeviceError(f"the copy kernel ({width}-byte accesses, {'staging' if gather else 'landing'}) "
                              "copied wrong bytes on this device")

    def _check_pairs(self, width: int) -> None:
        """The pair copy: source blocks 3 and 0 into destination blocks 1 and 4, blocks long
        enough for both of the kernel's loops (four accesses at a time, then one)."""
        length, n_src, n_dst = (4 * kernel.THREADS + 8) * width, 4, 5
        src_ids, dst_ids = np.array([3, 0]), np.array([1, 4])
        memory = self.allocate((n_src + n_dst) * length + 4 * width)
        try:
            src, dst = memory.address + width, memory.address + n_src * length + 2 * width
            pattern = (np.arange(n_src * length) % 251 + 1).astype(np.uint8)
            self.driver.upload(src, pattern.ctypes.data, pattern.nbytes)
            table = np.array([[src, length, n_src, dst, length, n_dst, length, 0]], dtype=np.int64)
            plan = CopyPlan(table, np.zeros(1, np.int64), np.zeros(1, np.int64), 1, 0, width, pairs=True)
            copier = _PairCopier(self, plan)
            try:
                copier.launch(0, src_ids, dst_ids).wait()
            finally:
                copier.close()
            got = np.frombuffer(self.read(dst, n_dst * length), dtype=np.uint8).reshape(n_dst, length)
        finally:
            memory.close()
        want = np.zeros((n_dst, length), dtype=np.uint8)
        want[dst_ids] = pattern.reshape(n_src, length)[src_ids]
        if not np.array_equal(got, want):
            raise DeviceError(f"the copy kernel ({width}-byte accesses, pairs) copied wrong bytes on this device")

    def close(self) -> None:
        try:
            self.current()
            if self.stream:
                self.driver.stream_synchronize(self.stream)
                self.driver.stream_destroy(self.stream)
            while self._events:
                self.driver.event_destroy(self._events.pop())
            if self._module:
                self.driver.unload_module(self._module)
        finally:
            self.stream = self._module = 0
            self.driver.release_context(self.ordinal)

    def __repr__(self) -> str:
        return (f"<CudaDevice {self.ordinal} {format_uuid(self.uuid)} imported={self.imported} "
                f"allocated={self.allocated}>")


class CudaMemory:
    name = "cuda"

    def __init__(self) -> None:
        self._driver = Driver()
        if not self._driver.device_count():
            raise DeviceError("no CUDA device is visible")
        self._devices: dict[bytes, CudaDevice] = {}
        # A CUDA context must be current before the first NIXL agent is made: UCX enables
        # its CUDA transports only then, and took VRAM for host memory without one
        # ("VRAM memory is detected as host by UCX"). The first visible device's context
        # is made now, at start; the others when a worker's memory is on them.
        self.device(self._driver.device_uuid(0))

    def device(self, uuid: bytes) -> CudaDevice:
        dev = self._devices.get(uuid)
        if dev is None:
            ordinal = self._driver.find_device(uuid)
            dev = self._devices[uuid] = CudaDevice(self._driver, ordinal, uuid)
        return dev

    def usage(self) -> dict[str, int]:
        return {"imported": sum(d.imported for d in self._devices.values()),
                "allocated": sum(d.allocated for d in self._devices.values())}

    def close(self) -> None:
        for dev in self._devices.values():
            dev.close()
        self._devices.clear()

    def __repr__(self) -> str:
        return f"<CudaMemory devices={list(self._devices.values())}>"
