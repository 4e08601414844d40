"""Share vLLM's CUDA KV-cache tensors with the daemon by CUDA IPC handle (docs/gpu.md).

Each distinct CUDA allocation behind the layer tensors is exported once with
``cuIpcGetMemHandle`` (a driver call: no kernel, no copy, no thread); the daemon opens the
handles itself. Allocations from torch's ``expandable_segments`` (CUDA VMM) cannot be
exported so and are refused with a message that says what to change.

For layer-wise push, ``LayerEvents`` are interprocess events the worker records on vLLM's
compute stream after each layer (driver calls too: an event record is no kernel); the
daemon opens them by handle and posts a layer's WRITE once its event says the layer's
kernels ran.
"""

from __future__ import annotations

import torch

from pushsvc.devmem.driver import Driver
from pushsvc.errors import DeviceError
from pushsvc.protocol import worker as wp
from pushsvc_connector.kvlayout import regions_of


def share_cuda_kv(kv_caches: dict[str, torch.Tensor], num_blocks: int,
                  driver: Driver | None = None,
                  heads: dict[str, int] | None = None,
                  replicated: frozenset[str] = frozenset()) -> tuple[wp.CudaIpcBuffers, list[wp.Region]]:
    driver = driver or Driver()
    buffers: list[wp.CudaIpcBuffer] = []
    index: dict[int, int] = {}  # allocation base -> buffer index
    regions: list[wp.Region] = []
    uuid = b""
    for name, t in kv_caches.items():
        if t.device.type != "cuda":
            raise ValueError(f"{name}: KV cache on {t.device}, the others on CUDA")
        ptr = t.data_ptr()
        try:
            export = driver.export_allocation(ptr)
            device_uuid = driver.device_uuid(driver.pointer_device(ptr))
        except DeviceError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if uuid and device_uuid != uuid:
            raise ValueError(f"{name}: KV caches of one worker on two devices")
        uuid = device_uuid
        if export.base not in index:
            index[export.base] = len(buffers)
            buffers.append(wp.CudaIpcBuffer(handle=export.handle, size=export.size))
        regions += regions_of(name, t, index[export.base], ptr - export.base, num_blocks, (heads or {}).get(name, 0),
                              name in replicated)
    return wp.CudaIpcBuffers(device_uuid=uuid, buffers=buffers), regions


class LayerEvents:
    """``count`` interprocess events of the current device (one per layer and one for the
    forward pass's end) and their IPC handles."""

    def __init__(self, count: int, driver: Driver | None = None) -> None:
        self._driver = driver or Driver()
        self._events: list[int] = []
        self.handles: list[bytes] = []
        try:
            for _ in range(count):
                event, handle = self._driver.ipc_event()
                self._events.append(event)
                self.handles.append(handle)
        except DeviceError as exc:
            self.close()
            raise ValueError(f"layer-wise push: cannot create the layer events: {exc}") from None

    def record(self, index: int, stream: int) -> None:
        """Mark the end of the work queued on ``stream`` so far as event ``index``'s."""
        self._driver.event_record(self._events[index], stream)

    def close(self) -> None:
        for event in self._events:
            self._driver.event_destroy(event)
        self._events.clear()
