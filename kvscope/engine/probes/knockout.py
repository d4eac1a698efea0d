"""Knockout: does hiding the top-K notes from the oracle's decision tokens undo the edit?

Dose-response over K = 0, 1, 2, 4, ... all downstream tokens (ranked by attribution), each against K random
downstream positions hidden (``seeds`` draws). Hiding goes through the attention mask; the cache is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.cache.notebook import Knockout
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.jsonable import JsonFields, attributes
from kvscope.engine.probes.common import (
    Gap,
    RandomControl,
    Reading,
    hidden_reading,
    k_ladder,
    probe_json,
    random_control,
    ranked_notes,
    require_aligned,
)
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.words import counted

HEADLINE_K = 8  # the headline's K: the largest measured K up to this one (the Notes tab's default top-K)


@dataclass
class KnockoutPoint(JsonFields):
    """The oracle's decision with the top-K notes (and K random downstream positions) hidden."""

    k: int
    positions: list[int]
    top: Reading
    random: RandomControl | None


@dataclass
class KnockoutResult:
    """Dose-response: recovery 1 = oracle unchanged, toward 0 = back to the stale decision."""

    gap: Gap
    points: list[KnockoutPoint]

    def headline(self) -> str:
        """What the probe found, in one sentence: the top-K notes knocked out (the largest K ≤ 8 measured) against K
        random downstream positions."""
        shown = [point for point in self.points if 0 < point.k <= HEADLINE_K] or [point for point in self.points if point.k]
        if not shown:
            return f"Nothing was knocked out ({self.gap.words()})."
        point, gap = shown[-1], self.gap
        moved = point.top.margin - gap.oracle
        share = gap.fraction(-moved)
        effect = "" if share is None else f", {share:.0%} of the edit's effect"
        kept = "stays" if point.top.label == gap.oracle_label else "becomes"
        said = (
            f"Knocking out the top {counted(point.k, 'note')} moves the new-value margin by {moved:+.2f}{effect} "
            f"(the decision {kept} {point.top.label})"
        )
        if point.random is not None:
            said += f"; {counted(point.k, 'random position')} move it by {point.random.margin - gap.oracle:+.2f}"
        return said + "."

    def as_dict(self) -> dict:
        return probe_json(self, attributes(self, "points"))


def probe_knockout(
    experiment: EditExperiment, *, progress: StepProgress = None, ks: Sequence[int] | None = None, seeds: int = 3
) -> KnockoutResult:
    """Hide the top-K notes from the decision tokens in the oracle cache, K = 0, 1, 2, 4, ... all."""
    require_aligned(experiment, "knockout")
    gap, ranked = Gap.of(experiment), ranked_notes(experiment)
    ks = k_ladder(ks, len(ranked), smallest=0)
    tick = ticker(progress, len(ks))

    def hidden(positions: Sequence[int]) -> Reading:
        return hidden_reading(experiment, Knockout(tuple(positions)), gap)

    points = []
    for k in ks:
        control = random_control(experiment.downstream_positions, k, seeds, gap, lambda draw: hidden(draw).margin) if k else None
        points.append(KnockoutPoint(k, ranked[:k], hidden(ranked[:k]), control))
        tick()
    return KnockoutResult(gap, points)
