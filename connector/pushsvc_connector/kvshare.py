"""Share vLLM's CPU KV-cache tensors with the daemon, in place, without copying per
request.

Each distinct storage behind the layer tensors is re-backed by a memfd
(``pushsvc.shm.rebind_pages``: the page range is copied once into the memfd, which is
then mapped over the same addresses), so the tensors keep working and the daemon maps
the very same pages. Called once, from ``register_kv_caches``, before any forward pass.
"""

from __future__ import annotations

import math

import torch

from pushsvc.protocol.worker import Region
from pushsvc.shm import PAGE, SharedBuffer, rebind_pages


def _regions_of(name: str, t: torch.Tensor, buffer: int, offset: int, num_blocks: int) -> list[Region]:
    """Regions of one layer tensor. Blocks are either the outermost dimension
    (vLLM's CPU layout: [blocks, kv_heads, block_size, 2 * head_size]) or the second
    one with K and V stacked first ([2, blocks, ...]): then K and V are two regions."""
    elem = t.element_size()
    if t.shape[0] == num_blocks:
        block_len = math.prod(t.shape[1:]) * elem
        if t.stride(0) * elem < block_len or not t[0].is_contiguous():
            raise ValueError(f"{name}: blocks are not contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
        return [Region(buffer=buffer, offset=offset, block_len=block_len, num_blocks=num_blocks,
                       block_stride=t.stride(0) * elem, layer_names=[name])]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [r for half in (0, 1) for r in _regions_of(
            name, t[half], buffer, offset + half * t.stride(0) * elem, num_blocks)]
    raise ValueError(f"{name}: no block dimension of size {num_blocks} in shape {tuple(t.shape)}")


def share_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> tuple[list[SharedBuffer], list[Region]]:
    """Re-back every storage behind ``kv_caches`` by a memfd; describe the layers."""
    buffers: list[SharedBuffer] = []
    starts: dict[int, tuple[int, int]] = {}  # storage ptr -> (buffer index, mapped start)
    regions: list[Region] = []
    try:
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ValueError(f"{name}: KV cache on {t.device}; GPU caches use a daemon-owned arena")
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in starts:
                start = ptr - ptr % PAGE
                end = -(-(ptr + storage.nbytes()) // PAGE) * PAGE
                for b in buffers:
                    if start < b.address + b.size and b.address < end:
                        # Re-mapping a shared page would hide it from the first memfd.
                        raise ValueError(f"{name}: storage shares a page with another KV storage")
                buffers.append(rebind_pages(start, end - start, name=f"pushsvc-kv-{len(buffers)}"))
                starts[ptr] = (len(buffers) - 1, start)
            index, start = starts[ptr]
            regions += _regions_of(name, t, index, t.data_ptr() - start, num_blocks)
    except BaseException:
        for b in buffers:
            b.close()
        raise
    return buffers, regions
