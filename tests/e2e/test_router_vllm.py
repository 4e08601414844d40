"""End to end: vLLM's own P/D router (``vllm-router``) in front of vLLM P and D with the
pushsvc connector, both unchanged.

The router is started as a user would start it for NIXL (``--vllm-pd-disaggregation
--kv-connector nixl``, P's and D's URLs); it knows nothing of pushsvc. It learns where D's
daemon must register from P's answer: P's connector returns ``transfer_mode: "push"`` and
its daemon's coordinates (``remote_engine_id``, ``remote_host``, ``remote_port``,
``tp_size``) in ``kv_transfer_params``. The router's first request goes to P, then to D
with those coordinates; the router keeps them per P, and sends every later request to P
and D at once. Neither leg carries our ``transfer_id`` (the router builds D's params
itself): P's daemon pairs D's registration with P's blocks by request id, which the router
makes unique per request (``___prefill_addr_..._<uuid>`` as ``X-Request-Id``).

Logprobs: vLLM computes a token's rank with ``batched_count_greater_than``
(``vllm/v1/sample/ops/logprobs.py``), under ``torch.compile`` even with
``--enforce-eager``. The first request with ``logprobs`` in an engine process compiles it
with Inductor (C++ code generation and a compiler run): 13 s on its own on this 2-core host
with an empty ``/tmp/torchinductor_<user>`` cache, 11-34 s inside a vLLM worker beside the
other engine. P's leg carries ``logprobs`` (behind any front), so the router's, or the
proxy's, first logprobs request waits for P's compile and D waits for P's KV meanwhile
(docs/routers.md). This module's P and D run with ``TORCH_COMPILE_DISABLE=1`` (the function
then runs eagerly, in microseconds), and the logprobs test checks that the first logprobs
requests these engines ever see answer about as fast as the same requests without logprobs:
it fails if the compile stall, or any other wait on the logprobs path, comes back.

One deployment serves the module, with colocated reference outputs (see conftest). The
tests run in file order: the first one sends the router's first request.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    PD,
    Outcome,
    PDOptions,
    Req,
    generate,
    generate_all,
    get_json,
    metric,
    scrape,
    wait_for,
    wait_kv_usage,
    wait_tables_zero,
)
from outputs import assert_like_colocated, assert_same_as_colocated
from relay import Relay

from pushsvc.launch import Proc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fronts import start_vllm_router  # noqa: E402 - the benchmark of both fronts starts the router the same way

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SETTLE_S = 15.0  # for P's pushes and the last engine steps after the answers
ROUTER_ID_PREFIX = "___prefill_addr_"  # vllm-router's X-Request-Id, inside vLLM's request ids
# A logprobs request may take this many times the same request without logprobs, plus
# LOGPROBS_SLACK_S: room for a loaded host, far below the 7-34 s of a compile stall.
LOGPROBS_FACTOR = 3.0
LOGPROBS_SLACK_S = 2.0


@pytest.fixture(scope="module")
def torch_compile_off() -> Iterator[None]:
    """The stack's vLLM servers run without torch.compile (module docstring: why)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_COMPILE_DISABLE", "1")  # read by the processes the stack spawns
        yield


@pytest.fixture(scope="module")
def pd_options(torch_compile_off: None) -> PDOptions:
    """conftest's default stack, started once ``torch_compile_off`` holds."""
    return PDOptions()


@pytest.fixture(scope="module")
def router(pd: PD) -> Proc:
    """vllm-router in front of the stack's P and D; stopped with the stack."""
    return start_vllm_router(pd.stack, "vllm-router", [pd.prefill], [pd.decode])


# ---------------------------------------------------------------------------- checks


def _transfers_done(pd: PD) -> float:
    return metric(scrape(pd.prefill_daemon.url), "pushsvc_transfers_total", result="done") or 0.0


def _prompt_tokens(pd: PD, source: str) -> float:
    """D's prompt tokens by where they came from: ``local_compute`` (D prefilled them),
    ``local_cache_hit``, ``external_kv_transfer`` (pushed from P)."""
    value = metric(scrape(pd.decode.url), "vllm:prompt_tokens_by_source_total", source=source)
    assert value is not None, f"D's /metrics has no vllm:prompt_tokens_by_source_total{{source={source!r}}}"
    return value


