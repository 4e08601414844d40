"""End to end with a hybrid model: vLLM's hybrid KV-cache manager stays on through P/D.

A tiny Gemma-3 text model (6 layers: two of sliding-window attention, 128 tokens, then one
of full attention, twice) is served by vLLM CPU with three KV-cache groups: two
sliding-window groups and one full-attention group. The connector is ``SupportsHMA``, so
vLLM keeps its hybrid manager on for P and D; each request's KV goes as three per-group
block lists, the sliding-window groups carrying only the blocks their window still reads.
The reference outputs come from a colocated vLLM with the hybrid manager *off* (every
layer keeps every block), so equal outputs also show that the blocks D does not receive
are blocks D never reads: one request at a time (each side), every output equals
colocated's, except that a token, the first one included, may differ where colocated's
own logprobs for the two tokens were within ``NEAR_TIE`` nats (D computes each prompt's
last token alone over P's KV, so its bf16 sums round differently; ``outputs.py``). Eight
at a time, a batch's make-up changes the rounding too, so there the tests check only that
every push lands byte-identical. The same runs
measure the KV memory D saves: vLLM's own KV-cache capacity, in tokens, of the two (same
KV memory, ``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import kept_on_failure
from helpers import (
    COMPLETIONS,
    KV_ELEMENT_BYTES,
    PROMPT_LENGTHS,
    E2EStack,
    Outcome,
    Req,
    assert_pushes_identical,
    build_requests,
    completion,
    generate,
    generate_all,
    get_json,
    metric,
    scrape,
    text_with_tokens,
    verify_results,
    wait_for,
    wait_tables_zero,
)
from outputs import NEAR_TIE, assert_all_ok, differences_at_ties

from pushsvc.launch import Proc, connector_config
from pushsvc.tinymodel import ensure_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL_DIR = "/tmp/pushsvc-e2e-gemma3"
WINDOW = 128  # tokens of each sliding-window layer: one vLLM CPU block
BLOCK = 128  # vLLM CPU's KV block size (tokens)
LAYERS, KV_HEADS, HEAD_DIM = 6, 2, 64
GROUP_BLOCK_BYTES = 2 * 2 * BLOCK * KV_HEADS * HEAD_DIM * KV_ELEMENT_BYTES  # 2 layers a group, K and V
SETTLE_S = 15.0
HMA_OFF = "Turning off hybrid kv cache manager"


@dataclass
class HybridPD:
    model: str
    tokenizer: Any
    refs: dict[str, Outcome]
    reqs: list[Req]  # compared with colocated, one at a time
    batch: list[Req]  # other prompts of the same lengths (no prefix-cache hit), eight at a time
    colocated_capacity: int
    prefill_daemon: Proc
    decode_daemon: Proc
    prefill: Proc
    decode: Proc
    proxy: Proc
    stack: E2EStack

    def logs(self, n: int = 30) -> str:
        return self.stack.logs(n)


def kv_capacity_tokens(log: Path) -> int:
    """vLLM's KV-cache capacity in tokens, from its start-up log ("... KV cache size:
    N tokens")."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    assert found, f"no KV cache size in {log}"
    return int(found[-1].replace(",", ""))


@pytest.fixture(scope="module")
def hybrid(request: pytest.FixtureRequest) -> Iterator[HybridPD]:
    from transformers import AutoTokenizer

    path = ensure_tiny_model(MODEL_DIR, family="gemma3", layers=LAYERS, hidden=256, heads=4, kv_heads=KV_HEADS,
                             window=WINDOW)
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The prompts of the P/D suite, as plain completions that also return their five best
    # tokens at each step (a difference is then judged against colocated's own margin).
    reqs = [r.with_body(logprobs=5, return_tokens_as_token_ids=True) for r in build_requests(tokenizer, path).outputs
            if r.path == COMPLETIONS and not r.body.get("stream")]
    batch = [completion(f"hybrid8-{n}", path, text_with_tokens(tokenizer, n, seed=7200 + i))
             for i, n in enumerate(PROMPT_LENGTHS)]
    with kept_on_failure(request) as workdir, E2EStack(workdir, progress=print, vllm_log_level="INFO") as st:
        colocated = st.vllm("vllm-colocated", path, extra=("--disable-hybrid-kv-cache-manager",))
        refs = generate_all(colocated.url, reqs, concurrency=1)
        bad = {r.name: str(refs[r.name]) for r in reqs if not refs[r.name].ok}
        assert not bad, f"colocated reference requests failed: {bad}\n{colocated.tail()}"
        capacity = kv_capacity_tokens(colocated.log)
        st.stop(colocated)
        pdaemon = st.daemon("prefill", "--verify")
        ddaemon = st.daemon("decode", "--verify")
        prefill = st.vllm("vllm-p", path, kv_transfer_config=connector_config("kv_producer", pdaemon), cpus="0")
        decode = st.vllm("vllm-d", path, kv_transfer_config=connector_config("kv_consumer", ddaemon), cpus="1")
        proxy = st.proxy("proxy", prefill=[prefill], prefill_daemons=[pdaemon], decode=[decode])
        yield HybridPD(path, tokenizer, refs, reqs, batch, capacity, pdaemon, ddaemon, prefill, decode, proxy, st)


