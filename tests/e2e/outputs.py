"""Comparing what came out of P/D with colocated vLLM's outputs: every request
succeeded, the greedy tokens are equal, and where they differ, whether the reference's
two best tokens were a bf16 near-tie."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from helpers import Outcome, Req


def assert_all_ok(got: dict[str, Outcome], where: str, logs: Callable[[], str]) -> None:
    """Every request of ``got`` succeeded through ``where``."""
    failed = {name: str(o) for name, o in got.items() if not o.ok}
    assert not failed, f"requests failed through {where}: {failed}\n{logs()}"


def assert_like_colocated(got: dict[str, Outcome], refs: dict[str, Outcome], reqs: Sequence[Req], where: str,
                          logs: Callable[[], str]) -> None:
    """Every request of ``reqs`` succeeded through ``where`` and its greedy output equals the
    colocated reference: the first token always (D's first step on the pushed KV), later ones
    but for bf16 near-ties, which may flip a later greedy pick once in a while (at most one
    request in 24; more is a bug)."""
    assert_all_ok(got, where, logs)
    diverged = {r.name: diverged_at(got[r.name].tokens, refs[r.name].tokens) for r in reqs}
    diverged = {name: at for name, at in diverged.items() if at is not None}
    detail = {name: (got[name].tokens, refs[name].tokens) for name in diverged}
    assert all(at > 0 for at in diverged.values()), f"first token differs from colocated: {detail}"
    assert len(diverged) <= len(reqs) // 24, f"outputs differ from colocated: {detail}"


def top_logprobs(outcome: Outcome, position: int) -> dict[int, float]:
    """The best tokens at ``position`` of a completion asked with ``logprobs`` and
    ``return_tokens_as_token_ids``: token id -> logprob."""
    tops = outcome.body["choices"][0]["logprobs"]["top_logprobs"][position]
    return {int(key.removeprefix("token_id:")): lp for key, lp in tops.items()}


def differences_at_ties(reqs: Sequence[Req], got: dict[str, Outcome], refs: dict[str, Outcome],
                        near_tie: float) -> tuple[list[str], dict[str, str]]:
    """Where each output first differs from its reference: one line per differing request
    (the position, both tokens, the reference's logprob gap between them and ours), and
    the lines of those whose reference gap is beyond ``near_tie`` nats (not a bf16 tie)."""
    report, not_ties = [], {}
    for req in reqs:
        mine, ref = got[req.name], refs[req.name]
        at = diverged_at(mine.tokens, ref.tokens)
        if at is None:
            continue
        ref_top, my_top = top_logprobs(ref, at), top_logprobs(mine, at)
        ours, theirs = mine.tokens[at], ref.tokens[at]
        gap = ref_top[theirs] - ref_top.get(ours, float("-inf"))
        report.append(f"{req.name}: token {at}, colocated {theirs} vs P/D {ours}, colocated's gap {gap:.4f} nats, "
                      f"P/D's {my_top[ours] - my_top.get(theirs, float('-inf')):.4f}")
        if not gap <= near_tie:
            not_ties[req.name] = report[-1]
    return report, not_ties


def diverged_at(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