class KVFromP:
    """Around a block of requests: P's daemon completed one push per request, D received
    pushed prompt tokens and computed none itself (its ``local_compute`` count stays put)."""

    def __init__(self, pd: PD, requests: int) -> None:
        self.pd, self.requests = pd, requests

    def __enter__(self) -> KVFromP:
        self.computed = _prompt_tokens(self.pd, "local_compute")
        self.pushed = _prompt_tokens(self.pd, "external_kv_transfer")
        self.done = _transfers_done(self.pd)
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            return
        pd = self.pd
        wait_for("P daemon's completed pushes", lambda: _transfers_done(pd) - self.done,
                 lambda n: n >= self.requests, SETTLE_S)
        wait_for("D's prompt tokens from P", lambda: _prompt_tokens(pd, "external_kv_transfer") - self.pushed,
                 lambda n: n > 0, SETTLE_S)
        computed = _prompt_tokens(pd, "local_compute") - self.computed
        assert computed == 0, f"D prefilled {computed:.0f} prompt tokens itself\n{pd.logs()}"


def _assert_colocated(pd: PD, name: str, got: Outcome) -> None:
    assert_same_as_colocated(got, pd.refs[name], f"{name} through vllm-router", pd.logs)


def _newest_timeline(daemon_url: str) -> dict[str, Any]:
    timelines = get_json(f"{daemon_url}/v1/requests?limit=1")["timelines"]
    assert timelines, f"{daemon_url} has no request timeline"
    return timelines[0]


def _started(timeline: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(timeline["start"])


def _sent_at(relay: Relay, d: dict[str, Any]) -> datetime:
    """When the router sent D's leg of the request D's timeline ``d`` is of: its
    ``X-Request-Id`` (the middle of vLLM's request id) came through ``relay``."""
    router_id = ROUTER_ID_PREFIX + d["request_id"].split(ROUTER_ID_PREFIX, 1)[1].rsplit("-", 2)[0]
    at = relay.arrived(router_id)
    assert at is not None, f"no request with X-Request-Id {router_id} came through the relay to D"
    return datetime.fromtimestamp(at, timezone.utc)


def _pair(pd: PD) -> tuple[dict[str, Any], dict[str, Any]]:
    """P's and D's timelines of the last exchange, checked to be one pair of the router's."""
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)  # both closed
    p, d = _newest_timeline(pd.prefill_daemon.url), _newest_timeline(pd.decode_daemon.url)
    assert ROUTER_ID_PREFIX in d["request_id"], f"D's last request did not come from the router: {d}"
    assert p["outcome"] == "send_done" and d["outcome"] == "recv_done", (p, d)
    assert p.get("peer_request_id") == d["request_id"], f"P's push went to another D request: {p} {d}"
    return p, d


# ---------------------------------------------------------------------------- tests


def test_first_request_takes_ps_coordinates_from_ps_answer(pd: PD, router: Proc) -> None:
    """The router's first request: P first; D's leg carries the coordinates of P's daemon
    from P's answer; D registers with that daemon only after P has staged its blocks."""
    req = pd.req("cmpl-1024")
    with KVFromP(pd, 1):
        _assert_colocated(pd, req.name, generate(router.url, req))
    p, d = _pair(pd)
    assert _started(p) < _started(d), f"D registered before P staged its blocks: {p} {d}"


def test_later_requests_reach_p_and_d_at_once(pd: PD) -> None:
    """Once it knows P's coordinates (from its first request, which goes to P, then D),
    the router sends both legs of a request together (push mode's overlap): D's leg of a
    1500-token prompt left the router before P had prefilled it and staged its blocks. A
    router of its own reaches D through a relay that notes when the leg was sent; when D's
    daemon registered is no measure of the router on a shared host, where D's tokenizer,
    engine and worker step can take longer than P's prefill."""
    short, long_ = pd.req("later-30"), pd.req("cmpl-1500")
    with Relay(pd.decode.url) as relay:
        router = start_vllm_router(pd.stack, "vllm-router-relayed", [pd.prefill], [relay])
        try:
            with KVFromP(pd, 2):
                _assert_colocated(pd, short.name, generate(router.url, short))
                _assert_colocated(pd, long_.name, generate(router.url, long_))
            p, d = _pair(pd)
            sent = _sent_at(relay, d)
        finally:
            pd.stack.stop(router)
    late_ms = (sent - _started(p)).total_seconds() * 1e3
    assert late_ms < 0, f"D's leg was sent {late_ms:.1f} ms after P staged its blocks, not with P's: {p} {d}"


