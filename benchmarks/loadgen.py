"""Prompt sets and a streaming OpenAI-completions load generator with per-token timing.

Greedy (temperature 0) with ``ignore_eos``: every answer has exactly ``max_tokens``
tokens, so runs compare token for token and timings compare request for request.

Per request: TTFT (send -> first streamed chunk with text), TPOT (time per output token
after the first: (last token - first token) / (tokens - 1)), latency (send -> end of
stream), and the text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

from pushsvc.tinymodel import _corpus

_SEED = 20261
REQUEST_TIMEOUT_S = 60.0  # a P/D request whose KV never arrives waits forever in vLLM
IDLE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Prompt:
    request_id: str
    text: str
    tokens: int  # by the model's tokenizer, without special tokens


@dataclass
class Result:
    request_id: str
    prompt_tokens: int
    text: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    def to_json(self) -> dict:
        return asdict(self)


def _sentences() -> list[str]:
    return _corpus(_SEED, n_sentences=4000)


def mixed_prompts(tokenizer, n: int = 24, shortest: int = 8, longest: int = 600,
                  prefix: str = "mixed") -> list[Prompt]:
    """``n`` prompts of ``shortest``..``longest`` words, lengths spread geometrically and
    shuffled (seeded) so that short and long prompts are in flight together."""
    ratio = longest / shortest
    counts = [round(shortest * ratio ** (i / max(1, n - 1))) for i in range(n)]
    random.Random(_SEED).shuffle(counts)
    sentences, rng = _sentences(), random.Random(_SEED)
    out = []
    for i, count in enumerate(counts):
        words: list[str] = []
        while len(words) < count:
            words += rng.choice(sentences).split()
        text = " ".join(words[:count])
        out.append(Prompt(f"{prefix}-{i:02d}", text, len(tokenizer.encode(text).ids)))
    return out


def long_prompts(tokenizer, n: int = 8, lo: int = 1000, hi: int = 1500, prefix: str = "long") -> list[Prompt]:
    """``n`` prompts of ``lo``..``hi`` tokens (evenly spaced, shuffled)."""
    targets = [round(lo + (hi - lo) * i / max(1, n - 1)) for i in range(n)]
    random.Random(_SEED + 1).shuffle(targets)
    sentences, rng = _sentences(), random.Random(_SEED + 1)
    out = []
    for i, target in enumerate(targets):
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words)).ids) < target:
            words += rng.choice(sentences).split()
        # Trim word by word to the last prefix that still reaches the target.
        while len(words) > 1 and len(tokenizer.encode(" ".join(words[:-1])).ids) >= target:
            words.pop()
        text = " ".join(words)
        out.append(Prompt(f"{prefix}-{i:02d}", text, len(tokenizer.encode(text).ids)))
    return out


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def complete(session: aiohttp.ClientSession, base_url: str, model: str, prompt: Prompt, max_tokens: int,
                   request_id: str) -> Result:
    result = Result(prompt.request_id, prompt.tokens)
    body = request_body(model, prompt.text, max_tokens)
    pieces: list[str] = []
    stamps: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        async with session.post(f"{base_url}/v1/completions", json=body,
                                headers={"X-Request-Id": request_id}) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    result.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                    break
                now = time.perf_counter()
                for choice in event.get("choices") or ():
                    stamps.append(now)
                    pieces.append(choice.get("text") or "")
                if usage := event.get("usage"):
                    usage_tokens = usage.get("completion_tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.latency_s = time.perf_counter() - start
        result.text = "".join(pieces)
        if stamps:
            result.ttft_s = stamps[0] - start
            n = usage_tokens or len(stamps)
            result.output_tokens = n
            if n > 1:
                result.tpot_s = (stamps[-1] - stamps[0]) / (n - 1)
    return result


async def _run(base_url: str, model: str, prompts: Sequence[Prompt], max_tokens: int, concurrency: int,
               tag: str, on_result: Callable[[Result], None], timeout_s: float,
               max_failures: int) -> tuple[list[Result], float]:
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=min(IDLE_TIMEOUT_S, timeout_s))
    # A fresh loopback connection per request: vLLM's server drops idle keep-alive
    # connections after 5 s, and a POST racing that close fails.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    gate = asyncio.Semaphore(concurrency)
    failures = 0

    async def one(session: aiohttp.ClientSession, prompt: Prompt) -> Result:
        nonlocal failures
        async with gate:
            if failures >= max_failures:
                # A deployment that lost its KV path would otherwise cost a timeout per prompt.
                result = Result(prompt.request_id, prompt.tokens, error=f"skipped after {failures} failures")
            else:
                # A request id unique per run: vLLM and the connectors key their state by it.
                result = await complete(session, base_url, model, prompt, max_tokens, f"{tag}-{prompt.request_id}")
                failures += not result.ok
        on_result(result)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        results = list(await asyncio.gather(*(one(session, p) for p in prompts)))
        return results, time.perf_counter() - started


def run_batch(base_url: str, model: str, prompts: Sequence[Prompt], *, max_tokens: int, concurrency: int,
              tag: str, on_result: Callable[[Result], None] = lambda r: None,
              timeout_s: float = REQUEST_TIMEOUT_S, max_failures: int = 3) -> tuple[list[Result], float]:
    """Send every prompt, at most ``concurrency`` at a time; after ``max_failures``
    failed requests the rest are skipped. Returns the results in prompt order and the
    wall time of the whole batch."""
    return asyncio.run(_run(base_url, model, prompts, max_tokens, concurrency, tag, on_result, timeout_s,
                            max_failures))


@dataclass
class Summary:
    n: int
    failed: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    latency_p50_ms: float
    req_per_s: float
    extra: dict = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    vals = sorted(values)
    if not vals:
        return float("nan")
    k = (len(vals) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def summarize(results: Sequence[Result], wall_s: float) -> Summary:
    ok = [r for r in results if r.ok]
    ms = lambda xs, q: percentile([x * 1e3 for x in xs if x is not None], q)  # noqa: E731
    return Summary(
        n=len(results),
        failed=len(results) - len(ok),
        ttft_p50_ms=ms([r.ttft_s for r in ok], 50),
        ttft_p90_ms=ms([r.ttft_s for r in ok], 90),
        tpot_p50_ms=ms([r.tpot_s for r in ok], 50),
        tpot_p90_ms=ms([r.tpot_s for r in ok], 90),
        latency_p50_ms=ms([r.latency_s for r in ok], 50),
        req_per_s=len(ok) / wall_s if wall_s > 0 else float("nan"),
    )
