"""Host memory standing in for a GPU, for unit tests of the landing path.

A ``FakeDeviceMemory`` hands out devices by UUID; ``export`` gives a 64-byte "IPC handle"
for a host buffer the test owns, and ``import_ipc`` maps it back (the same address: one
process). Landing copies move real bytes (``copy_ranges``: what the kernel does) when they
are issued but report ``done`` only after
``copy_polls`` queries, and not at all while ``hold_copies`` is set, so tests see final
events held behind copies in flight. ``export_event`` stands for a worker's interprocess
event (layer-wise push), recorded and finished by the test.
"""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np

from pushsvc.errors import DeviceError
from pushsvc.state.landing import (CopyPlan, SlotRun, check_launch, check_pair_ids, check_pairs, copy_ranges,
                                   group_entries)


class _Buffer:
    def __init__(self, address: int, size: int, on_close) -> None:
        self.address, self.size, self._on_close = address, size, on_close

    def close(self) -> None:
        if self.address:
            self.address = 0
            self._on_close()


class _Copy:
    def __init__(self, device: FakeDevice, polls: int) -> None:
        self._device = device
        self._left = polls
        device.in_flight += 1

    def done(self) -> bool:
        if self._left > 0 and self._device.memory.fault_copies:
            self._left = 0
            self._device.in_flight -= 1
            raise DeviceError("cuEventQuery failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)")
        if self._left > 0 and not self._device.memory.hold_copies:
            self._left -= 1
            if self._left == 0:
                self._device.in_flight -= 1
        return self._left == 0

    def wait(self) -> None:
        self._device.memory.hold_copies = False  # a blocking wait ends the hold: the copy "finishes"
        while not self.done():
            pass


class FakeEvent:
    """A worker's interprocess event in one process: ``recorded`` by the test (its kernels
    "queued"), ``finish`` when they ran. Opened any number of times."""

    def __init__(self) -> None:
        self.pending = False  # recorded, its work not finished
        self.faulted = False  # the worker's context failed: a query raises
        self.opened = 0  # open handles in the daemon

    def record(self) -> None:
        self.pending = True

    def finish(self) -> None:
        self.pending = False

    def fault(self) -> None:
        self.faulted = True


class _OpenedEvent:
    def __init__(self, event: FakeEvent) -> None:
        self._event: FakeEvent | None = event
        event.opened += 1

    def done(self) -> bool:
        assert self._event is not None, "queried after close"
        if self._event.faulted:
            raise DeviceError("cuEventQuery failed: CUDA_ERROR_LAUNCH_FAILED (719)")
        return not self._event.pending

    def close(self) -> None:
        if self._event is not None:
            self._event.opened -= 1
            self._event = None


class _Copier:
    def __init__(self, device: FakeDevice, plan: CopyPlan) -> None:
        self.plan = plan
        self.nbytes = plan.table.nbytes + plan.groups * plan.slots * 8
        self._device = device
        device.allocated += self.nbytes
        self._open = True
        self._map = np.full((plan.groups, plan.slots), -1, dtype=np.int64)  # slot -> block, per group

    def map(self, group: int, slots: np.ndarray, blocks: np.ndarray) -> SlotRun:
        assert self._open, "map through a closed copier"
        slots, blocks = np.asarray(slots, dtype=np.int64), np.asarray(blocks, dtype=np.int64)
        why = check_pairs(self.plan, *self.plan.group_span(group), slots, blocks)
        if why:
            raise DeviceError(f"copy refused: {why}")
        self._map[group, slots] = blocks  # the device's slot -> block map, as the real copier keeps it
        return SlotRun(group, int(slots[0]) if len(slots) else 0, len(slots))

    def launch(self, run: SlotRun, first: int, count: int) -> _Copy:
        assert self._open, "copy through a closed copier"
        why = check_launch(self.plan, run, first, count)
        if why:
            raise DeviceError(f"copy refused: {why}")
        if run.count and count:
            slots = np.arange(run.first, run.first + run.count, dtype=np.int64)
            blocks = self._map[run.group, run.first:run.first + run.count]
            for src, dst, n in zip(*copy_ranges(self.plan, first, count, slots, blocks)):
                ctypes.memmove(int(dst), int(src), int(n))
        self._device.gathers += 1
        return _Copy(self._device, self._device.memory.copy_polls)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._device.allocated -= self.nbytes


