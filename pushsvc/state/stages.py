"""Which of D's regions a pipeline stage of P writes (pure).

A pipeline-parallel P runs its layers in stages; each stage's workers hold only their
stage's layers, while D (one stage) holds every layer. Regions are then paired by the
layers they hold (``Region.layer_names``), not by position: a stage's view of D is D's
regions chosen by layer, in the order of the stage's own regions. The ``k``-th of the
stage's regions that hold a set of layers pairs with the ``k``-th of D's regions that
hold the same set (vLLM gives a layer's K and V two regions on some backends, in the
same order on both sides). D's regions of other stages are left out.

A region that names no layer cannot be routed; a stage region whose layers D lacks
fails the push; a layer of D that no stage holds, or that two stages claim, fails D's
registration (its KV would stay stale, or be written twice).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pushsvc.errors import LayoutError
from pushsvc.state.layout import Layout

LayerKey = tuple[str, ...]  # the layers one region holds, as its worker named them


def keys(names: Iterable[Sequence[str]]) -> tuple[LayerKey, ...]:
    """Each region's layers (``Region.layer_names`` of each region, in order)."""
    return tuple(tuple(n) for n in names)


def order(have: Sequence[LayerKey], want: Sequence[LayerKey], who: str = "D") -> tuple[int, ...]:
    """For each region of ``want`` (a stage's, by layers) the index of the region of
    ``have`` (``who``'s) that pairs with it. LayoutError where a region of either names
    no layer, or ``have`` lacks one that ``want`` holds."""
    for side, regions in ((who, have), ("the stage", want)):
        blank = next((i for i, k in enumerate(regions) if not k), None)
        if blank is not None:
            raise LayoutError(f"region {blank} of {side} names no layer: a pipeline-parallel P pairs regions "
                              "by layer name")
    places: dict[LayerKey, list[int]] = {}
    for i, k in enumerate(have):
        places.setdefault(k, []).append(i)
    taken: dict[LayerKey, int] = {}
    out = []
    for k in want:
        seen = taken.get(k, 0)
        slots = places.get(k, [])
        if seen >= len(slots):
            layer = ", ".join(k)
            raise LayoutError(f"{who} has only {len(slots)} region{'' if len(slots) == 1 else 's'} of layer {layer}, "
                              f"the stage writes {seen + 1}" if slots else f"{who} has no region of layer {layer}")
        taken[k] = seen + 1
        out.append(slots[seen])
    return tuple(out)


def select(layout: Layout, indices: Sequence[int]) -> Layout:
    """The regions of ``layout`` at ``indices``, in that order."""
    return Layout(tuple(layout.regions[i] for i in indices), layout.blocks_per_logical)


def stage_view(layout: Layout, have: Sequence[LayerKey], want: Sequence[LayerKey], who: str = "D") -> Layout:
    """What a stage whose regions hold ``want`` writes of ``layout`` (whose regions hold
    ``have``): ``layout``'s regions paired with the stage's, in the stage's order."""
    if len(have) != len(layout.regions):
        raise LayoutError(f"{who} names the layers of {len(have)} regions, its layout has {len(layout.regions)}")
    return select(layout, order(have, want, who))


def coverage(have: Sequence[LayerKey], stages: Sequence[Sequence[LayerKey]]) -> str:
    """Why the stages, each by its regions' layers, do not fill every region of D's
    (``have``) exactly once, or ''."""
    owners: dict[str, list[int]] = {}
    for s, regions in enumerate(stages):
        for name in dict.fromkeys(n for k in regions for n in k):
            owners.setdefault(name, []).append(s)
    for name in dict.fromkeys(n for k in have for n in k):
        held = owners.get(name, [])
        if not held:
            return f"layer {name} is held by none of P's {len(stages)} pipeline stages"
        if len(held) > 1:
            return f"layer {name} is held by P's pipeline stages {', '.join(map(str, held))}"
    blank = next((i for i, k in enumerate(have) if not k), None)
    if blank is not None:
        return f"region {blank} of D names no layer: a pipeline-parallel P pairs regions by layer name"
    return ""
