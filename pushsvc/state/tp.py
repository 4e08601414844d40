"""Which ranks of P and D pair when their tensor-parallel sizes differ (pure).

P TP = k x D TP (k >= 1): D rank ``j`` gets its KV from the ``k`` P ranks
``j*k .. j*k+k-1`` (its *sources*), and P rank ``s`` writes all of its blocks into head
slice ``s mod k`` of D rank ``s // k``'s blocks (``layout.head_slice``). vLLM shards KV
heads by rank in order, so that slice holds exactly P rank ``s``'s heads.

D TP = k x P TP (k > 1): P rank ``i``'s heads are those of D ranks ``i*k .. i*k+k-1``
(its *members*). D's daemon joins their memory in one NIXL agent (``server/joints.py``),
named to P as rank ``i`` of TP ``p_tp``, so P pairs with it as at equal TP and writes
head slice ``j`` of its own blocks into member ``j``'s whole blocks
(``layout.joint_source``).

KV that every TP rank holds whole (MLA's latent rows, ``RegionSpec.replicated``) is not
split: the first source (``writer``) writes all of it, the others only free their blocks.
"""

from __future__ import annotations


def refusal(p_tp: int, d_tp: int) -> str:
    """Why P TP ``p_tp`` cannot push into D's rank agents of TP ``d_tp``, or '' (a D TP
    above P's goes through D's joint agents instead: ``joint_refusal``)."""
    if d_tp > p_tp:
        return f"P TP {p_tp} -> D TP {d_tp}: a D TP above P's is served by D's joint agents"
    if p_tp % d_tp:
        return f"P TP {p_tp} -> D TP {d_tp}: P TP must be a multiple of D TP"
    return ""


def joint_refusal(p_tp: int, d_tp: int) -> str:
    """Why a D of TP ``d_tp`` above P's ``p_tp`` cannot take P's KV through joint agents, or ''."""
    if d_tp % p_tp:
        return f"P TP {p_tp} -> D TP {d_tp}: D TP must be a multiple of P TP"
    return ""


def joint_of(d_rank: int, d_tp: int, p_tp: int) -> tuple[int, int]:
    """(the joint agent D rank ``d_rank`` is a member of, its place among the members),
    for D TP = k x P TP: the P rank that writes into it, and the head slice of that P
    rank's blocks it holds."""
    k = d_tp // p_tp
    return d_rank // k, d_rank % k


def members(joint: int, d_tp: int, p_tp: int) -> range:
    """The D ranks of joint agent ``joint`` (D TP = k x P TP)."""
    k = d_tp // p_tp
    return range(joint * k, (joint + 1) * k)


def joint_sizes(d_tp: int) -> list[int]:
    """The P TPs a D of TP ``d_tp`` serves through joint agents: every proper divisor."""
    return [p for p in range(1, d_tp) if d_tp % p == 0]


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
    """Whether local ``rank`` exchanges KV with ``remote_rank`` (either side may be P; a
    P rank writes into a D of higher TP only through D's joint agents: ``direct``)."""
    if tp >= remote_tp:
        return tp % remote_tp == 0 and remote_rank == rank // (tp // remote_tp)
    return remote_tp % tp == 0 and rank == remote_rank // (remote_tp // tp)


def direct(role: str, tp: int, remote_tp: int, remote_members: int = 1) -> bool:
    """Whether a local rank of ``role`` and TP ``tp`` loads a remote agent of TP
    ``remote_tp``: a P rank the D agents it may write into (of its TP or below, joint
    agents of its TP only), a D rank the P agents that may write into it (of its TP or
    above; D's joint agents stand at P's TP), a rank of both roles either."""
    if remote_members > 1:
        return tp == remote_tp and role != "consumer"
    if role == "producer":
        return remote_tp <= tp
    if role == "consumer":
        return remote_tp >= tp
    return True
