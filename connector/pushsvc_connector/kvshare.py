"""Share vLLM's KV-cache tensors with the daemon, in place, without copying per request.

``share_kv`` looks at where the tensors live:

* CPU: each distinct storage behind the layer tensors is re-backed by a memfd
  (``pushsvc.shm.rebind_pages``: the page range is copied once into the memfd, which is
  then mapped over the same addresses), so the tensors keep working and the daemon maps
  the very same pages.
* CUDA: each allocation is exported by IPC handle (``cudashare.py``); the daemon opens it.

Called once, from ``register_kv_caches``, before any forward pass. The ``KVShare`` is kept
for the worker's lifetime: a reconnecting worker registers the same memory again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from pushsvc.protocol import worker as wp
from pushsvc.shm import PAGE, SharedBuffer, rebind_pages
from pushsvc_connector.groups import TransferGroups
from pushsvc_connector.kvlayout import blocks_per_logical, regions_of


@dataclass
class KVShare:
    regions: list[wp.Region]
    blocks_per_logical: int = 1
    buffers: list[SharedBuffer] = field(default_factory=list)  # CPU: the memfds, sent with the registration
    cuda: wp.CudaIpcBuffers | None = None  # CUDA: the exported allocations

    @property
    def fds(self) -> list[int]:
        return [b.fd for b in self.buffers]

    @property
    def kind(self) -> str:
        return "cuda" if self.cuda is not None else "memfd"

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers = []


def share_kv(kv_caches: dict[str, torch.Tensor], num_blocks: int, groups: TransferGroups | None = None,
             heads: dict[str, int] | None = None, replicated: frozenset[str] = frozenset()) -> KVShare:
    """Share ``kv_caches`` (``num_blocks`` scheduler blocks each) with the daemon; each
    region names its layer's transferred KV-cache group (``groups``; default: one group),
    where its blocks are head-major its KV heads (``heads``: layer -> heads), and whether
    every TP rank holds the same bytes (``replicated``: MLA's layers)."""
    per_logical = blocks_per_logical(kv_caches, num_blocks)
    if next(iter(kv_caches.values())).device.type == "cuda":
        from pushsvc_connector.cudashare import share_cuda_kv

        cuda, regions = share_cuda_kv(kv_caches, num_blocks * per_logical, heads=heads, replicated=replicated)
        return KVShare(grouped(regions, groups), per_logical, cuda=cuda)
    buffers, regions = share_kv_caches(kv_caches, num_blocks * per_logical, heads, replicated)
    return KVShare(grouped(regions, groups), per_logical, buffers=buffers)


def grouped(regions: list[wp.Region], groups: TransferGroups | None) -> list[wp.Region]:
    """``regions`` with the transferred group of their layer; a layer no transferred group
    holds is not registered (nothing is ever written into it or read from it)."""
    if groups is None or not groups.layer_group:
        return regions
    out = []
    for r in regions:
        g = groups.group_of(r.layer_names[0]) if r.layer_names else None
        if g is not None:
            out.append(msgspec.structs.replace(r, group=g))
    if not out:
        raise ValueError("no KV layer belongs to a transferred KV-cache group")
    return out


def share_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int,
                    heads: dict[str, int] | None = None,
                    replicated: frozenset[str] = frozenset()) -> tuple[list[SharedBuffer], list[wp.Region]]:
    """Re-back every storage behind CPU ``kv_caches`` by a memfd; describe the layers."""
    buffers: list[SharedBuffer] = []
    starts: dict[int, tuple[int, int]] = {}  # storage ptr -> (buffer index, mapped start)
    regions: list[wp.Region] = []
    try:
        for name, t in kv_caches.items():
            if t.device.type != "cpu":
                raise ValueError(f"{name}: KV cache on {t.device}, the others on the CPU")
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
            regions += regions_of(name, t, index, t.data_ptr() - start, num_blocks, (heads or {}).get(name, 0),
                                  name in replicated)
    except BaseException:
        for b in buffers:
            b.close()
        raise
    return buffers, regions
