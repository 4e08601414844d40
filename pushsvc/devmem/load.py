"""Which device memory a daemon gets, from its ``gpu`` setting (docs/gpu.md)."""

from __future__ import annotations

import os

import structlog

from pushsvc.devmem.base import DeviceMemory
from pushsvc.errors import ConfigError, DeviceError

log = structlog.get_logger("pushsvc.devmem")


def load_device_memory(mode: str) -> DeviceMemory | None:
    """``"off"``: none. ``"auto"``: CUDA where the host has a CUDA driver and a visible GPU,
    else none (said once in the log). ``"on"``: CUDA, or a ``ConfigError`` saying why not."""
    if mode == "off":
        return None
    from pushsvc.devmem.cuda import CudaMemory

    try:
        memory = CudaMemory()
    except DeviceError as exc:
        if mode == "on":
            raise ConfigError("gpu", f"\"on\", but the GPU path is unavailable: {exc}") from None
        log.info("gpu_path_off", reason=str(exc))
        return None
    # UCX's memory-type cache knows only allocations it saw being made: the workers' KV,
    # which this process imported over CUDA IPC, would be taken for host memory and NIXL
    # refuses to register it as VRAM ("VRAM memory is detected as host by UCX"). Without
    # the cache UCX asks the driver. Read by UCX when each agent is made, after this.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    # UCX's cuda_ipc transport keeps every peer allocation it mapped (D's landing buffer,
    # which P's WRITEs go into) until this process exits, even after the peer is gone
    # (openucx/ucx#11753): each restart of a D daemon would pin its old landing buffer on
    # the GPU for as long as P's daemon lives. Without the cache UCX unmaps after use.
    os.environ.setdefault("UCX_CUDA_IPC_CACHE", "n")
    log.info("gpu_path_on", memory=memory.name, ucx_memtype_cache=os.environ["UCX_MEMTYPE_CACHE"],
             ucx_cuda_ipc_cache=os.environ["UCX_CUDA_IPC_CACHE"])
    return memory
