"""The few CUDA driver calls the GPU path needs, through ctypes (no build step, no
dependency): export and import of IPC handles, owned allocations, pointer queries, and for
the landing copy a stream, events, host copies and one kernel module (``kernel.py``).

Used on both sides: the connector exports the worker's KV allocations
(``export_allocation``) in the engine process, where torch made the device's primary
context current; the daemon imports them and allocates its landing buffers, with the
primary context of the device made current by ``Driver.use``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

from pushsvc.errors import DeviceError

IPC_HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 1
_ATTR_DEVICE_ORDINAL = 9
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_MEMORY_TYPE = 2
_MEMORYTYPE_DEVICE = 2
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_EVENT_INTERPROCESS = 4
_ERROR_NOT_READY = 600


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


_CU = ctypes.c_int  # CUresult
_PTR = ctypes.c_uint64  # CUdeviceptr


def _load() -> ctypes.CDLL:
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda") or ""):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise DeviceError("the CUDA driver (libcuda.so.1) is not installed on this host")


@dataclass(frozen=True, slots=True)
class Export:
    """One exported allocation: its handle, its range, the offset of the pointer asked for."""

    handle: bytes
    base: int
    size: int


class Driver:
    def __init__(self) -> None:
        lib = self._lib = _load()
        sig = {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorName": [_CU, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDeviceGetUuid_v2": [ctypes.POINTER(_Uuid), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
            "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, _PTR],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(_PTR), ctypes.POINTER(ctypes.c_size_t), _PTR],
            "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), _PTR],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(_PTR), _IpcHandle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [_PTR],
            "cuIpcGetEventHandle": [ctypes.POINTER(_IpcHandle), ctypes.c_void_p],
            "cuIpcOpenEventHandle": [ctypes.POINTER(ctypes.c_void_p), _IpcHandle],
            "cuMemAlloc_v2": [ctypes.POINTER(_PTR), ctypes.c_size_t],
            "cuMemFree_v2": [_PTR],
            "cuMemAllocAsync": [ctypes.POINTER(_PTR), ctypes.c_size_t, ctypes.c_void_p],
            "cuMemFreeAsync": [_PTR, ctypes.c_void_p],
            "cuMemsetD8_v2": [_PTR, ctypes.c_ubyte, ctypes.c_size_t],
            "cuMemGetInfo_v2": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
            "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint],
            "cuMemFreeHost": [ctypes.c_void_p],
            "cuMemcpyHtoD_v2": [_PTR, ctypes.c_void_p, ctypes.c_size_t],
            "cuMemcpyDtoH_v2": [ctypes.c_void_p, _PTR, ctypes.c_size_t],
            "cuMemcpyHtoDAsync_v2": [_PTR, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
            "cuStreamCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
            "cuStreamDestroy_v2": [ctypes.c_void_p],
            "cuStreamSynchronize": [ctypes.c_void_p],
            "cuEventCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
            "cuEventRecord": [ctypes.c_void_p, ctypes.c_void_p],
            "cuEventQuery": [ctypes.c_void_p],
            "cuEventSynchronize": [ctypes.c_void_p],
            "cuEventDestroy_v2": [ctypes.c_void_p],
            "cuModuleLoadData": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p],
            "cuModuleUnload": [ctypes.c_void_p],
            "cuModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p],
            "cuLaunchKernel": [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p],
        }
        for name, args in sig.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = _CU
        self._check(lib.cuInit(0), "cuInit")

    def _check(self, result: int, what: str) -> None:
        if result:
            name = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(name))
            raise DeviceError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({result})")

    # ------------------------------------------------------------------ devices

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def find_device(self, uuid: bytes) -> int:
        for ordinal in range(self.device_count()):
            if self.device_uuid(ordinal) == uuid:
                return ordinal
        raise DeviceError(f"no visible CUDA device has UUID {format_uuid(uuid)} (check CUDA_VISIBLE_DEVICES "
                          "of the daemon: it must see the worker's GPU)")

    def device_uuid(self, ordinal: int) -> bytes:
        dev, uuid = ctypes.c_int(), _Uuid()
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        self._check(self._lib.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev.value), "cuDeviceGetUuid")
        return ctypes.string_at(ctypes.addressof(uuid), 16)

    def retain_context(self, ordinal: int) -> int:
        ctx = ctypes.c_void_p()
        self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain")
        return ctx.value or 0

    def release_context(self, ordinal: int) -> None:
        self._check(self._lib.cuDevicePrimaryCtxRelease_v2(ordinal), "cuDevicePrimaryCtxRelease")

    def use(self, ctx: int) -> None:
        """Make ``ctx`` current on this thread (driver calls act on the current context)."""
        self._check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self._lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    # ------------------------------------------------------------------ pointers

    def _attribute(self, ptr: int, attr: int) -> int:
        value = ctypes.c_int()
        self._check(self._lib.cuPointerGetAttribute(ctypes.byref(value), attr, ptr), "cuPointerGetAttribute")
        return value.value

    def pointer_device(self, ptr: int) -> int:
        if self._attribute(ptr, _ATTR_MEMORY_TYPE) != _MEMORYTYPE_DEVICE:
            raise DeviceError(f"pointer {ptr:#x} is not device memory")
        return self._attribute(ptr, _ATTR_DEVICE_ORDINAL)

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = _PTR(), ctypes.c_size_t()
        self._check(self._lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                    "cuMemGetAddressRange")
        return base.value, size.value

    # ------------------------------------------------------------------ IPC

    def export_allocation(self, ptr: int) -> Export:
        """The IPC handle of the allocation holding ``ptr``. Refuses memory that cannot be
        exported this way: CUDA VMM (e.g. torch's ``expandable_segments``) and memory this
        process mapped from another one."""
        if not self._attribute(ptr, _ATTR_IS_LEGACY_CUDA_IPC_CAPABLE):
            raise DeviceError("KV cache memory cannot be shared by CUDA IPC handle: it is not a cudaMalloc "
                              "allocation of this process (a CUDA VMM allocation: unset expandable_segments in "
                              "PYTORCH_CUDA_ALLOC_CONF for the engine; or memory mapped from another process)")
        base, size = self.address_range(ptr)
        handle = _IpcHandle()
        self._check(self._lib.cuIpcGetMemHandle(ctypes.byref(handle), base), "cuIpcGetMemHandle")
        return Export(ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES), base, size)

    def ipc_open(self, handle: bytes) -> tuple[int, int]:
        """Map another process's allocation; returns (address, size of the mapping)."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise DeviceError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        raw = _IpcHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
        ptr = _PTR()
        self._check(self._lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), raw, _LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        try:
            base, size = self.address_range(ptr.value)
        except DeviceError:
            self._lib.cuIpcCloseMemHandle(ptr.value)
            raise
        return base, size

    def ipc_close(self, ptr: int) -> None:
        self._check(self._lib.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")

    # ------------------------------------------------------------------ owned memory

    def alloc(self, nbytes: int) -> int:
        ptr = _PTR()
        self._check(self._lib.cuMemAlloc_v2(ctypes.byref(ptr), nbytes), f"cuMemAlloc of {nbytes} bytes")
        return ptr.value

    def free(self, ptr: int) -> None:
        self._check(self._lib.cuMemFree_v2(ptr), "cuMemFree")

    def alloc_async(self, nbytes: int, stream: int) -> int:
        """Device memory in ``stream``'s order (from the device's pool: no synchronization)."""
        ptr = _PTR()
        self._check(self._lib.cuMemAllocAsync(ctypes.byref(ptr), nbytes, stream), f"cuMemAllocAsync of {nbytes} bytes")
        return ptr.value

    def free_async(self, ptr: int, stream: int) -> None:
        """Give ``ptr`` back once the work queued on ``stream`` before this call is done."""
        self._check(self._lib.cuMemFreeAsync(ptr, stream), "cuMemFreeAsync")

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check(self._lib.cuMemsetD8_v2(ptr, value, nbytes), "cuMemsetD8")

    def host_alloc(self, nbytes: int) -> int:
        """Page-locked host memory (the source of asynchronous uploads)."""
        ptr = ctypes.c_void_p()
        self._check(self._lib.cuMemHostAlloc(ctypes.byref(ptr), nbytes, 0), f"cuMemHostAlloc of {nbytes} bytes")
        return ptr.value or 0

    def host_free(self, ptr: int) -> None:
        self._check(self._lib.cuMemFreeHost(ptr), "cuMemFreeHost")

    def upload(self, dst: int, src: int, nbytes: int) -> None:
        self._check(self._lib.cuMemcpyHtoD_v2(dst, src, nbytes), "cuMemcpyHtoD")

    def upload_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def download(self, dst: int, src: int, nbytes: int) -> None:
        self._check(self._lib.cuMemcpyDtoH_v2(dst, src, nbytes), "cuMemcpyDtoH")

    # ------------------------------------------------------------------ streams, events, kernels

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._check(self._lib.cuStreamCreate(ctypes.byref(s), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return s.value or 0

    def stream_destroy(self, stream: int) -> None:
        self._check(self._lib.cuStreamDestroy_v2(stream), "cuStreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self._lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def event(self) -> int:
        e = ctypes.c_void_p()
        self._check(self._lib.cuEventCreate(ctypes.byref(e), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return e.value or 0

    def ipc_event(self) -> tuple[int, bytes]:
        """An event another process can open (interprocess, no timing), and its handle."""
        e = ctypes.c_void_p()
        self._check(self._lib.cuEventCreate(ctypes.byref(e), _EVENT_DISABLE_TIMING | _EVENT_INTERPROCESS),
                    "cuEventCreate")
        handle = _IpcHandle()
        try:
            self._check(self._lib.cuIpcGetEventHandle(ctypes.byref(handle), e.value), "cuIpcGetEventHandle")
        except DeviceError:
            self._lib.cuEventDestroy_v2(e.value)
            raise
        return e.value or 0, ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)

    def ipc_open_event(self, handle: bytes) -> int:
        """Open another process's interprocess event from its handle."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise DeviceError(f"an IPC event handle has {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        raw = _IpcHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, IPC_HANDLE_BYTES)
        e = ctypes.c_void_p()
        self._check(self._lib.cuIpcOpenEventHandle(ctypes.byref(e), raw), "cuIpcOpenEventHandle")
        return e.value or 0

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._lib.cuEventRecord(event, stream), "cuEventRecord")

    def event_done(self, event: int) -> bool:
        """Whether the work before ``event`` finished (never blocks)."""
        result = self._lib.cuEventQuery(event)
        if result == _ERROR_NOT_READY:
            return False
        self._check(result, "cuEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._check(self._lib.cuEventSynchronize(event), "cuEventSynchronize")

    def event_destroy(self, event: int) -> None:
        self._check(self._lib.cuEventDestroy_v2(event), "cuEventDestroy")

    def load_module(self, image: str) -> int:
        module = ctypes.c_void_p()
        self._check(self._lib.cuModuleLoadData(ctypes.byref(module), image.encode() + b"\0"), "cuModuleLoadData")
        return module.value or 0

    def unload_module(self, module: int) -> None:
        self._check(self._lib.cuModuleUnload(module), "cuModuleUnload")

    def function(self, module: int, name: str) -> int:
        fn = ctypes.c_void_p()
        self._check(self._lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "cuModuleGetFunction")
        return fn.value or 0

    def launch(self, fn: int, grid: tuple[int, int, int], threads: int, stream: int,
               args: ctypes.Array) -> None:
        """Launch ``fn``; ``args`` holds a pointer to each parameter's value, in order."""
        self._check(self._lib.cuLaunchKernel(fn, *grid, threads, 1, 1, 0, stream, args, None), "cuLaunchKernel")


def format_uuid(uuid: bytes) -> str:
    h = uuid.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
