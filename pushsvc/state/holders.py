"""Which tracked registration holds each of a worker's blocks (D's side).

A block belongs to at most one live registration, so the daemon can refuse a second one
naming a block P may still write into (``ConsumerTable.holder``). Giving a request's
blocks back lies on the path from P's completion to D's ``RecvDone``: a dict of (group,
block) keys, checked and deleted one by one, took ~1.1 ms there for a request of 4096
blocks on a GPU host. Here each KV group is an array over its block ids, each cell the
holding registration's token (0: free), and each registration remembers exactly the
blocks it took. A group of many ids is taken, checked and given back by array
operations (tens of microseconds for 4096); one of a few ids, the common small request,
by a step per id, which costs less than setting up the array calls.

Pure state. A block held by one registration is never taken by another, so the blocks a
registration took are still its own when it gives them back. The ids reaching it were
checked against the rank's layout (``state/layout.check_block_ids``); it still refuses
a negative or absurdly large one, and never indexes outside its arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Union

import numpy as np

# Beyond any GPU's KV cache: a bad id fails loudly instead of growing an array without bound.
MAX_BLOCK_ID = 1 << 28
# A group of at most this many ids goes by scalar steps, a larger one by array operations.
FEW = 64

Ids = Union[list, np.ndarray]  # a few ids as a list, many as an int64 array


class BlockHolders:
    def __init__(self) -> None:
        self._cells: list[np.ndarray] = []  # per group: the holder's token per block id, 0 free
        self._taken: dict[str, tuple[int, list[Ids]]] = {}  # request id -> token, the blocks it took
        self._names: dict[int, str] = {}  # token -> request id
        self._tokens = itertools.count(1)

    def __len__(self) -> int:
        """How many registrations hold blocks."""
        return len(self._taken)

    def hold(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> None:
        """``request_id`` holds every block of ``block_ids`` no other registration holds
        (one that is held stays with its holder). ``request_id`` must not hold any yet."""
        if request_id in self._taken:
            raise ValueError(f"{request_id} holds blocks already")
        groups: list[Ids] = [list(ids) if len(ids) <= FEW else np.fromiter(ids, np.int64, len(ids))
                             for ids in block_ids]
        tops = [_top(g, ids) for g, ids in enumerate(groups)]  # every group checked before any is taken
        token = next(self._tokens)
        taken: list[Ids] = []
        for g, ids in enumerate(groups):
            cells = self._group(g, tops[g] + 1)
            if isinstance(ids, list):
                mine: Ids = [b for b in dict.fromkeys(ids) if not cells[b]]
                for b in mine:
                    cells[b] = token
            else:
                mine = ids[cells[ids] == 0]
                cells[mine] = token
            taken.append(mine)
        self._taken[request_id] = (token, taken)
        self._names[token] = request_id

    def release(self, request_id: str) -> None:
        """``request_id``'s blocks are free again (those it took; none if it holds none)."""
        held = self._taken.pop(request_id, None)
        if held is None:
            return
        token, taken = held
        del self._names[token]
        for cells, mine in zip(self._cells, taken):
            if isinstance(mine, list):
                for b in mine:
                    cells[b] = 0
            else:
                cells[mine] = 0

    def holder(self, block_ids: Sequence[Sequence[int]]) -> tuple[int, str] | None:
        """The first block of ``block_ids`` (group by group, in their order) that a
        registration holds, and that registration; ``None`` if none is held."""
        for cells, ids in zip(self._cells, block_ids):
            n = len(cells)
            if len(ids) <= FEW:
                for b in ids:
                    if 0 <= b < n and cells[b]:
                        return b, self._names[int(cells[b])]
                continue
            wanted = np.fromiter(ids, np.int64, len(ids))
            wanted = wanted[(wanted >= 0) & (wanted < n)]
            tokens = cells[wanted]
            found = np.flatnonzero(tokens)
            if len(found):
                return int(wanted[found[0]]), self._names[int(tokens[found[0]])]
        return None

    def cells(self) -> dict[tuple[int, int], str]:
        """Every held block as (group, block) -> request id (for checks and debugging)."""
        return {(g, b): self._names[int(cells[b])]
                for g, cells in enumerate(self._cells) for b in np.flatnonzero(cells).tolist()}

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


def _top(g: int, ids: Ids) -> int:
    """The largest id of a group (-1 for none); a negative or too large one is refused."""
    if not len(ids):
        return -1
    low, top = (min(ids), max(ids)) if isinstance(ids, list) else (int(ids.min()), int(ids.max()))
    if low < 0 or top > MAX_BLOCK_ID:
        raise ValueError(f"group {g}: block id outside 0..{MAX_BLOCK_ID}")
    return top
