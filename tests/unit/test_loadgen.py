"""The load generator: prompt sets, the streaming client against an in-process SSE server, stats.

The server stands in for vLLM's ``/v1/completions`` with ``stream: true``: it streams one
SSE event per token at a set pace, then the usage event and ``[DONE]``; a test changes its
``script`` to fail in one of the ways a real deployment does.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import test_utils, web

from pushsvc.loadgen import client, prompts, stats
from pushsvc.loadgen.client import Result
from pushsvc.loadgen.prompts import Prompt

MODEL = "tiny"


@dataclass
class Script:
    """How the server answers every request."""

    tokens: tuple[str, ...] = ("Hel", "lo", "!")
    first_delay_s: float = 0.0  # before the first token
    gap_s: float = 0.0  # between two tokens
    status: int = 200
    error_after: int | None = None  # an error event after this many tokens
    done: bool = True  # end with [DONE]
    hang_s: float = 0.0  # before the response headers
    top_logprobs: tuple[dict[str, float], ...] = ()  # per token, sent where the request asks ``logprobs``


@dataclass
class SSEServer:
    script: Script = field(default_factory=Script)
    url: str = ""
    request_ids: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.bodies.append(await request.json())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._answer(request, self.script)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request, script: Script) -> web.StreamResponse:
        asked_logprobs = bool(self.bodies[-1].get("logprobs"))
        await asyncio.sleep(script.hang_s)
        if script.status != 200:
            return web.json_response({"error": {"message": "no capacity"}}, status=script.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(script.first_delay_s)
        for i, text in enumerate(script.tokens):
            if i == script.error_after:
                await _event(response, {"error": {"message": "KV transfer failed", "code": 500}})
                return response
            if i:
                await asyncio.sleep(script.gap_s)
            choice: dict[str, Any] = {"index": 0, "text": text}
            if asked_logprobs:  # vLLM's shape: one entry per token of the chunk
                top = script.top_logprobs[i]
                choice["logprobs"] = {"text_offset": [0], "token_logprobs": [top[text]], "tokens": [text],
                                      "top_logprobs": [top]}
            await _event(response, {"choices": [choice]})
        await _event(response, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(script.tokens)}})
        if script.done:
            await response.write(b"data: [DONE]\n\n")
        return response


async def _event(response: web.StreamResponse, doc: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(doc).encode() + b"\n\n")


@asynccontextmanager
async def sse_server(script: Script | None = None) -> AsyncIterator[SSEServer]:
    server = SSEServer(script or Script())
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    # aiohttp's test server cancels a handler whose client has gone, as vLLM aborts a request.
    async with test_utils.TestServer(app, host="127.0.0.1") as http:
        server.url = str(http.make_url("")).rstrip("/")
        yield server


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p-{i}", f"prompt number {i}") for i in range(n)]


async def _one(server: SSEServer, **kwargs: Any) -> Result:
    batch = await client.run_prompts(server.url, MODEL, _prompts(1), max_tokens=3, concurrency=1, **kwargs)
    assert len(batch.results) == 1
    return batch.results[0]


# ======================================================================== the client


@pytest.mark.asyncio
async def test_a_streamed_request_is_timed_token_by_token() -> None:
    async with sse_server(Script(first_delay_s=0.1, gap_s=0.05)) as server:
        r = await _one(server, tag="run1")
    assert r.ok and r.error is None
    assert (r.request_id, r.words, r.text, r.chunks) == ("p-0", 3, "Hello!", ["Hel", "lo", "!"])
    assert (r.prompt_tokens, r.output_tokens) == (7, 3)
    assert r.ttft_s is not None and r.tpot_s is not None and r.latency_s is not None
    assert r.ttft_s >= 0.1
    assert r.tpot_s > 0
    # The last token arrived no later than the end of the stream.
    assert r.ttft_s + r.tpot_s * (r.output_tokens - 1) <= r.latency_s + 1e-9
    assert r.latency_s >= 0.1 + 2 * 0.05
    assert server.request_ids == ["run1-p-0"]
    assert server.bodies == [client.request_body(MODEL, "prompt number 0", 3)]
    assert server.bodies[0]["stream"] is True and server.bodies[0]["ignore_eos"] is True


@pytest.mark.asyncio
async def test_asked_with_top_logprobs_each_tokens_candidates_are_kept() -> None:
    tops = ({"Hel": -1.0, "Hi": -1.0}, {"lo": -0.5, "p": -2.0}, {"!": -0.1, ".": -3.0})
    async with sse_server(Script(top_logprobs=tops)) as server:
        plain = await _one(server)
        asked = await _one(server, top_logprobs=2)
    assert "logprobs" not in server.bodies[0] and plain.top_logprobs == []
    assert server.bodies[1] == client.request_body(MODEL, "prompt number 0", 3, top_logprobs=2)
    assert server.bodies[1]["logprobs"] == 2
    assert asked.text == "Hello!" and asked.top_logprobs == list(tops)
    assert "top_logprobs" not in asked.to_json() and "chunks" not in asked.to_json()


@pytest.mark.asyncio
async def test_one_token_has_no_tpot_and_the_request_id_defaults_to_the_prompts() -> None:
    async with sse_server(Script(tokens=("x",))) as server:
        r = await _one(server)
    assert r.ok and r.output_tokens == 1 and r.tpot_s is None and r.ttft_s is not None
    assert server.request_ids == ["p-0"]


@pytest.mark.parametrize(
    ("script", "error"),
    [
        (Script(status=503), "HTTP 503: "),
        (Script(error_after=1), "KV transfer failed"),
        (Script(done=False), "the stream ended without [DONE]"),
        (Script(tokens=()), "the stream ended without a token"),
    ],
)
@pytest.mark.asyncio
async def test_failed_requests_say_why(script: Script, error: str) -> None:
    async with sse_server(script) as server:
        r = await _one(server)
    assert not r.ok
    assert r.error is not None and r.error.startswith(error)
    assert r.latency_s is not None


@pytest.mark.asyncio
async def test_an_error_after_a_token_keeps_what_came() -> None:
    async with sse_server(Script(error_after=2)) as server:
        r = await _one(server)
    assert r.error == "KV transfer failed"
    assert r.text == "Hello" and r.ttft_s is not None and r.output_tokens == 2


@pytest.mark.asyncio
async def test_a_request_past_its_timeout_fails() -> None:
    async with sse_server(Script(hang_s=5.0)) as server:
        r = await _one(server, timeout_s=0.2)
    assert r.error is not None and "Timeout" in r.error
    assert r.latency_s is not None and r.latency_s < 5.0


@pytest.mark.asyncio
async def test_a_refused_connection_fails() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    batch = await client.run_prompts(url, MODEL, _prompts(1), max_tokens=3, concurrency=1)
    assert batch.results[0].error is not None and batch.results[0].error.startswith("ClientConnectorError")


@pytest.mark.asyncio
async def test_a_batch_keeps_to_its_concurrency_and_the_prompt_order() -> None:
    finished: list[str] = []
    async with sse_server(Script(first_delay_s=0.1)) as server:
        batch = await client.run_prompts(server.url, MODEL, _prompts(7), max_tokens=3, concurrency=3,
                                         on_result=lambda r: finished.append(r.request_id))
    assert [r.request_id for r in batch.results] == [f"p-{i}" for i in range(7)]
    assert all(r.ok for r in batch.results)
    assert sorted(finished) == sorted(r.request_id for r in batch.results)
    assert server.most_in_flight == 3
    assert batch.wall_s >= 3 * 0.1  # three rounds of at most three


@pytest.mark.asyncio
async def test_after_max_failures_the_rest_is_skipped() -> None:
    async with sse_server(Script(status=500)) as server:
        batch = await client.run_prompts(server.url, MODEL, _prompts(5), max_tokens=3, concurrency=1,
                                         max_failures=2)
    assert len(server.request_ids) == 2
    assert [r.error for r in batch.results[2:]] == ["skipped after 2 failures"] * 3


def test_run_batch_runs_on_a_loop_of_its_own() -> None:
    async def serve_and_run() -> client.Batch:
        async with sse_server() as server:
            # run_batch makes its own loop: give it a thread, as a caller without a loop is.
            return await asyncio.to_thread(client.run_batch, server.url, MODEL, _prompts(2), max_tokens=3,
                                           concurrency=2, tag="t")

    results, wall_s = asyncio.run(serve_and_run())
    assert [r.text for r in results] == ["Hello!", "Hello!"] and wall_s > 0


def test_to_json_leaves_out_the_chunks() -> None:
    doc = Result("p-0", 2, text="ab", chunks=["a", "b"], output_tokens=2).to_json()
    assert "chunks" not in doc
    assert doc["text"] == "ab" and doc["output_tokens"] == 2 and doc["error"] is None


# ======================================================================== stats


def test_percentile_interpolates_between_ranks() -> None:
    assert stats.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert stats.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert stats.percentile([7.0], 90) == 7.0
    assert math.isnan(stats.percentile([], 50))


def test_summary_counts_only_successes_in_its_timings() -> None:
    results = [
        Result("a", 1, ttft_s=0.010, tpot_s=0.002, latency_s=0.1),
        Result("b", 1, ttft_s=0.030, tpot_s=0.004, latency_s=0.3),
        Result("c", 1, ttft_s=9.0, latency_s=9.0, error="HTTP 500: no"),
        Result("d", 1, ttft_s=0.020, latency_s=0.2),  # one token: no TPOT
    ]
    s = stats.summarize(results, wall_s=2.0)
    assert (s.n, s.failed, s.req_per_s) == (4, 1, 1.5)
    assert s.ttft_p50_ms == pytest.approx(20.0)
    assert s.ttft_p90_ms == pytest.approx(28.0)
    assert s.tpot_p50_ms == pytest.approx(3.0)
    assert s.latency_p50_ms == pytest.approx(200.0)
    assert stats.timings(results, "tpot_s") == [0.002, 0.004]
    empty = stats.summarize([], wall_s=0.0)
    assert empty.n == 0 and math.isnan(empty.ttft_p50_ms) and math.isnan(empty.req_per_s)


# ======================================================================== prompts


class _WordTokenizer:
    """A BOS plus one token per word: enough to check the token-count logic."""

    @dataclass
    class _Encoding:
        ids: list[int]

    def encode(self, text: str) -> _WordTokenizer._Encoding:
        return self._Encoding([0, *range(1, len(text.split()) + 1)])


def test_mixed_prompts_are_seeded_and_spread() -> None:
    a = prompts.mixed_prompts(12, prefix="demo")
    assert a == prompts.mixed_prompts(12, prefix="demo")
    assert [p.request_id for p in a] == [f"demo-{i:02d}" for i in range(12)]
    assert sorted(p.words for p in a) == sorted(prompts.word_counts(12))
    assert min(p.words for p in a) == prompts.SHORTEST_WORDS and max(p.words for p in a) == prompts.LONGEST_WORDS
    assert [p.words for p in a] != sorted(p.words for p in a)  # shuffled
    assert all(p.tokens is None for p in a)
    assert [p.words for p in prompts.mixed_prompts(1)] == [prompts.SHORTEST_WORDS]


def test_a_tokenizer_adds_token_counts() -> None:
    counted = prompts.mixed_prompts(4, tokenizer=_WordTokenizer())
    assert [p.text for p in counted] == [p.text for p in prompts.mixed_prompts(4)]
    assert [p.tokens for p in counted] == [p.words + 1 for p in counted]


def test_long_prompts_reach_their_token_targets() -> None:
    out = prompts.long_prompts(_WordTokenizer(), n=3, lo=100, hi=140)
    assert sorted(p.tokens or 0 for p in out) == [100, 120, 140]  # one token per word: exactly
    assert [p.request_id for p in out] == ["long-00", "long-01", "long-02"]
