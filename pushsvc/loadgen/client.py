"""A streaming OpenAI-completions client that times each request, and batches of them.

Greedy (temperature 0) with ``ignore_eos``: every answer has exactly ``max_tokens``
tokens, so runs compare token for token and timings compare request for request.

Per request: TTFT (send -> first streamed choice), TPOT (time per output token after the
first: (last token - first token) / (tokens - 1)), latency (send -> end of stream), the
text piece by piece, and why it failed if it did. A stream that ends without ``[DONE]``
failed: the server or a proxy cut it short. Asked with ``top_logprobs``, also each token's
best candidates and their logprobs (what tells a bf16 near-tie from a real difference).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import aiohttp

from pushsvc.loadgen.prompts import Prompt

REQUEST_TIMEOUT_S = 60.0  # a P/D request whose KV never arrives waits forever in vLLM
IDLE_TIMEOUT_S = 60.0  # between two stream chunks (capped at the request's timeout)
_ERROR_CHARS = 300


@dataclass
class Result:
    request_id: str  # the prompt's (the X-Request-Id sent may carry a run tag in front)
    words: int
    text: str = ""
    chunks: list[str] = field(default_factory=list)  # each streamed choice's text, in order: one token each
    prompt_tokens: int | None = None  # as the server counted them (its usage report)
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    error: str | None = None
    # With ``top_logprobs``: per token, in order, its best candidates' text -> logprob.
    top_logprobs: list[dict[str, float]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict:
        """Every field but ``chunks``, which ``text`` holds joined, and ``top_logprobs``."""
        doc = asdict(self)
        del doc["chunks"], doc["top_logprobs"]
        return doc


class Batch(NamedTuple):
    results: list[Result]  # in prompt order
    wall_s: float  # first request sent -> last one finished


def request_body(model: str, prompt: str, max_tokens: int, top_logprobs: int = 0) -> dict:
    """A streamed greedy completion; with ``top_logprobs`` > 0 each token comes with that
    many best candidates (OpenAI's ``logprobs``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if top_logprobs:
        body["logprobs"] = top_logprobs
    return body


async def complete(session: aiohttp.ClientSession, base_url: str, model: str, prompt: Prompt, max_tokens: int,
                   request_id: str | None = None, top_logprobs: int = 0) -> Result:
    """Stream one completion of ``prompt``; never raises for a failed request, the result says why.

    ``request_id`` (the prompt's id by default) goes out as ``X-Request-Id``.
    """
    result = Result(prompt.request_id, prompt.words)
    stamps: list[float] = []  # perf_counter() at each streamed choice
    start = time.perf_counter()
    try:
        body = request_body(model, prompt.text, max_tokens, top_logprobs)
        async with session.post(f"{base_url}/v1/completions", json=body,
                                headers={"X-Request-Id": request_id or prompt.request_id}) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {await response.text()}"
            else:
                result.error = await _read_stream(response, result, stamps)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.latency_s = time.perf_counter() - start
        result.text = "".join(result.chunks)
        if result.error is not None:
            result.error = result.error[:_ERROR_CHARS]
        if stamps:
            result.ttft_s = stamps[0] - start
            result.output_tokens = result.output_tokens or len(stamps)
            if result.output_tokens > 1:
                result.tpot_s = (stamps[-1] - stamps[0]) / (result.output_tokens - 1)
    return result


async def _read_stream(response: aiohttp.ClientResponse, result: Result, stamps: list[float]) -> str | None:
    """Read the SSE stream into ``result`` and ``stamps``; the error, None if it ended well."""
    async for raw in response.content:  # one SSE line at a time
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return None if stamps else "the stream ended without a token"
        event = json.loads(data)
        if "error" in event:  # an error inside an already-started stream
            error = event["error"]
            return str(error.get("message") if isinstance(error, dict) else error)
        now = time.perf_counter()
        for choice in event.get("choices") or ():
            stamps.append(now)
            result.chunks.append(choice.get("text") or "")
            if logprobs := choice.get("logprobs"):
                result.top_logprobs.extend(top or {} for top in logprobs.get("top_logprobs") or ())
        if usage := event.get("usage"):
            result.prompt_tokens = usage.get("prompt_tokens")
            result.output_tokens = usage.get("completion_tokens") or 0
    return "the stream ended without [DONE]"


async def run_prompts(base_url: str, model: str, prompts: Sequence[Prompt], *, max_tokens: int, concurrency: int,
                      tag: str | None = None, on_result: Callable[[Result], None] = lambda r: None,
                      timeout_s: float = REQUEST_TIMEOUT_S, max_failures: int | None = None,
                      top_logprobs: int = 0) -> Batch:
    """Send every prompt, at most ``concurrency`` at a time.

    ``tag`` goes in front of each request id (``tag-prompt_id``): vLLM and the connectors
    key their state by it, so a run that sends the same prompts again needs its own.
    ``on_result`` is called as each request finishes. After ``max_failures`` failed
    requests the rest are skipped (None: never). ``top_logprobs``: see ``request_body``.
    """
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=min(IDLE_TIMEOUT_S, timeout_s))
    # force_close: vLLM's server drops idle keep-alive connections after 5 s, and a POST that
    # races that close fails; a fresh loopback connection per request costs well under 1 ms.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    gate = asyncio.Semaphore(concurrency)
    failures = 0

    async def one(session: aiohttp.ClientSession, prompt: Prompt) -> Result:
        nonlocal failures
        async with gate:
            if max_failures is not None and failures >= max_failures:
                # A deployment that lost its KV path would otherwise cost a timeout per prompt.
                result = Result(prompt.request_id, prompt.words, error=f"skipped after {failures} failures")
            else:
                request_id = f"{tag}-{prompt.request_id}" if tag else prompt.request_id
                result = await complete(session, base_url, model, prompt, max_tokens, request_id, top_logprobs)
                failures += not result.ok
        on_result(result)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        results = list(await asyncio.gather(*(one(session, p) for p in prompts)))
        return Batch(results, time.perf_counter() - started)


def run_batch(base_url: str, model: str, prompts: Sequence[Prompt], *, max_tokens: int, concurrency: int,
              tag: str | None = None, on_result: Callable[[Result], None] = lambda r: None,
              timeout_s: float = REQUEST_TIMEOUT_S, max_failures: int | None = None, top_logprobs: int = 0) -> Batch:
    """``run_prompts`` on a loop of its own, for callers without one.

    Ctrl-C cancels the requests in flight (closing their connections, which aborts them in
    vLLM) and raises KeyboardInterrupt.
    """
    return asyncio.run(run_prompts(base_url, model, prompts, max_tokens=max_tokens, concurrency=concurrency,
                                   tag=tag, on_result=on_result, timeout_s=timeout_s, max_failures=max_failures,
                                   top_logprobs=top_logprobs))
