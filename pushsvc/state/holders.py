"""Which tracked registration holds each of a worker's blocks (D's side).

A block belongs to at most one live registration, so the daemon can refuse a second one
naming a block P may still write into (``ConsumerTable.holder``). The index is per KV
group an array over the block ids, each cell the holding registration's token (0: free),
so that taking, checking and giving back a request's blocks are array operations, not a
Python step per block: a request of 4096 blocks is given back in tens of microseconds,
where a dict of (group, block) keys took about a millisecond, on the path between P's
completion and D's ``RecvDone``.

Pure state. The block ids reaching it were checked against the rank's layout
(``state/layout.check_block_ids``): in range and none twice; the index still never
indexes outside its arrays (a negative or too large id is simply not held).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

# The largest block id the index grows to (a KV cache of more blocks than this per group
# is beyond any GPU's memory): a bad id fails loudly instead of allocating without bound.
MAX_BLOCK_ID = 1 << 28


def _ids(ids: Sequence[int]) -> np.ndarray:
    return np.fromiter(ids, dtype=np.int64, count=len(ids))


class BlockHolders:
    def __init__(self) -> None:
        self._cells: list[np.ndarray] = []  # per group: the holder's token per block id, 0 free
        self._held: dict[str, tuple[int, list[np.ndarray]]] = {}  # request id -> token, its ids per group
        self._names: dict[int, str] = {}  # token -> request id
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        """How many registrations hold blocks."""
        return len(self._held)

    def hold(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """``request_id`` holds every block of ``block_ids`` no other registration holds
        (one that is held stays with its holder). ``request_id`` must not hold any yet."""
        if request_id in self._held:
            raise ValueError(f"{request_id} holds blocks already")
        arrays = [_ids(ids) for ids in block_ids]
        for g, ids in enumerate(arrays):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > MAX_BLOCK_ID):
                raise ValueError(f"group {g}: block id outside 0..{MAX_BLOCK_ID}")
        token = next(self._tokens)
        for g, ids in enumerate(arrays):
            if not len(ids):
                continue
            cells = self._group(g, int(ids.max()) + 1)
            free = ids[cells[ids] == 0]
            cells[free] = token
        self._held[request_id] = (token, arrays)
        self._names[token] = request_id

    def release(self, request_id: str) -> None:
        """``request_id``'s blocks are free again (those it held; none if it holds none)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        token, arrays = held
        del self._names[token]
        for g, ids in enumerate(arrays):
            if len(ids):
                cells = self._cells[g]
                cells[ids[cells[ids] == token]] = 0

    def holder(self, block_ids: Sequence[Sequence[int]]) -> tuple[int, str] | None:
        """The first block of ``block_ids`` (group by group, in their order) that a
        registration holds, and that registration; ``None`` if none is held."""
        for g, ids in enumerate(block_ids):
            if g >= len(self._cells) or not len(ids):
                continue
            cells = self._cells[g]
            wanted = _ids(ids)
            wanted = wanted[(wanted >= 0) & (wanted < len(cells))]
            tokens = cells[wanted]
            found = np.flatnonzero(tokens)
            if len(found):
                first = int(found[0])
                return int(wanted[first]), self._names[int(tokens[first])]
        return None

    def cells(self) -> dict[tuple[int, int], str]:
        """Every held block as (group, block) -> request id (for checks and debugging)."""
        out: dict[tuple[int, int], str] = {}
        for g, cells in enumerate(self._cells):
            for b in np.flatnonzero(cells).tolist():
                out[(g, b)] = self._names[int(cells[b])]
        return out

    def _group(self, g: int, size: int) -> np.ndarray:
        """Group ``g``'s cells, grown to at least ``size`` blocks."""
        while len(self._cells) <= g:
            self._cells.append(np.zeros(0, dtype=np.int64))
        cells = self._cells[g]
        if len(cells) < size:
            grown = np.zeros(max(size, min(2 * len(cells), MAX_BLOCK_ID + 1), 1024), dtype=np.int64)
            grown[:len(cells)] = cells
            self._cells[g] = cells = grown
        return cells
