"""Judging and formatting the demo's results. Pure functions: no I/O, no clock.

P/D outputs are compared with the colocated outputs of the same prompts. The tiny model
runs in bf16, where two candidate tokens can tie to within rounding (colocated's own
logprobs show it: equal ones are common); P/D computes the prompt's KV in another batch
shape than colocated serving, and D its first token alone on top of the pushed KV, so
such a near-tie may break the other way once in a while. A first token that differs is
tolerated only where colocated's logprobs for both tokens are within ``NEAR_TIE`` (a
difference there would otherwise point at the transfer); one later divergence is
tolerated; an answer cut short or too long never is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pushsvc.loadgen.client import Result
from pushsvc.loadgen.stats import Timing, percentile, timings

TOLERATED_DIVERGENCES = 1  # after the first token
NEAR_TIE = 0.05  # nats between colocated's logprobs of two first tokens that rounding may swap


@dataclass(frozen=True)
class Comparison:
    request_id: str
    verdict: str  # "match", "DIFFERS at char N" or "ERROR ..."
    matched: bool
    diverged_at: int | None = None
    tolerable: bool = False  # may be a bf16 near-tie: a first-token tie, or later, same length
    error: bool = False
    first_token_tie: bool = False  # the first token differs within NEAR_TIE of colocated's logprobs


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where ``a`` and ``b`` differ; None if equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def compare(reference: Result, got: Result) -> Comparison:
    if not got.ok:
        return Comparison(got.request_id, f"ERROR {_clip(got.error or '', 100)}", False, error=True)
    if not reference.ok:
        return Comparison(got.request_id, "no colocated reference", False, error=True)
    at = first_difference(reference.text, got.text)
    if at is None:
        return Comparison(got.request_id, "match", True)
    if at == min(len(reference.text), len(got.text)):  # one is a prefix of the other: cut short
        return Comparison(got.request_id, f"DIFFERS at char {at}: {len(got.chunks)} tokens, colocated "
                          f"{len(reference.chunks)}", False, diverged_at=at)
    token = _token_at(reference.chunks, at)
    if token and reference.chunks[:1] == got.chunks[:1]:
        return Comparison(got.request_id, f"DIFFERS at char {at} (token {token + 1})", False, diverged_at=at,
                          tolerable=True)
    gap = first_token_gap(reference, got)
    tie = gap <= NEAR_TIE
    where = "first token" + (f", colocated's logprobs {gap:.4f} nats apart" if gap < math.inf else "")
    return Comparison(got.request_id, f"DIFFERS at char {at} ({where})", False, diverged_at=at, tolerable=tie,
                      first_token_tie=tie)


def first_token_gap(reference: Result, got: Result) -> float:
    """Colocated's logprob of its first token minus that of ``got``'s first token, from the
    reference's best candidates there (inf where either is not among them, or the
    reference was asked without logprobs)."""
    top = reference.top_logprobs[0] if reference.top_logprobs else {}
    theirs, ours = reference.chunks[0] if reference.chunks else None, got.chunks[0] if got.chunks else None
    if theirs not in top or ours not in top:
        return math.inf
    return top[theirs] - top[ours]


def _token_at(chunks: Sequence[str], char: int) -> int:
    """Index of the streamed token that holds character ``char`` of their concatenation."""
    end = 0
    for i, text in enumerate(chunks):
        end += len(text)
        if char < end:
            return i
    return len(chunks)


def verdict(comparisons: Sequence[Comparison]) -> tuple[bool, str]:
    """(passed, one line saying why)."""
    n = len(comparisons)
    matched = sum(c.matched for c in comparisons)
    errors = [c for c in comparisons if c.error]
    diverged = [c for c in comparisons if not c.matched and not c.error]
    equal = f"{matched}/{n} P/D outputs equal the colocated outputs"
    if errors:
        return False, f"{equal}; {len(errors)} requests failed"
    if not diverged:
        return True, equal
    ties = [c for c in diverged if c.first_token_tie]
    later = [c for c in diverged if c.tolerable and not c.first_token_tie]
    if len(later) <= TOLERATED_DIVERGENCES and all(c.tolerable for c in diverged):
        said = [f"{c.request_id} {c.verdict.lower().replace('differs', 'diverges')}" for c in (*ties, *later)]
        why = [f"{len(ties)} first-token tie{'s' if len(ties) > 1 else ''} (within {NEAR_TIE} nats)"] if ties else []
        why += [f"a bf16 near-tie (at most {TOLERATED_DIVERGENCES} after the first token)"] if later else []
        return True, f"{equal}; {'; '.join(said)}: {' and '.join(why)}, tolerated"
    hard = sum(not c.tolerable for c in diverged)
    why = f", {hard} at the first token beyond a near-tie or in length" if hard else ""
    return False, f"{equal}; {len(diverged)} differ{why}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def log_line(line: str, width: int = 160) -> str:
    """A structlog JSON line as ``time level event key=value ...``; other lines as they are."""
    try:
        doc = json.loads(line)
    except ValueError:
        return _clip(line, width)
    if not isinstance(doc, dict) or "event" not in doc:
        return _clip(line, width)
    head = [str(doc.pop("timestamp", ""))[11:23], str(doc.pop("level", "")), str(doc.pop("event"))]
    doc.pop("logger", None)
    return _clip(" ".join([*head, *(f"{k}={v}" for k, v in doc.items())]), width)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def spread(results: Sequence[Result], timing: Timing) -> str:
    values = timings(results, timing)
    if not values:
        return "n/a"
    return f"p50 {percentile(values, 50) * 1e3:6.0f} ms   p90 {percentile(values, 90) * 1e3:6.0f} ms"


def p50(results: Sequence[Result], timing: Timing) -> float:
    return percentile(timings(results, timing), 50)


_COLUMNS = ("request", "words", "prompt tokens", "TTFT ms", "latency ms", "colocated TTFT ms", "output")
TABLE_HEADER = "  ".join(_COLUMNS)


def table_row(got: Result, reference: Result, comparison: Comparison) -> str:
    tokens = "-" if got.prompt_tokens is None else str(got.prompt_tokens)
    cells = (got.request_id, str(got.words), tokens, ms(got.ttft_s), ms(got.latency_s), ms(reference.ttft_s))
    aligned = [f"{cells[0]:<{len(_COLUMNS[0])}}"] + [f"{c:>{len(h)}}" for c, h in zip(cells[1:], _COLUMNS[1:])]
    return "  ".join([*aligned, comparison.verdict])


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text exposition to {'name{labels}': value} (comments skipped)."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            samples[key] = float(value)
        except ValueError:
            continue
    return samples


def transfer_line(samples: dict[str, float]) -> str:
    """The daemon's push counters in a few words."""
    by_result = {k.partition('result="')[2].rstrip('"}'): v for k, v in samples.items()
                 if k.startswith("pushsvc_transfers_total{")}
    pushes = ", ".join(f"{int(v)} {k}" for k, v in sorted(by_result.items())) or "0"
    nbytes = samples.get("pushsvc_transfer_bytes_total", 0.0)
    failures = {k.partition('kind="')[2].rstrip('"}'): v for k, v in samples.items()
                if k.startswith("pushsvc_failures_total{") and v}
    received = int(samples.get("pushsvc_recv_seconds_count", 0.0))
    text = f"pushes written: {pushes} ({nbytes / 2**20:.2f} MiB); received: {received}"
    if failures:
        text += ", failures " + ", ".join(f"{k}={int(v)}" for k, v in sorted(failures.items()))
    return text
