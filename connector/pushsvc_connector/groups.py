"""Which of vLLM's KV-cache groups a transfer carries, and which blocks of each (pure).

With vLLM's hybrid KV-cache manager (HMA) a model with sliding-window and full-attention
layers has several KV-cache groups, one block list per group per request, all drawn from
one block pool. A transfer carries the groups vLLM marks transferable
(``KVCacheConfig.transfer_group_ids``), in that order: the daemon's group ``i`` is the
``i``-th of them, and each region the worker registers names the group of its layer.

A sliding-window group needs only the blocks its window still reads: vLLM replaces the
blocks before the window by its null block (block id 0, never handed to a request) and,
on D, allocates no real block there at all. ``clip`` keeps the last ``keep`` blocks of
such a group (the window's blocks plus one for a window that straddles a block edge, as
vLLM's own connectors do) and drops leading null blocks, on both sides, so P's and D's
lists stay aligned at their tails (the daemon pairs P's last blocks with D's).

With a sliding-window group, P leaves the prompt's last token to D (``backoff``): D
recomputes that token after the load, and its window reaches one token further back
than the window of the token after it. vLLM frees a group's blocks by the tokens each
side computed, so were P to compute the whole prompt it would free (and never send) a
block D's recomputed token reads whenever the prompt's length is one short of a
multiple of the block size (measured: a 255-token prompt, 128-token blocks and window,
gave another first token). So P stops one token short and D loads one token fewer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0  # vLLM's null block: the block pool's first block, a placeholder


@dataclass(frozen=True)
class TransferGroups:
    group_ids: tuple[int, ...] = (0,)  # vLLM's index of each transferred group, in order
    keep: tuple[int, ...] = (0,)  # per transferred group: trailing blocks kept; 0 = every block
    layer_group: Mapping[str, int] = field(default_factory=dict)  # layer -> transferred group; empty: all in 0

    def __post_init__(self) -> None:
        if len(self.group_ids) != len(self.keep) or not self.group_ids:
            raise ValueError(f"{len(self.group_ids)} transfer groups, {len(self.keep)} keep counts")

    @property
    def hybrid(self) -> bool:
        return len(self.group_ids) > 1 or any(self.keep)

    @property
    def backoff(self) -> int:
        """Trailing prompt tokens P does not compute and D computes itself."""
        return 1 if any(self.keep) else 0

    def clip(self, block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The blocks a transfer carries, one list per transferred group, from vLLM's
        lists of every group (or the one list of a single group)."""
        if not block_ids:  # no blocks at all (a full prefix hit, an empty request)
            return [[] for _ in self.group_ids]
        if len(block_ids) == len(self.group_ids) and self.group_ids == tuple(range(len(block_ids))):
            chosen = block_ids
        else:
            if len(block_ids) <= max(self.group_ids):
                raise ValueError(f"{len(block_ids)} block lists, the transfer groups name vLLM group "
                                 f"{max(self.group_ids)}")
            chosen = [block_ids[g] for g in self.group_ids]
        out = []
        for ids, keep in zip(chosen, self.keep):
            ids = list(ids[-keep:] if keep else ids)
            first = next((i for i, b in enumerate(ids) if b != NULL_BLOCK), len(ids))
            out.append(ids[first:])
        return out

    def group_of(self, layer: str) -> int | None:
        """The transferred group of ``layer``; None if no transferred group holds it."""
        if not self.layer_group:
            return 0
        return self.layer_group.get(layer)
