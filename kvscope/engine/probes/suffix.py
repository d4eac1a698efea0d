"""Suffix concentration: how recovery grows as the top-K notes are patched into the stale cache, per layer band.

For K = 1, 2, 4, ... all downstream tokens (ranked by attribution), the oracle's K/V of the top-K notes are
patched in all layers, in each third of the layers (early, mid, late), and, as a control, at K random
downstream positions (``seeds`` draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.jsonable import JsonFields, attributes
from kvscope.engine.probes.common import (
    Gap,
    RandomControl,
    Reading,
    k_ladder,
    patched_reading,
    probe_json,
    random_control,
    ranked_notes,
    require_aligned,
)
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.words import counted


@dataclass
class SuffixPoint(JsonFields):
    """Patching the top-K notes: all layers, each layer band, and random K positions (all layers)."""

    k: int
    positions: list[int]
    all_layers: Reading
    bands: dict[str, Reading]
    random: RandomControl


@dataclass
class SuffixResult:
    """Recovery as the top-K downstream notes (ranked by the notes map) are patched into the stale cache."""

    gap: Gap
    bands: dict[str, list[int]]
    points: list[SuffixPoint]

    def headline(self) -> str:
        """What the probe found, in one sentence: the fewest top notes whose patch reaches the new-value decision."""
        if not self.points:
            return f"No notes were patched ({self.gap.words()})."
        flipping = [p for p in self.points if p.all_layers.label == self.gap.oracle_label != self.gap.stale_label]
        point = flipping[0] if flipping else self.points[-1]
        said = (
            f"Patching the new value's K/V of the top {counted(point.k, 'note')} into the stale cache gives {point.all_layers.words()}, "
            f"{counted(point.k, 'random position')} {point.random.words()}"
        )
        best = max(point.bands, key=lambda name: point.bands[name].margin * self.gap.direction)
        said += f"; of the layer bands alone, the {best} layers give the most: {point.bands[best].words()}"
        if not flipping and self.gap.stale_label != self.gap.oracle_label:
            said += f"; no K up to {point.k} reaches {self.gap.oracle_label}"
        return said + "."

    def as_dict(self) -> dict:
        return probe_json(self, attributes(self, "bands", "points"))


def _layer_bands(layers: int) -> dict[str, list[int]]:
    """Early, mid and late thirds of the layers."""
    cuts = [round(layers * i / 3) for i in range(4)]
    return {name: list(range(cuts[i], cuts[i + 1])) for i, name in enumerate(("early", "mid", "late"))}


def _suffix_point(experiment: EditExperiment, chosen: list[int], bands: dict[str, list[int]], seeds: int, gap: Gap) -> SuffixPoint:
    """Patch the chosen notes in all layers and per band, and as many random downstream positions."""
    return SuffixPoint(
        k=len(chosen),
        positions=chosen,
        all_layers=patched_reading(experiment, chosen),
        bands={name: patched_reading(experiment, chosen, layers) for name, layers in bands.items()},
        random=random_control(
            experiment.downstream_positions, len(chosen), seeds, gap, lambda draw: patched_reading(experiment, draw).margin
        ),
    )


def probe_suffix(
    experiment: EditExperiment, *, progress: StepProgress = None, ks: Sequence[int] | None = None, seeds: int = 3
) -> SuffixResult:
    """Suffix concentration: recovery vs K (1, 2, 4, ... all), per layer band, and a random-K control."""
    require_aligned(experiment, "suffix")
    gap, ranked = Gap.of(experiment), ranked_notes(experiment)
    ks, bands = k_ladder(ks, len(ranked)), _layer_bands(len(experiment.stale.notebook.keys))
    tick = ticker(progress, len(ks))
    points = []
    for k in ks:
        points.append(_suffix_point(experiment, ranked[:k], bands, seeds, gap))
        tick()
    return SuffixResult(gap, bands, points)