def _pushed_bytes(pd: HybridPD) -> float:
    return metric(scrape(pd.prefill_daemon.url), "pushsvc_transfer_bytes_total") or 0.0


def _done(pd: HybridPD) -> float:
    return metric(scrape(pd.prefill_daemon.url), "pushsvc_transfers_total", result="done") or 0.0


def test_the_hybrid_manager_stays_on_with_three_groups_registered(hybrid: HybridPD) -> None:
    for server in (hybrid.prefill, hybrid.decode):
        assert HMA_OFF not in server.log.read_text(errors="replace"), f"{server.name} turned the hybrid manager off"
    for daemon in (hybrid.prefill_daemon, hybrid.decode_daemon):
        agents = get_json(f"{daemon.url}/v1/info")["agents"]
        # Every layer in exactly one of the three groups, one region each (vLLM CPU keeps a
        # block's K and V side by side).
        assert [(a["kv_groups"], a["regions"]) for a in agents] == [(3, LAYERS)], agents


def _push_all(pd: HybridPD, reqs: list[Req], concurrency: int) -> dict[str, Outcome]:
    """``reqs`` through the proxy, ``concurrency`` at a time; each one succeeded, P's
    daemon counted a push done for each and D's found each byte-identical."""
    verified_before = verify_results(pd.decode_daemon.url) or {}
    done_before = _done(pd)
    got = generate_all(pd.proxy.url, reqs, concurrency=concurrency)
    assert_all_ok(got, "the proxy", pd.logs)
    wait_for("P daemon's completed pushes", lambda: _done(pd) - done_before, lambda n: n >= len(reqs), SETTLE_S)
    assert_pushes_identical(pd.decode_daemon.url, verified_before, len(reqs), SETTLE_S)
    wait_tables_zero({"prefill": pd.prefill_daemon.url, "decode": pd.decode_daemon.url}, SETTLE_S)
    return got


def test_outputs_match_colocated_and_every_push_verifies(hybrid: HybridPD) -> None:
    got = _push_all(hybrid, hybrid.reqs, concurrency=1)
    report, not_ties = differences_at_ties(hybrid.reqs, got, hybrid.refs, NEAR_TIE)
    print(f"{len(hybrid.reqs) - len(report)} of {len(hybrid.reqs)} outputs equal colocated; the others:",
          *report, sep="\n  ")
    assert not not_ties, f"outputs differ from colocated beyond a near-tie: {not_ties}"


def test_pushes_eight_at_a_time_verify(hybrid: HybridPD) -> None:
    """Prompts of the same lengths eight at a time: the three groups' block lists of many
    requests interleave, and every push still lands byte-identical."""
    _push_all(hybrid, hybrid.batch, concurrency=8)


def test_sliding_window_groups_push_only_the_blocks_their_window_reads(hybrid: HybridPD) -> None:
    """A 1200-token prompt (P computes 1199 of them, D the last): 10 blocks. The
    full-attention group carries all 10; each sliding-window group only the blocks its
    128-token window reads at the prompt's end (the last block and the one before it).
    Without the hybrid manager every group would carry 10."""
    prompt_tokens = 1200
    req = completion("hybrid-long", hybrid.model, text_with_tokens(hybrid.tokenizer, prompt_tokens, seed=7101))
    before, done_before = _pushed_bytes(hybrid), _done(hybrid)
    out = generate(hybrid.proxy.url, req)
    assert out.ok, f"{out}\n{hybrid.logs()}"
    wait_for("the push", lambda: _done(hybrid) - done_before, lambda n: n >= 1, SETTLE_S)
    pushed = _pushed_bytes(hybrid) - before
    blocks = -(-prompt_tokens // BLOCK)
    full_group = blocks * GROUP_BLOCK_BYTES
    window_blocks = -(-WINDOW // BLOCK) + 1
    assert pushed == full_group + 2 * window_blocks * GROUP_BLOCK_BYTES, (
        f"pushed {pushed} bytes: {pushed / GROUP_BLOCK_BYTES:.1f} group blocks, expected {blocks} + 2 x {window_blocks}")
    print(f"1200-token prompt: {pushed / 2**20:.2f} MiB pushed, {3 * full_group / 2**20:.2f} MiB without the "
          "hybrid manager")


def test_d_holds_more_tokens_in_the_same_kv_memory(hybrid: HybridPD) -> None:
    """vLLM sizes its KV cache from the same memory on both runs: with the hybrid manager
    on, sliding-window layers hold only their window, so the same memory holds more tokens."""
    on = kv_capacity_tokens(hybrid.decode.log)
    print(f"KV-cache capacity in the same memory: {on} tokens with the hybrid manager (D), "
          f"{hybrid.colocated_capacity} without (colocated): x{on / hybrid.colocated_capacity:.2f}")
    assert on > hybrid.colocated_capacity
