"""Layer-wise push, the pure part (``state/layerwise.py``): which regions a saved layer
makes final, and which descriptors of a plan may go."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pushsvc.state.layerwise import LayerMap, Progress, postable
from pushsvc.state.layout import part_regions
from pushsvc.state.stages import keys


def test_layers_are_numbered_by_first_appearance_in_region_order() -> None:
    layers = LayerMap(keys([["b"], ["b"], ["a"], ["a", "c"], []]))
    assert layers.names == ("b", "a", "c") and layers.layers == 3 and layers.regions == 5
    assert layers.regions_of == ((0, 1), (2, 3), (3,))


def test_a_region_is_final_once_every_layer_it_names_is_and_unnamed_ones_at_the_end() -> None:
    progress = Progress(LayerMap(keys([["b"], ["b"], ["a"], ["a", "c"], []])))
    assert progress.save(1) and list(progress.final) == [False, False, True, False, False]
    assert not progress.save(1), "saved twice: nothing new"
    assert progress.save(2) and list(progress.final) == [False, False, True, True, False]
    assert progress.save(0) and not progress.complete, "the region naming no layer waits for the step's end"
    assert progress.finish() and progress.complete and not progress.finish()


def test_postable_maps_a_joints_repeated_regions_back_and_skips_what_went() -> None:
    final = np.array([True, False])
    posted = np.zeros(4, dtype=bool)  # a joint's plan: two members, two regions each
    assert postable(final, posted).tolist() == [0, 2]
    posted[0] = True
    assert postable(final, posted).tolist() == [2]


@given(st.integers(1, 6), st.data())
def test_saving_every_layer_in_any_order_posts_each_descriptor_exactly_once(layers: int, data) -> None:
    names = [f"l{i}" for i in range(layers)]
    regions = data.draw(st.lists(st.sampled_from(names).map(lambda n: [n]), min_size=1, max_size=12))
    layer_map = LayerMap(keys(regions))
    # A plan lists its pairs in region order (plan_write); some regions have none.
    plan_regions = np.array(sorted(data.draw(st.lists(st.integers(0, len(regions) - 1), max_size=40))),
                            dtype=np.int32)
    edges = np.concatenate(([0], np.cumsum(np.bincount(plan_regions, minlength=len(regions)))))  # WritePlan.edges
    progress = Progress(layer_map)
    posted = np.diff(edges) == 0
    went: list[int] = []
    order = data.draw(st.permutations(range(layer_map.layers)))
    for layer in order:
        progress.save(layer)
        ready = postable(progress.final, posted)
        assert not posted[ready].any()
        # Only descriptors of regions whose layer was saved so far.
        saved = {layer_map.names[i] for i in order[:order.index(layer) + 1]}
        pairs = [i for r in ready.tolist() for i in range(edges[r], edges[r + 1])]
        assert all(regions[plan_regions[i]][0] in saved for i in pairs)
        went += pairs
        posted[ready] = True
    assert progress.complete and posted.all()
    assert sorted(went) == list(range(len(plan_regions))), "each descriptor posted exactly once"


def test_a_write_into_a_landing_d_goes_in_parts_of_whole_layers_where_the_split_allows() -> None:
    """``LayerMap.parts``: the most parts, up to the notification's 32, that divide the
    layers so that each part (``part_regions``, the split D copies by) is exactly the
    regions of its layers, made final by them alone; else 1."""
    def layer_map(names: list[list[str]]) -> LayerMap:
        return LayerMap(keys(names))

    kv = [[f"l{i}"] for i in range(32) for _ in "kv"]  # K and V regions per layer
    assert layer_map(kv).parts() == 32
    assert layer_map([[f"l{i}"] for i in range(80)]).parts() == 20, "80 layers: 4 a part"
    assert layer_map([[f"l{i}"] for i in range(48)]).parts(8) == 8
    assert layer_map([[f"l{i}"] for i in range(61)]).parts() == 1, "no divisor of 61 up to 32"
    assert layer_map([["a", "b"]]).parts() == 1, "one region of every layer (cross-layer)"
    assert layer_map([["a"], ["b"], []]).parts() == 1, "a region final only at the step's end"
    assert layer_map([["a"], ["a"], ["b"]]).parts() == 1, "layers of unequal regions"
    assert layer_map([["a"], ["b"], ["b", "c"], ["c"]]).parts() == 1, "a region across the cut"
    assert layer_map([["a"]]).parts() == 1
    layers = layer_map([[f"l{i}"] for i in range(80) for _ in "kv"])
    for i in range(layers.parts()):
        assert list(part_regions(layers.regions, layers.parts(), i)) == [
            r for layer in range(4 * i, 4 * i + 4) for r in layers.regions_of[layer]]
