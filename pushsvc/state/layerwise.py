"""Layer-wise push (pure): which of a rank's regions a saved layer makes final, and which
descriptors of a planned WRITE may go.

A worker names a layer by its index among the distinct layer names of the regions it
registered, in their order (``LayerMap``), so both sides derive the numbering from the
same list. A region is final once every layer it names is saved; a region that names
none only when the whole step is (``Progress.finish``). A planned WRITE's descriptor may
be posted once its source region is final: ``plan.edges`` numbers the source layout's
regions, which for a joint agent repeats the rank's regions once per member, hence the
modulo. See docs/architecture.md, "Layer-wise push (P)".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pushsvc.state.layout import part_regions
from pushsvc.state.stages import LayerKey

MAX_LAYER_PARTS = 32  # a part notification's limit (protocol/notif.py ``MAX_PARTS``)


class LayerMap:
    """The layers of one rank's regions (``keys``: each region's layer names, in order)."""

    def __init__(self, keys: Sequence[LayerKey]) -> None:
        order: dict[str, int] = {}
        for key in keys:
            for name in key:
                order.setdefault(name, len(order))
        self.names = tuple(order)
        self.regions = len(keys)
        self.needs = tuple(tuple(order[n] for n in key) for key in keys)  # the layers each region waits for
        by_layer: list[list[int]] = [[] for _ in order]
        for r, need in enumerate(self.needs):
            for layer in need:
                by_layer[layer].append(r)
        self.regions_of = tuple(tuple(rs) for rs in by_layer)  # the regions each layer is part of
        self._parts: dict[int, int] = {}  # ``parts``, by its argument

    @property
    def layers(self) -> int:
        return len(self.names)

    def parts(self, max_parts: int = MAX_LAYER_PARTS) -> int:
        """Into how many parts a layer-wise WRITE into a landing D may go so that every
        part (``part_regions``: the split D copies by) is the regions of whole layers,
        each part made final by its own layers alone: the most that divides the layers,
        up to ``max_parts``; 1 where no split above 1 is (a region of several layers, or
        of none, across a cut; regions spread unevenly over the layers)."""
        found = self._parts.get(max_parts)
        if found is None:
            found = self._parts[max_parts] = next(
                (k for k in range(min(self.layers, max_parts), 1, -1) if self._splits(k)), 1)
        return found

    def _splits(self, parts: int) -> bool:
        if self.layers % parts:
            return False
        per = self.layers // parts
        for i in range(parts):
            layers = range(i * per, (i + 1) * per)
            regions = part_regions(self.regions, parts, i)
            if sorted({r for layer in layers for r in self.regions_of[layer]}) != list(regions):
                return False
            if any(not self.needs[r] or not all(n in layers for n in self.needs[r]) for r in regions):
                return False
        return True


class Progress:
    """One request's layers in the step that finishes its prefill."""

    def __init__(self, layers: LayerMap) -> None:
        self.map = layers
        self._saved = [False] * layers.layers
        self.final = np.zeros(layers.regions, dtype=bool)  # per region of the rank

    def save(self, layer: int) -> bool:
        """Layer ``layer`` is final (``0 <= layer < map.layers``, checked by the caller);
        True if a region became final with it."""
        if self._saved[layer]:
            return False
        self._saved[layer] = True
        changed = False
        for r in self.map.regions_of[layer]:
            if not self.final[r] and all(self._saved[i] for i in self.map.needs[r]):
                self.final[r] = True
                changed = True
        return changed

    def finish(self) -> bool:
        """The step ended: every region is final; True if one was not before."""
        changed = not self.final.all()
        self.final[:] = True
        self._saved = [True] * self.map.layers
        return changed

    @property
    def complete(self) -> bool:
        return bool(self.final.all())


def postable(final: np.ndarray, posted: np.ndarray) -> np.ndarray:
    """The plan's regions (``posted``: one flag per region the plan numbers) that are
    final (``final``, per region of the rank) and not posted yet, in order. Work per
    call is per region, not per descriptor: a layer's save of a long prompt costs the same
    as a short one's."""
    return np.flatnonzero(final[np.arange(len(posted)) % len(final)] & ~posted)
