"""Percentiles over a batch's results, and the summary the benchmarks record per run.

Pure functions: no I/O, no clock. Timings count only the requests that succeeded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pushsvc.loadgen.client import Result

Timing = Literal["ttft_s", "tpot_s", "latency_s"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), interpolated between the nearest ranks; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def timings(results: Sequence[Result], timing: Timing) -> list[float]:
    """``timing`` (seconds) of each result that succeeded and has one."""
    values = (getattr(r, timing) for r in results if r.ok)
    return [v for v in values if v is not None]


@dataclass
class Summary:
    n: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    latency_p50_ms: float
    req_per_s: float  # requests that succeeded, over the batch's wall time


def summarize(results: Sequence[Result], wall_s: float) -> Summary:
    def ms(timing: Timing, q: float) -> float:
        return percentile(timings(results, timing), q) * 1e3

    ok = sum(r.ok for r in results)
    return Summary(
        n=len(results),
        failed=len(results) - ok,
        ttft_p50_ms=ms("ttft_s", 50),
        ttft_p90_ms=ms("ttft_s", 90),
        tpot_p50_ms=ms("tpot_s", 50),
        tpot_p90_ms=ms("tpot_s", 90),
        latency_p50_ms=ms("latency_s", 50),
        req_per_s=ok / wall_s if wall_s > 0 else math.nan,
    )