def test_burst_of_completions_and_chat_matches_colocated(pd: PD, router: Proc) -> None:
    """Greedy outputs through the router equal a colocated vLLM's for prompts of 5 to 1500
    tokens (each side of the 128-token block), completions and chat, streamed or not, sent
    16 at a time; every prompt's KV came from P."""
    reqs = [*pd.requests.outputs, *pd.requests.later]
    with KVFromP(pd, len(reqs)):
        got = generate_all(router.url, reqs, concurrency=16)
    assert_like_colocated(got, pd.refs, reqs, "vllm-router", pd.logs)
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, {"prefill": 0.0, "decode": 0.0}, SETTLE_S)


def test_prompt_as_token_ids_and_as_a_list(pd: PD, router: Proc, tokenizer: Any) -> None:
    """A prompt given as token ids, and two prompts in one request, through the router."""
    one = pd.req("cmpl-640")
    ids = tokenizer(one.body["prompt"])["input_ids"]
    with KVFromP(pd, 1):
        _assert_colocated(pd, one.name, generate(router.url, one.with_body(prompt=ids)))

    a, b = pd.req("cmpl-257"), pd.req("cmpl-900")
    with KVFromP(pd, 2):
        got = generate(router.url, a.with_body(prompt=[a.body["prompt"], b.body["prompt"]]))
        assert got.ok, f"{got}\n{pd.logs()}"
        choices = sorted(got.body["choices"], key=lambda c: c["index"])
        assert [c["token_ids"] for c in choices] == [pd.refs[a.name].tokens, pd.refs[b.name].tokens], choices


def _logprobs_cases(pd: PD) -> list[tuple[Req, Req]]:
    """(a request without logprobs, the same request with logprobs)."""
    cmpl, chat_, stream = pd.req("later-300"), pd.req("chat-40"), pd.req("cmpl-stream-60")
    return [
        (cmpl, cmpl.with_body(logprobs=2)),
        (chat_, chat_.with_body(logprobs=True, top_logprobs=2)),
        (stream, stream.with_body(logprobs=1)),
    ]


def _logprobs_entries(req: Req, got: Outcome) -> int | None:
    """How many tokens of a non-streamed answer carry logprobs (None for a stream)."""
    if req.stream:
        return None
    choice = got.body["choices"][0]
    if "messages" in req.body:
        return len(choice["logprobs"]["content"])
    return len(choice["logprobs"]["token_logprobs"])


def test_logprobs_answer_as_promptly_as_other_requests(pd: PD, router: Proc) -> None:
    """The first logprobs requests these engines see (completions, chat, streamed) answer
    within LOGPROBS_FACTOR times the same request without logprobs plus LOGPROBS_SLACK_S,
    with colocated tokens and one logprobs entry per generated token (the router merges
    P's answer into D's: P's own token must not show up)."""
    for plain, with_logprobs in _logprobs_cases(pd):
        with KVFromP(pd, 2):
            base = generate(router.url, plain)
            _assert_colocated(pd, plain.name, base)
            got = generate(router.url, with_logprobs)
            bound = LOGPROBS_FACTOR * base.elapsed_s + LOGPROBS_SLACK_S
            assert got.elapsed_s <= bound, (
                f"{plain.name} with logprobs: {got} through vllm-router, the same request without logprobs "
                f"took {base.elapsed_s:.2f}s (bound {bound:.2f}s): a wait on the logprobs path, e.g. vLLM "
                f"compiling batched_count_greater_than (TORCH_COMPILE_DISABLE not reaching vLLM?)\n{pd.logs()}")
            _assert_colocated(pd, plain.name, got)
        entries = _logprobs_entries(with_logprobs, got)
        assert entries in (None, with_logprobs.body["max_tokens"]), f"{plain.name}: {entries} logprobs entries"
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)
