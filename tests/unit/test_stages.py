"""Pairing a pipeline stage's regions with D's by layer name (``state/stages.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.errors import LayoutError
from pushsvc.state.layout import Layout, RegionSpec, descriptor_table, plan_write
from pushsvc.state.stages import coverage, keys, order, stage_view
from pushsvc_connector.kvlayout import regions_of


def _kv(layers: range) -> tuple[tuple[str, ...], ...]:
    """K and V regions of each layer, as vLLM's FlashAttention layout gives them."""
    return keys([f"model.layers.{i}.self_attn"] for i in layers for _ in range(2))


def test_a_stage_takes_d_s_regions_of_its_layers_in_its_own_order() -> None:
    d = _kv(range(4))
    assert order(d, _kv(range(2, 4))) == (4, 5, 6, 7)
    # The k-th region of a layer pairs with D's k-th of it (K with K, V with V).
    assert order(d, keys([["model.layers.3.self_attn"], ["model.layers.1.self_attn"]] * 2)) == (6, 2, 7, 3)


def test_a_stage_region_d_lacks_or_holds_fewer_of_is_refused_by_name() -> None:
    with pytest.raises(LayoutError, match=r"D has no region of layer model.layers.4.self_attn"):
        order(_kv(range(4)), _kv(range(3, 5)))
    with pytest.raises(LayoutError, match=r"D has only 1 region of layer l0, the stage writes 2"):
        order(keys([["l0"], ["l1"]]), keys([["l0"], ["l0"]]))


def test_regions_without_layer_names_cannot_be_routed() -> None:
    with pytest.raises(LayoutError, match=r"region 1 of D names no layer"):
        order(keys([["a"], []]), keys([["a"]]))
    with pytest.raises(LayoutError, match=r"region 0 of the stage names no layer"):
        order(keys([["a"]]), keys([[]]))


def test_stage_view_selects_the_regions_and_checks_the_names_fit_the_layout() -> None:
    layout = Layout(tuple(RegionSpec(base=i * 1000, block_len=10, num_blocks=8, stride=10) for i in range(4)), 2)
    view = stage_view(layout, keys([["a"], ["b"], ["c"], ["d"]]), keys([["c"], ["a"]]))
    assert [r.base for r in view.regions] == [2000, 0] and view.blocks_per_logical == 2
    with pytest.raises(LayoutError, match=r"names the layers of 3 regions, its layout has 4"):
        stage_view(layout, keys([["a"], ["b"], ["c"]]), keys([["a"]]))


def test_coverage_wants_every_layer_of_d_in_exactly_one_stage() -> None:
    d = _kv(range(4))
    assert coverage(d, [_kv(range(2)), _kv(range(2, 4))]) == ""
    assert coverage(d, [_kv(range(2)), _kv(range(2, 3))]) == (
        "layer model.layers.3.self_attn is held by none of P's 2 pipeline stages")
    assert coverage(d, [_kv(range(3)), _kv(range(2, 4))]) == "layer model.layers.2.self_attn is held by P's pipeline stages 0, 1"
    assert coverage(keys([["a"], []]), [keys([["a"]])]) == (
        "region 1 of D names no layer: a pipeline-parallel P pairs regions by layer name")
    assert coverage(_kv(range(2)), [_kv(range(4))]) == "", "layers only P holds are the push's to refuse"


@given(st.integers(1, 6), st.integers(1, 4), st.randoms(use_true_random=False))
def test_stages_that_split_the_layers_between_them_cover_d_and_pair_each_region_once(layers, stages, rnd) -> None:
    d = _kv(range(layers))
    cuts = sorted(rnd.sample(range(1, layers), min(stages - 1, layers - 1))) if layers > 1 else []
    bounds = [0, *cuts, layers]
    parts = [tuple(rnd.sample(r, len(r))) for r in (_kv(range(a, b)) for a, b in zip(bounds, bounds[1:]))]
    assert coverage(d, parts) == ""
    chosen = [i for part in parts for i in order(d, part)]
    assert sorted(chosen) == list(range(len(d))), "every region of D written by exactly one stage region"
    for part in parts:
        assert [d[i] for i in order(d, part)] == list(part)


def _packed_layout(t: torch.Tensor, layers: range, base: int) -> tuple[Layout, tuple[tuple[str, ...], ...]]:
    """What the connector registers of a packed MLA cache ``t`` (``[blocks, layers,
    block_size, 576]``, holding ``layers``; vLLM hands each layer as a view of it) placed
    at ``base``."""
    names = {f"model.layers.{layer}.self_attn": t[:, i] for i, layer in enumerate(layers)}
    regions = [r for name, view in names.items()
               for r in regions_of(name, view, 0, view.data_ptr() - t.data_ptr(), t.shape[0], replicated=True)]
    layout = Layout(tuple(RegionSpec(base + r.offset, r.block_len, r.num_blocks, r.stride, r.group, r.heads,
                                     r.replicated) for r in regions))
    return layout, keys(r.layer_names for r in regions)


def test_packed_mla_rows_each_stage_page_lands_in_its_layers_slot_of_ds_row() -> None:
    """Packed MLA caches keep each block's pages of every layer in one row. The connector
    registers a layer's page as its own region (the row is its block stride), so a stage's
    rows, shorter and with each layer at another offset, pair with D's rows page by page:
    each of the stage's pages goes to its layer's slot of D's row, nothing else moves."""
    page_elems, block_size = 576, 2
    d = torch.zeros(6, 4, block_size, page_elems, dtype=torch.bfloat16)  # D: 6 blocks, layers 0-3
    stage = torch.zeros(5, 2, block_size, page_elems, dtype=torch.bfloat16)  # stage 1: 5 blocks, layers 2-3
    d_base, s_base = 1 << 20, 0
    d_layout, d_keys = _packed_layout(d, range(4), d_base)
    s_layout, s_keys = _packed_layout(stage, range(2, 4), s_base)
    page = block_size * page_elems * 2
    assert [(r.base - d_base, r.block_len, r.stride) for r in d_layout.regions] == [
        (i * page, page, 4 * page) for i in range(4)]
    view = stage_view(d_layout, d_keys, s_keys)
    rng = np.random.default_rng(7)
    mem = rng.integers(0, 256, d_base + d.numel() * 2, dtype=np.uint8)
    before = mem.copy()
    p_blocks, d_blocks = [[4, 0, 2]], [[1, 5, 3]]
    plan = plan_write(s_layout, view, p_blocks, d_blocks)
    src, dst = descriptor_table(s_layout), descriptor_table(view)
    for s, t in zip(plan.src_indices, plan.dst_indices):
        (sa, sl, _), (da, dl, _) = (tuple(int(x) for x in row) for row in (src[s], dst[t]))
        assert sl == dl == page, "one descriptor per page"
        mem[da:da + dl] = mem[sa:sa + sl]
    changed = np.flatnonzero(mem != before)
    want = set()
    for local, layer in enumerate((2, 3)):
        for pb, db in zip(p_blocks[0], d_blocks[0]):
            slot = d_base + db * 4 * page + layer * page
            assert np.array_equal(mem[slot:slot + page], before[pb * 2 * page + local * page:][:page])
            want.update(range(slot, slot + page))
    assert set(changed.tolist()) <= want, "bytes outside the stage's slots of D's mapped rows changed"
    assert plan.nbytes == 3 * 2 * page
