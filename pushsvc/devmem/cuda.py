"""The real device memory: CUDA driver calls (``driver.py``) for imports and owned
allocations, torch for the gather kernel, its stream and its events.

torch is imported when a ``CudaMemory`` is made (the daemon does that at start when the
GPU path is on), never by a CPU-only daemon. Every call runs on the event loop thread;
each device's primary context is made current before driver calls, and kernels go to one
copy stream per device, so a copy never waits behind the engine's work or ours.

The gather works on row views of raw device memory (``__cuda_array_interface__`` objects
that own nothing): landing rows and worker rows are computed on the device from the
slots, the blocks and the part's ``CopyRows``, then one kernel copies each row across
(``rowcopy.py``: a Triton kernel where Triton is installed, else torch's ``index_select``
and ``index_copy_``, which pass the bytes twice).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pushsvc.devmem.driver import Driver, format_uuid
from pushsvc.devmem.rowcopy import row_copier
from pushsvc.errors import DeviceError
from pushsvc.state.landing import CopyRows


class _Raw:
    """Device memory as an array interface, for ``torch.as_tensor`` (no copy, no owner)."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape, "typestr": typestr,
                                         "strides": None, "version": 2}


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
    __slots__ = ("event", "_done")

    def __init__(self, event: Any) -> None:
        self.event = event
        self._done = False

    def done(self) -> bool:
        if not self._done:
            self._done = bool(self.event.query())
        return self._done

    def wait(self) -> None:
        self.event.synchronize()
        self._done = True


class CudaDevice:
    def __init__(self, torch: Any, driver: Driver, ordinal: int, uuid: bytes) -> None:
        self._torch = torch
        self._driver = driver
        self.ordinal = ordinal
        self.uuid = uuid
        self.torch_device = torch.device("cuda", ordinal)
        with torch.cuda.device(ordinal):
            torch.zeros(1, device=self.torch_device)  # create the primary context now
            self.stream = torch.cuda.Stream(device=self.torch_device)
            # Compiled (and checked) now, not inside the first copy.
            self.copy_rows = row_copier(torch, self.torch_device)
        self._ctx = driver.retain_context(ordinal)
        self.imported = 0  # bytes mapped from other processes
        self.allocated = 0  # bytes owned

    def _current(self) -> None:
        self._driver.use(self._ctx)

    def import_ipc(self, handle: bytes) -> _Mapping:
        self._current()
        address, size = self._driver.ipc_open(handle)
        self.imported += size

        def close(addr: int) -> None:
            self._current()
            self._driver.ipc_close(addr)
            self.imported -= size

        return _Mapping(address, size, close)

    def allocate(self, nbytes: int) -> _Mapping:
        self._current()
        address = self._driver.alloc(nbytes)
        self.allocated += nbytes
        try:
            self._driver.memset(address, 0, nbytes)
        except DeviceError:
            self._driver.free(address)
            self.allocated -= nbytes
            raise

        def close(addr: int) -> None:
            self._current()
            self._driver.free(addr)
            self.allocated -= nbytes

        return _Mapping(address, nbytes, close)

    def row_space(self, origin: int, nbytes: int, unit: int) -> Any:
        if unit % 8 == 0:
            raw = _Raw(origin, (nbytes // unit, unit // 8), "<i8")
        else:
            raw = _Raw(origin, (nbytes // unit, unit), "|u1")
        with self._torch.cuda.device(self.ordinal):
            return self._torch.as_tensor(raw, device=self.torch_device)

    def upload_rows(self, rows: CopyRows) -> Any:
        torch = self._torch
        with torch.cuda.device(self.ordinal):
            return tuple(torch.from_numpy(a).to(self.torch_device)
                         for a in (rows.src_offsets, rows.src_strides, rows.dst_offsets, rows.dst_strides))

    def gather(self, dst: Any, rows: Any, blocks: np.ndarray, src: Any, slots: np.ndarray) -> _Copy:
        torch = self._torch
        src_offsets, src_strides, dst_offsets, dst_strides = rows
        with torch.cuda.device(self.ordinal), torch.cuda.stream(self.stream):
            pairs = torch.from_numpy(np.stack([np.asarray(slots, dtype=np.int64), np.asarray(blocks, dtype=np.int64)]))
            pairs = pairs.to(self.torch_device, non_blocking=True)
            src_rows = (pairs[0, :, None] * src_strides[None, :] + src_offsets[None, :]).reshape(-1)
            dst_rows = (pairs[1, :, None] * dst_strides[None, :] + dst_offsets[None, :]).reshape(-1)
            self.copy_rows(src, src_rows, dst, dst_rows)
            event = torch.cuda.Event()
            event.record(self.stream)
        return _Copy(event)

    def read_rows(self, space: Any, rows: np.ndarray) -> np.ndarray:
        torch = self._torch
        with torch.cuda.device(self.ordinal), torch.cuda.stream(self.stream):
            index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.torch_device)
            host = space.index_select(0, index).cpu()
        return host.numpy().view(np.uint8).reshape(-1)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        try:
            self.stream.synchronize()
        finally:
            self._driver.release_context(self.ordinal)

    def __repr__(self) -> str:
        return (f"<CudaDevice {self.ordinal} {format_uuid(self.uuid)} imported={self.imported} "
                f"allocated={self.allocated}>")


class CudaMemory:
    name = "cuda"

    def __init__(self) -> None:
        try:
            import torch
        except ImportError as exc:
            raise DeviceError(f"the GPU path needs torch with CUDA: {exc}") from None
        if not torch.cuda.is_available():
            raise DeviceError("torch sees no CUDA device (a CPU build of torch, or no GPU visible)")
        self._torch = torch
        self._driver = Driver()
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
            dev = self._devices[uuid] = CudaDevice(self._torch, self._driver, ordinal, uuid)
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
