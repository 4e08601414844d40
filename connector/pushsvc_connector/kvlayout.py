"""How vLLM's KV tensors map onto the daemon's regions (no vLLM, no device specifics).

A layer's KV tensor has its blocks either in the outermost dimension (CPU, FlashInfer
``[blocks, 2, block_size, heads, dim]``, MLA ``[blocks, block_size, dim]``, the
cross-layer layout's per-layer views) or in the second with K and V stacked first
(FlashAttention ``[2, blocks, block_size, heads, dim]``): then K and V are two regions.
A block must fill a dense byte range, whatever order its own dimensions are stored in
(vLLM permutes them for HND layouts); blocks may be further apart than their length.
A region says how many KV heads its blocks hold *outermost* (vLLM CPU's
``[blocks, heads, block_size, 2*head]``, HND on a GPU): such a block splits into one
contiguous byte range per head, which is what a P of higher TP writes into.
"""

from __future__ import annotations

import math

import torch

from pushsvc.protocol.worker import Region


def block_dim(t: torch.Tensor) -> int:
    """The size of the dimension a layer tensor's blocks run along."""
    return t.shape[1] if t.dim() >= 3 and t.shape[0] == 2 else t.shape[0]


def blocks_per_logical(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    """Physical kernel blocks per scheduler block (the kernel may split each one)."""
    first = next(iter(kv_caches.values()))
    dim = block_dim(first)
    return dim // num_blocks if dim % num_blocks == 0 else 1


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free range, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def head_major(block: torch.Tensor, heads: int) -> int:
    """``heads`` if a dense block of that many KV heads stores them outermost (head ``h``
    is the ``h``-th of ``heads`` equal byte ranges), else 0."""
    if heads <= 1:
        return 0
    n = block.numel()
    return heads if any(block.shape[d] == heads and block.stride(d) * heads == n for d in range(block.dim())) else 0


def regions_of(name: str, t: torch.Tensor, buffer: int, offset: int, num_blocks: int, heads: int = 0,
               replicated: bool = False) -> list[Region]:
    """Regions of one layer tensor whose first element is ``offset`` bytes into buffer
    ``buffer``; ``heads``: the layer's KV heads on this rank (0: unknown); ``replicated``:
    every TP rank holds the same bytes (MLA)."""
    elem = t.element_size()
    if t.shape[0] == num_blocks:
        block_len = math.prod(t.shape[1:]) * elem
        if t.stride(0) * elem < block_len or not _dense(t[0]):
            raise ValueError(f"{name}: blocks are not dense byte ranges (shape {tuple(t.shape)}, stride {t.stride()})")
        return [Region(buffer=buffer, offset=offset, block_len=block_len, num_blocks=num_blocks,
                       block_stride=t.stride(0) * elem, layer_names=[name], heads=head_major(t[0], heads),
                       replicated=replicated)]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [r for half in (0, 1) for r in regions_of(
            name, t[half], buffer, offset + half * t.stride(0) * elem, num_blocks, heads, replicated)]
    raise ValueError(f"{name}: no block dimension of size {num_blocks} in shape {tuple(t.shape)}")
