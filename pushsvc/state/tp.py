"""Which ranks of P and D pair when their tensor-parallel sizes differ (pure).

P TP = k x D TP (k >= 1): D rank ``j`` gets its KV from the ``k`` P ranks
``j*k .. j*k+k-1`` (its *sources*), and P rank ``s`` writes all of its blocks into head
slice ``s mod k`` of D rank ``s // k``'s blocks (``layout.head_slice``). vLLM shards KV
heads by rank in order, so that slice holds exactly P rank ``s``'s heads. D TP above P
TP (one P rank's heads split over several D ranks) is not supported: it is refused.

KV that every TP rank holds whole (MLA's latent rows, ``RegionSpec.replicated``) is not
split: the first source (``writer``) writes all of it, the others only free their blocks.
"""

from __future__ import annotations


def refusal(p_tp: int, d_tp: int) -> str:
    """Why P TP ``p_tp`` cannot push into D TP ``d_tp``, or ''."""
    if d_tp > p_tp:
        return f"P TP {p_tp} -> D TP {d_tp}: a D TP above P's is not supported (P TP must be a multiple of D TP)"
    if p_tp % d_tp:
        return f"P TP {p_tp} -> D TP {d_tp}: P TP must be a multiple of D TP"
    return ""


def ratio(p_tp: int, d_tp: int) -> int:
    """P ranks per D rank (``refusal`` must be '')."""
    return p_tp // d_tp


def sources(d_rank: int, d_tp: int, p_tp: int) -> range:
    """The P ranks that write into D rank ``d_rank``."""
    k = ratio(p_tp, d_tp)
    return range(d_rank * k, (d_rank + 1) * k)


def served(p_rank: int, p_tp: int, d_tp: int) -> tuple[int, int]:
    """(the D rank P rank ``p_rank`` writes into, the head slice of D's blocks it fills)."""
    k = ratio(p_tp, d_tp)
    return p_rank // k, p_rank % k


def writer(d_rank: int, d_tp: int, p_tp: int) -> int:
    """The P rank that writes replicated KV into D rank ``d_rank``."""
    return sources(d_rank, d_tp, p_tp)[0]


def pairs(rank: int, tp: int, remote_rank: int, remote_tp: int) -> bool:
    """Whether local ``rank`` exchanges KV with ``remote_rank`` (either side may be P)."""
    if tp >= remote_tp:
        return tp % remote_tp == 0 and remote_rank == rank // (tp // remote_tp)
    return remote_tp % tp == 0 and rank == remote_rank // (remote_tp // tp)
