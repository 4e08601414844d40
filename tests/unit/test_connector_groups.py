"""Hybrid KV caches: which groups and blocks a transfer carries (groups.py), built from
vLLM's own KV-cache config classes, and what the scheduler side sends with them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_connector_scheduler import Blocks, Req, Status, d_params
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from pushsvc_connector.connector import transfer_groups
from pushsvc_connector.groups import NULL_BLOCK, TransferGroups
from pushsvc_connector.kvshare import grouped
from pushsvc_connector.kvlayout import regions_of
from pushsvc_connector.scheduler import PushScheduler

BS = 16


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)


def _window(tokens: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.bfloat16,
                             sliding_window=tokens)


def _config(*groups: tuple[list[str], object]) -> KVCacheConfig:
    # The tensors' placement is the worker's business (regions); the groups are what counts here.
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def gemma_like() -> KVCacheConfig:
    """Two sliding-window groups of 32 tokens and one full-attention group, as vLLM's hybrid
    manager groups a 6-layer model with two sliding layers per full one."""
    return _config((["l0", "l3"], _window(32)), (["l1", "l4"], _window(32)), (["l2", "l5"], _full()))


def test_one_full_attention_group_carries_every_block_unchanged() -> None:
    groups = transfer_groups(_config((["l0", "l1"], _full())))
    assert groups == TransferGroups() and not groups.hybrid
    assert groups.clip([[7, 3, 9]]) == [[7, 3, 9]]
    assert groups.clip([]) == [[]]
    assert transfer_groups(None) == TransferGroups()


def test_sliding_window_groups_keep_the_window_and_drop_vllms_null_blocks() -> None:
    groups = transfer_groups(gemma_like())
    # 32 tokens of window over 16-token blocks: 2 blocks, plus one for a window that
    # straddles a block edge.
    assert groups.keep == (3, 3, 0) and groups.hybrid
    assert groups.layer_group == {"l0": 0, "l3": 0, "l1": 1, "l4": 1, "l2": 2, "l5": 2}
    p_lists = [[NULL_BLOCK] * 5 + [11, 12, 13], [NULL_BLOCK] * 6 + [21, 22], list(range(30, 38))]
    assert groups.clip(p_lists) == [[11, 12, 13], [21, 22], list(range(30, 38))]
    # A prompt shorter than the window: nothing to drop.
    assert groups.clip([[4], [5], [6]]) == [[4], [5], [6]]


def test_only_the_groups_vllm_transfers_are_carried_in_its_order() -> None:
    config = gemma_like()
    config.kv_cache_groups[1].enable_kv_transfer = False
    vars(config).pop("transfer_group_ids", None)  # cached_property: recomputed
    groups = transfer_groups(config)
    assert groups.group_ids == (0, 2) and groups.keep == (3, 0)
    assert groups.clip([[1, 2], [3], [4, 5]]) == [[1, 2], [4, 5]]
    assert groups.group_of("l1") is None and groups.group_of("l5") == 1


def test_group_kinds_the_daemon_cannot_carry_are_refused_by_name() -> None:
    mamba = MambaSpec(block_size=BS, shapes=((4, 4),), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match="MambaSpec"):
        transfer_groups(_config((["l0"], _full()), (["m1"], mamba)))


def test_each_region_names_its_layers_group_and_untransferred_layers_stay_out() -> None:
    groups = TransferGroups((0, 2), (3, 0), {"a": 0, "c": 1})
    t = torch.zeros(2, 64, BS, 2, 16, dtype=torch.bfloat16)  # FlashAttention-style: K and V regions
    regions = [r for name in ("a", "b", "c") for r in regions_of(name, t, 0, 0, 64)]
    out = grouped(regions, groups)
    assert [(r.layer_names[0], r.group) for r in out] == [("a", 0), ("a", 0), ("c", 1), ("c", 1)]
    assert grouped(regions, TransferGroups()) == regions
    with pytest.raises(ValueError, match="no KV layer"):
        grouped(regions, TransferGroups((0,), (3,), {"z": 0}))


def test_d_registers_and_p_sends_per_group_lists_clipped_alike() -> None:
    groups = transfer_groups(gemma_like())
    d = PushScheduler(watchdog_s=30.0, lease_s=20.0, groups=groups)
    req = Req("d1", d_params())
    # D allocated no real blocks before the window (vLLM's null placeholders).
    d.update_state_after_alloc(req, Blocks([[0, 0, 0, 41, 42], [0, 0, 51, 52, 53], [61, 62, 63, 64, 65]]), 300)
    reg = d.build_connector_meta(1).recvs["d1"]
    assert reg.local_block_ids == [[41, 42], [51, 52, 53], [61, 62, 63, 64, 65]]

    p = PushScheduler(watchdog_s=30.0, lease_s=20.0, groups=groups)
    done = Req("p1", {"do_remote_decode": True}, status=Status.FINISHED_LENGTH_CAPPED)
    hold, params = p.request_finished(done, ([0, 0, 7, 8, 9], [0, 0, 17, 18, 19], [1, 2, 3, 4, 5]))
    assert hold and params is not None and params["transfer_mode"] == "push"
    ready = p.build_connector_meta(1).sends["p1"]
    assert ready.block_ids == [[7, 8, 9], [17, 18, 19], [1, 2, 3, 4, 5]]


def _vllm_request(rid: str, tokens: int, params: dict) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=list(range(tokens)),
                   sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   pooling_params=None)


def test_with_a_sliding_window_p_leaves_the_last_prompt_token_to_d_once() -> None:
    """D recomputes the prompt's last token after the load, and its window reaches one
    token further back than P's last one did: P stops one token short and D loads one
    token fewer, so both sides keep (and P sends) the block that token reads."""
    groups = transfer_groups(gemma_like())
    assert groups.backoff == 1 and TransferGroups().backoff == 0
    p = PushScheduler(watchdog_s=30.0, lease_s=20.0, groups=groups)
    req = _vllm_request("p1", 255, {"do_remote_decode": True})
    assert req.kv_transfer_params is not None
    p.on_new_request(req)
    assert req.num_prompt_tokens == 254 and len(req.prompt_token_ids) == 254 and req.num_tokens == 254
    p.on_new_request(req)  # a preempted request comes back: not cut again
    assert req.num_prompt_tokens == 254
    plain = _vllm_request("p2", 255, {"do_remote_decode": True})
    PushScheduler(watchdog_s=30.0, lease_s=20.0).on_new_request(plain)  # no sliding window: untouched
    assert plain.num_prompt_tokens == 255
    d_side = _vllm_request("d1", 255, d_params())
    p.on_new_request(d_side)  # not a prefill for a remote decode: untouched
    assert d_side.num_prompt_tokens == 255

    d = PushScheduler(watchdog_s=30.0, lease_s=20.0, groups=groups)
    assert d.get_num_new_matched_tokens(Req("d1", d_params(), prompt_token_ids=list(range(255))), 0) == (254, True)
    assert d.get_num_new_matched_tokens(Req("d2", d_params(), prompt_token_ids=[7]), 0) == (0, False)


def test_a_d_prefix_hit_of_all_but_the_last_token_loads_nothing_and_releases_p() -> None:
    """With a sliding window D loads one token fewer than the prompt, so its prefix hit on
    all but the last token (vLLM never hits that one) leaves nothing to load: D computes
    the request itself, and P, holding its blocks for the exchange, hears so at once."""
    d = PushScheduler(watchdog_s=30.0, lease_s=20.0, groups=transfer_groups(gemma_like()))
    req = Req("d1", d_params(transfer_id="xchg-1"), prompt_token_ids=list(range(257)))
    assert d.get_num_new_matched_tokens(req, 256) == (0, False)
    d.update_state_after_alloc(req, Blocks([[0, 71], [0, 72], [73, 74]]), 0)
    meta = d.build_connector_meta(1)
    assert meta.recvs == {}
    [release] = meta.releases
    assert (release.request_id, release.local_block_ids, release.match_key) == ("d1", [], "xchg-1")
    req.status = Status.FINISHED_STOPPED
    assert d.request_finished(req, ([0, 71], [0, 72], [73, 74])) == (False, None)
    assert d.build_connector_meta(1).empty and not d.has_pending_push_work()