class _PairCopier:
    def __init__(self, device: FakeDevice, plan: CopyPlan) -> None:
        self.plan = plan
        self.nbytes = plan.table.nbytes
        self._device = device
        device.allocated += self.nbytes
        self._open = True

    def launch(self, group: int, src: np.ndarray, dst: np.ndarray, entries: tuple[int, int] | None = None) -> _Copy:
        assert self._open, "copy through a closed copier"
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        first, count = self.plan.group_span(group) if entries is None else entries
        why = group_entries(self.plan, group, first, count) or check_pair_ids(self.plan, first, count, src, dst)
        if why:
            raise DeviceError(f"copy refused: {why}")
        if self._device.memory.fail_launches:
            raise DeviceError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701)")
        for s, d, n in zip(*copy_ranges(self.plan, first, count, src, dst)):
            ctypes.memmove(int(d), int(s), int(n))
        self._device.pair_copies += 1
        return _Copy(self._device, self._device.memory.copy_polls)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._device.allocated -= self.nbytes


class FakeDevice:
    def __init__(self, memory: FakeDeviceMemory, ordinal: int, uuid: bytes) -> None:
        self.memory = memory
        self.ordinal = ordinal
        self.uuid = uuid
        self.imported = 0
        self.allocated = 0
        self.in_flight = 0
        self.gathers = 0
        self.pair_copies = 0
        self._owned: dict[int, ctypes.Array] = {}

    def import_ipc(self, handle: bytes) -> _Buffer:
        target = self.memory.exported.get(handle)
        if target is None:
            raise DeviceError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)")
        address, size = target
        self.imported += size

        def closed() -> None:
            self.imported -= size

        return _Buffer(address, size, closed)

    def import_event(self, handle: bytes) -> _OpenedEvent:
        event = self.memory.events.get(handle)
        if event is None:
            raise DeviceError("cuIpcOpenEventHandle failed: CUDA_ERROR_INVALID_VALUE (1)")
        return _OpenedEvent(event)

    def allocate(self, nbytes: int) -> _Buffer:
        if self.memory.fail_allocations:
            raise DeviceError(f"cuMemAlloc of {nbytes} bytes failed: CUDA_ERROR_OUT_OF_MEMORY (2)")
        raw = (ctypes.c_uint8 * nbytes)()
        address = ctypes.addressof(raw)
        self._owned[address] = raw
        self.allocated += nbytes

        def freed() -> None:
            del self._owned[address]
            self.allocated -= nbytes

        return _Buffer(address, nbytes, freed)

    def copier(self, plan: CopyPlan) -> _Copier:
        return _Copier(self, plan)

    def pair_copier(self, plan: CopyPlan) -> _PairCopier:
        return _PairCopier(self, plan)

    def read(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def synchronize(self) -> None:
        pass


class FakeDeviceMemory:
    name = "fake"

    def __init__(self, copy_polls: int = 1) -> None:
        self.copy_polls = copy_polls
        self.hold_copies = False
        self.fault_copies = False  # the next completion query of each copy reports a device fault
        self.fail_launches = False  # a pair copy's launch fails, nothing copied
        self.fail_allocations = False
        self.exported: dict[bytes, tuple[int, int]] = {}
        self.events: dict[bytes, FakeEvent] = {}
        self._devices: dict[bytes, FakeDevice] = {}

    def add_device(self, uuid: bytes) -> FakeDevice:
        dev = self._devices[uuid] = FakeDevice(self, len(self._devices), uuid)
        return dev

    @property
    def copies_in_flight(self) -> int:
        return sum(d.in_flight for d in self._devices.values())

    def export(self, address: int, size: int) -> bytes:
        handle = hashlib.sha512(f"{address}:{size}".encode()).digest()
        self.exported[handle] = (address, size)
        return handle

    def export_event(self) -> tuple[FakeEvent, bytes]:
        """A worker's interprocess event and its 64-byte handle."""
        event = FakeEvent()
        handle = hashlib.sha512(f"event:{id(event)}".encode()).digest()
        self.events[handle] = event
        return event, handle

    def device(self, uuid: bytes) -> FakeDevice:
        dev = self._devices.get(uuid)
        if dev is None:
            raise DeviceError("no visible CUDA device has this UUID")
        return dev

    def usage(self) -> dict[str, int]:
        return {"imported": sum(d.imported for d in self._devices.values()),
                "allocated": sum(d.allocated for d in self._devices.values())}

    def close(self) -> None:
        pass
