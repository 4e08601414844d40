"""Comparing what came out of P/D with colocated vLLM's outputs: every request
succeeded, the greedy tokens are equal, and where they differ, whether the reference's
two best tokens were a bf16 near-tie.

Why a first token may differ at a tie: D computes only a prompt's last token, alone, over
P's KV (which P computed in its own batches); colocated vLLM computed the whole prompt in
one batch. In bfloat16 the two sums round differently, so where colocated's two best
logits are equal or nearly so, D may pick the other one. The pushed bytes themselves are
checked exactly by verify mode; these checks are about the tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from helpers import COMPLETIONS, Outcome, Req

from pushsvc.demo.report import NEAR_TIE  # nats between two tokens' logprobs that bf16 rounding may swap

REFERENCE_TOP = 5  # best tokens the colocated reference returns at each position


def reference_request(req: Req) -> Req:
    """``req`` as colocated vLLM is asked it for the reference: the same generation, not
    streamed, with its ``REFERENCE_TOP`` best tokens (as token ids) at each position."""
    if req.path == COMPLETIONS:
        return req.with_body(stream=False, logprobs=REFERENCE_TOP, return_tokens_as_token_ids=True)
    return req.with_body(stream=False, logprobs=True, top_logprobs=REFERENCE_TOP, return_tokens_as_token_ids=True)


def assert_all_ok(got: dict[str, Outcome], where: str, logs: Callable[[], str]) -> None:
    """Every request of ``got`` succeeded through ``where``."""
    failed = {name: str(o) for name, o in got.items() if not o.ok}
    assert not failed, f"requests failed through {where}: {failed}\n{logs()}"


def assert_like_colocated(got: dict[str, Outcome], refs: dict[str, Outcome], reqs: Sequence[Req], where: str,
                          logs: Callable[[], str]) -> None:
    """Every request of ``reqs`` succeeded through ``where`` and its greedy output equals the
    colocated reference (``refs``, from ``reference_request``): the first token (D's first
    step on the pushed KV) unless colocated's own logprobs tie there within ``NEAR_TIE``,
    later ones but for bf16 near-ties, which may flip a later greedy pick once in a while
    (at most one request in 24; more is a bug)."""
    assert_all_ok(got, where, logs)
    diverged = {r.name: diverged_at(got[r.name].tokens, refs[r.name].tokens) for r in reqs}
    diverged = {name: at for name, at in diverged.items() if at is not None}
    detail = {name: (got[name].tokens, refs[name].tokens) for name in diverged}
    first = {name: logprob_gap(refs[name], got[name], 0) for name, at in diverged.items() if at == 0}
    assert all(gap <= NEAR_TIE for gap in first.values()), (
        f"first token differs from colocated beyond a near-tie (colocated's gap, nats: {first}): {detail}")
    later = {name: at for name, at in diverged.items() if at > 0}
    assert len(later) <= len(reqs) // 24, f"outputs differ from colocated: {detail}"


def assert_same_as_colocated(got: Outcome, ref: Outcome, what: str, logs: Callable[[], str]) -> None:
    """``got`` succeeded and its tokens are colocated's ``ref``'s, all of them, or it differs
    from the first token on where colocated's own logprobs tie within ``NEAR_TIE``."""
    assert got.ok, f"{what}: {got}\n{logs()}"
    at = diverged_at(got.tokens, ref.tokens)
    if at == 0 and logprob_gap(ref, got, 0) <= NEAR_TIE:
        return
    assert at is None, f"{what}: P/D {got.tokens} != colocated {ref.tokens}"


def logprob_gap(scored: Outcome, other: Outcome, at: int) -> float:
    """By ``scored``'s own logprobs at position ``at``: its token's minus ``other``'s token's
    (inf where ``other``'s is not among ``scored``'s best)."""
    top = top_logprobs(scored, at)
    return top[scored.tokens[at]] - top.get(other.tokens[at], float("-inf"))


def top_logprobs(outcome: Outcome, position: int) -> dict[int, float]:
    """The best tokens at ``position`` of a completion or chat completion asked with
    logprobs and ``return_tokens_as_token_ids``: token id -> logprob."""
    logprobs = outcome.body["choices"][0]["logprobs"]
    if "content" in logprobs:  # chat
        tops = {t["token"]: t["logprob"] for t in logprobs["content"][position]["top_logprobs"]}
    else:
        tops = logprobs["top_logprobs"][position]
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
        ours, theirs = mine.tokens[at], ref.tokens[at]
        gap = logprob_gap(ref, mine, at)
        report.append(f"{req.name}: token {at}, colocated {theirs} vs P/D {ours}, colocated's gap {gap:.4f} nats, "
                      f"P/D's {logprob_gap(mine, ref, at):.4f}")
        if not gap <= near_tie:
            not_ties[req.name] = report[-1]
    return report, not_ties


def diverged_at(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
