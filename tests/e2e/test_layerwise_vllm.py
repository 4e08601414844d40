"""End to end with layer-wise push: vLLM P with ``layerwise_push`` on, D as usual, the proxy.

P's connector hands its daemon each request in the step that ends its prefill
(``SendStart``), every layer's KV as vLLM saves it (``LayerSaved``) and the end of the
forward pass (``StepSaved``); P's daemon WRITEs each layer of a request whose D
registration it holds while the later layers compute. What the tests show: greedy outputs
like colocated's, every push byte-identical (verify mode), every request pushed this way,
layers posted before the prefill's last one where D registered in time, and a request P
drops while its push runs leaves nothing behind.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import pytest

from helpers import (
    LEASE_S,
    PD,
    PREFILL_LEG_PARAMS,
    PDOptions,
    completion,
    generate_all,
    get_json,
    kv_usage,
    metric,
    open_post,
    scrape,
    tables,
    text_with_tokens,
    verify_results,
    wait_for,
    wait_kv_usage,
    wait_tables_zero,
)
from outputs import assert_like_colocated

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SETTLE_S = 15.0  # for what follows a finished request (P's push, the last engine steps)
LAYERS = 8  # the tiny Llama's: one LayerSaved per layer in each step that ends a prefill


# D's watchdog at the daemon's default: this module tests no watchdog, and its load (24
# prompts of up to 1500 tokens at concurrency 8, P's engine on one shared core at ~350
# prompt tokens/s) can keep a request queued at P for ~20 s, the other modules' watchdog,
# while D holds its registration.
DECODE_WATCHDOG_S = 120.0


@pytest.fixture(scope="module")
def pd_options() -> PDOptions:
    return PDOptions(flags={"prefill": ("--lease-s", str(LEASE_S)), "decode": ("--watchdog-s", str(DECODE_WATCHDOG_S))},
                     prefill_extra={"layerwise_push": True})


def _p_metric(pd: PD, name: str, **labels: str) -> float:
    return metric(scrape(pd.prefill_daemon.url), name, **labels) or 0.0


def test_outputs_match_colocated_and_each_request_is_pushed_layer_by_layer(pd: PD, tokenizer: Any) -> None:
    reqs = pd.requests.outputs
    assert len(reqs) >= 24
    before = {kind: _p_metric(pd, "pushsvc_worker_messages_total", type=kind)
              for kind in ("SendStart", "LayerSaved", "SendReady")}
    verified = (verify_results(pd.decode_daemon.url) or {}) if pd.verify else {}
    done = _p_metric(pd, "pushsvc_transfers_total", result="done")

    got = generate_all(pd.proxy.url, reqs, concurrency=8)

    assert_like_colocated(got, pd.refs, reqs, "the proxy (layer-wise push)", pd.logs)
    wait_for("P daemon's completed pushes", lambda: _p_metric(pd, "pushsvc_transfers_total", result="done") - done,
             lambda n: n >= len(reqs), SETTLE_S)
    delta = {kind: _p_metric(pd, "pushsvc_worker_messages_total", type=kind) - n for kind, n in before.items()}
    assert delta["SendStart"] == len(reqs) and delta["SendReady"] == 0, delta
    # At most 8 requests end their prefill in one step (concurrency 8), each such step says every layer.
    assert delta["LayerSaved"] >= LAYERS * math.ceil(len(reqs) / 8), delta
    if pd.verify:
        now = verify_results(pd.decode_daemon.url) or {}
        assert now.get("identical", 0) - verified.get("identical", 0) == len(reqs), now
        assert now.get("mismatch", 0) == verified.get("mismatch", 0), now
    # Where D's registration was at P before the forward pass ended, a layer went before
    # the last one: the transfer overlapped the prefill.
    timelines = get_json(f"{pd.prefill_daemon.url}/v1/requests?limit=256")["timelines"]
    mine = [t for t in timelines if "send_start" in t["events_ms"]]
    assert len(mine) >= len(reqs), [t["events_ms"] for t in timelines[:4]]
    assert all("prefill_done" in t["events_ms"] for t in mine), [t["events_ms"] for t in mine[:4]]
    overlapped = [t for t in mine if t["events_ms"]["write_posted"] < t["events_ms"]["prefill_done"]]
    assert overlapped, "no request had a layer posted before its prefill's last one"
    wait_tables_zero(pd.daemon_urls(), SETTLE_S)
    wait_kv_usage({"prefill": pd.prefill.url, "decode": pd.decode.url}, {"prefill": 0.0, "decode": 0.0}, SETTLE_S)


def test_a_request_p_drops_while_it_prefills_leaves_nothing_behind(pd: PD, tokenizer: Any) -> None:
    """A long prompt sent to P alone (no D ever registers), its client gone once P's daemon
    staged it: whether the abort lands during the forward pass (P's connector holds the
    blocks and evicts it) or after it (P's lease frees them), P's KV and both daemons'
    tables come back to idle, and nothing was written."""
    writes = _p_metric(pd, "pushsvc_write_parts_total")
    req = completion("dropped", pd.model, text_with_tokens(tokenizer, 1500, seed=7001)).with_body(
        max_tokens=1, kv_transfer_params=dict(PREFILL_LEG_PARAMS))
    sock = open_post(pd.prefill.url, req, f"e2e-dropped-{uuid.uuid4().hex[:8]}")
    try:
        wait_for("P daemon's staged request", lambda: tables(pd.prefill_daemon.url), lambda t: t["p_staged"] > 0, 30,
                 interval=0.01)
    finally:
        sock.close()
    wait_tables_zero(pd.daemon_urls(), 60)  # the lease (30 s) at the latest
    wait_kv_usage({"prefill": pd.prefill.url}, {"prefill": 0.0}, SETTLE_S)
    assert _p_metric(pd, "pushsvc_write_parts_total") == writes, "no D registered: nothing may be written"
    assert kv_usage(pd.prefill.url) == 0.0
    time.sleep(0.5)
    assert tables(pd.prefill_daemon.url)["p_staged"] == 0
