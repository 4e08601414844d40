"""End to end with multi-head latent attention (MLA): a tiny DeepSeek-V2 through P/D.

vLLM CPU serves it with its ``CPU_MLA`` backend (asked for: on a CPU with AMX tiles vLLM
would pick AMX_MLA): per token one latent row (``kv_lora_rank`` 512 + ``qk_rope_head_dim``
64 = 576 values of the servers' dtype, ``vllm_dtype``) that every head reads, one region
per layer, no K/V split. What the tests show:

* every push is byte-identical at D (verify mode: digests of P's blocks against D's blocks
  after the push), and a request moves exactly its blocks of latent rows;
* where D's greedy output differs from colocated's, it differs at a near-tie: at the first
  differing position colocated's own two best tokens are within ``NEAR_TIE`` nats of each
  other and D took colocated's second one. D computes the prompt's last token again on the
  pushed KV (vLLM's P/D always does); for MLA that step runs MLA's decode path (attention
  in the latent space, the up-projections absorbed into the query and output), where
  colocated ran the prefill path (K and V expanded from the latents): equal in exact
  arithmetic, rounded differently in bf16. A misplaced block would instead change the
  tokens wherever it is read, near-tie or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import kept_on_failure
from helpers import (
    CPU_MLA,
    KV_ELEMENT_BYTES,
    PROMPT_LENGTHS,
    E2EStack,
    Outcome,
    Req,
    assert_pushes_identical,
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

MODEL_DIR = "/tmp/pushsvc-e2e-dsv2"
LAYERS = 4
LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim
BLOCK = 16  # vLLM CPU forces 16-token blocks for MLA models
SETTLE_S = 15.0


@dataclass
class MlaPD:
    model: str
    tokenizer: Any
    reqs: list[Req]
    refs: dict[str, Outcome]
    prefill_daemon: Proc
    decode_daemon: Proc
    proxy: Proc
    stack: E2EStack

    def logs(self, n: int = 30) -> str:
        return self.stack.logs(n)


def _with_logprobs(req: Req) -> Req:
    return req.with_body(logprobs=2, return_tokens_as_token_ids=True)


@pytest.fixture(scope="module")
def mla(request: pytest.FixtureRequest) -> Iterator[MlaPD]:
    from transformers import AutoTokenizer

    path = ensure_tiny_model(MODEL_DIR, family="deepseek_v2", layers=LAYERS, hidden=256, heads=4)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reqs = [_with_logprobs(completion(f"mla-{n}", path, text_with_tokens(tokenizer, n, seed=5000 + i)))
            for i, n in enumerate(PROMPT_LENGTHS)]
    with kept_on_failure(request) as workdir, E2EStack(workdir, progress=print, vllm_log_level="INFO") as st:
        colocated = st.vllm("vllm-colocated", path, extra=CPU_MLA)
        refs = generate_all(colocated.url, reqs, concurrency=1)
        bad = {r.name: str(refs[r.name]) for r in reqs if not refs[r.name].ok}
        assert not bad, f"colocated reference requests failed: {bad}\n{colocated.tail()}"
        assert "CPU_MLA" in colocated.log.read_text(errors="replace"), "vLLM did not pick its MLA backend"
        st.stop(colocated)
        pdaemon = st.daemon("prefill", "--verify")
        ddaemon = st.daemon("decode", "--verify")
        prefill = st.vllm("vllm-p", path, kv_transfer_config=connector_config("kv_producer", pdaemon), cpus="0",
                          extra=CPU_MLA)
        decode = st.vllm("vllm-d", path, kv_transfer_config=connector_config("kv_consumer", ddaemon), cpus="1",
                         extra=CPU_MLA)
        proxy = st.proxy("proxy", prefill=[prefill], prefill_daemons=[pdaemon], decode=[decode])
        yield MlaPD(path, tokenizer, reqs, refs, pdaemon, ddaemon, proxy, st)


def _done(pd: MlaPD) -> float:
    return metric(scrape(pd.prefill_daemon.url), "pushsvc_transfers_total", result="done") or 0.0


def test_each_layer_is_one_region_of_latent_rows(mla: MlaPD) -> None:
    for daemon in (mla.prefill_daemon, mla.decode_daemon):
        agents = get_json(f"{daemon.url}/v1/info")["agents"]
        assert [(a["kv_groups"], a["regions"]) for a in agents] == [(1, LAYERS)], agents
    prompt_tokens = 1200
    req = completion("mla-long", mla.model, text_with_tokens(mla.tokenizer, prompt_tokens, seed=5101))
    before = metric(scrape(mla.prefill_daemon.url), "pushsvc_transfer_bytes_total") or 0.0
    done_before = _done(mla)
    out = generate(mla.proxy.url, req)
    assert out.ok, f"{out}\n{mla.logs()}"
    wait_for("the push", lambda: _done(mla) - done_before, lambda n: n >= 1, SETTLE_S)
    pushed = (metric(scrape(mla.prefill_daemon.url), "pushsvc_transfer_bytes_total") or 0.0) - before
    assert pushed == -(-prompt_tokens // BLOCK) * LAYERS * BLOCK * LATENT * KV_ELEMENT_BYTES


def test_pushes_verify_and_d_differs_from_colocated_only_at_near_ties(mla: MlaPD) -> None:
    verified_before = verify_results(mla.decode_daemon.url) or {}
    got = generate_all(mla.proxy.url, mla.reqs, concurrency=1)
    assert_all_ok(got, "the proxy", mla.logs)
    assert_pushes_identical(mla.decode_daemon.url, verified_before, len(mla.reqs), SETTLE_S)
    report, not_ties = differences_at_ties(mla.reqs, got, mla.refs, NEAR_TIE)
    print(f"{len(mla.reqs) - len(report)} of {len(mla.reqs)} outputs equal colocated; the others:",
          *report, sep="\n  ")
    assert not not_ties, f"outputs differ from colocated beyond a near-tie: {not_ties}"
    wait_tables_zero({"prefill": mla.prefill_daemon.url, "decode": mla.decode_daemon.url}, SETTLE_S)
