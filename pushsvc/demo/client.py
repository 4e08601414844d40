"""A streaming OpenAI-completions client that times each request.

TTFT is the time from sending the request to the first streamed chunk that carries a
token; latency runs to the end of the stream. Greedy decoding (temperature 0) with
``ignore_eos``, so every answer has exactly ``max_tokens`` tokens and runs compare.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from pushsvc.demo.prompts import Prompt

REQUEST_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 60.0  # between two stream chunks


@dataclass
class Result:
    request_id: str
    words: int
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # one streamed chunk's text each
    prompt_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def complete(session: aiohttp.ClientSession, base_url: str, model: str, prompt: Prompt,
                   max_tokens: int) -> Result:
    result = Result(prompt.request_id, prompt.words)
    body = request_body(model, prompt.text, max_tokens)
    start = time.perf_counter()
    try:
        async with session.post(f"{base_url}/v1/completions", json=body,
                                headers={"X-Request-Id": prompt.request_id}) as response:
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
                if "error" in event:  # an error inside an already-started stream
                    error = event["error"]
                    result.error = str(error.get("message") if isinstance(error, dict) else error)[:300]
                    break
                for choice in event.get("choices") or ():
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - start
                    result.tokens.append(choice.get("text") or "")
                if usage := event.get("usage"):
                    result.prompt_tokens = usage.get("prompt_tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result.latency_s = time.perf_counter() - start
        result.text = "".join(result.tokens)
    return result


async def _run_all(base_url: str, model: str, prompts: Sequence[Prompt], max_tokens: int, concurrency: int,
                   on_result: Callable[[Result], None]) -> list[Result]:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_read=IDLE_TIMEOUT_S)
    # force_close: vLLM's server drops idle keep-alive connections after 5 s, and a POST that
    # races that close fails; a fresh loopback connection per request costs well under 1 ms.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, prompt: Prompt) -> Result:
        async with gate:
            result = await complete(session, base_url, model, prompt, max_tokens)
        on_result(result)
        return result

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, p) for p in prompts)))


def run_batch(base_url: str, model: str, prompts: Sequence[Prompt], *, max_tokens: int, concurrency: int,
              on_result: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Send every prompt, at most ``concurrency`` at a time; results in prompt order.

    ``on_result`` is called as each request finishes. Ctrl-C cancels the requests in
    flight (closing their connections, which aborts them in vLLM) and raises
    KeyboardInterrupt.
    """
    return asyncio.run(_run_all(base_url, model, prompts, max_tokens, concurrency, on_result))
