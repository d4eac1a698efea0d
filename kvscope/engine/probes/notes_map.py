"""The notes map: which (layer, position) entries carry a field edit's change, checked by exact patching.

Attribution patching (one backward) scores every (layer, position) of the field and the downstream tokens;
its top entries and positions are then patched exactly, one read each, and the two rankings compared
(overlap, Pearson and Spearman). ``exact=True`` also patches every candidate position (slow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.cache.patching import EffectMap, exact_effects
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.jsonable import attributes
from kvscope.engine.probes.common import (
    Gap,
    ProbeError,
    attribution,
    patched_reading,
    probe_json,
    require_aligned,
    rounded,
)
from kvscope.engine.progress import StepProgress, Tick, ticker
from kvscope.engine.timing import Stopwatch


@dataclass(frozen=True)
class Check:
    """An attributed effect beside its exact patch (layer None: all layers of the position)."""

    layer: int | None
    position: int
    attribution: float
    exact: float

    def as_dict(self) -> dict:
        return {"layer": self.layer, "position": self.position, "attribution": rounded(self.attribution), "exact": rounded(self.exact)}


@dataclass
class NotesMapResult:
    """Δmargin of patching the oracle's K/V into the stale cache per (layer, position), with its checks."""

    gap: Gap
    positions: list[int]
    token_texts: list[str]
    segments: list[str]
    effects: list[list[float]]  # (layers, positions) attribution Δmargin
    entry_checks: list[Check]  # top entries, exact single-entry patches
    position_checks: list[Check]  # verified positions, all layers patched at once
    top: int
    top_overlap: float  # top-`top` positions by attribution vs by exact, within the verified positions
    entry_correlation: tuple[float | None, float | None]  # (Pearson, Spearman)
    position_correlation: tuple[float | None, float | None]
    attribution_ms: float
    verification_ms: float
    exact_effects: list[float] | None = None  # per position, every candidate (option exact=True)
    exact_overlap: float | None = None
    exact_correlation: tuple[float | None, float | None] = (None, None)
    exact_ms: float | None = None

    def per_position(self) -> list[float]:
        """Attributed effect of patching all layers of each position."""
        return [sum(column) for column in zip(*self.effects)]

    def headline(self) -> str:
        """What the probe found, in one sentence: the position whose exact patch moves the decision most, and how
        well the one-backward attribution ranked the verified positions."""
        if not self.position_checks:
            return f"No position was verified ({self.gap.words()})."
        best = max(self.position_checks, key=lambda check: check.exact * self.gap.direction)
        index = self.positions.index(best.position)
        share = self.gap.fraction(best.exact)
        effect = f"Δmargin {best.exact:+.2f}" + ("" if share is None else f", {share:.0%} of the edit's effect")
        return (
            f"Patching one position's new-value K/V (all layers) moves the stale decision most at position {best.position} "
            f"({self.token_texts[index]!r}, {self.segments[index]}): {effect}; attribution and exact patching agree on "
            f"{self.top_overlap:.0%} of the top {self.top} verified positions."
        )

    def as_dict(self) -> dict:
        def fraction(value: float) -> float | None:
            return rounded(self.gap.fraction(value))

        return probe_json(
            self,
            {
                **attributes(self, "positions", "token_texts", "segments"),
                "effects": [[rounded(v) for v in row] for row in self.effects],
                "effects_fraction": [[fraction(v) for v in row] for row in self.effects],
                "per_position": [rounded(v) for v in self.per_position()],
                "per_position_fraction": [fraction(v) for v in self.per_position()],
                **attributes(self, "entry_checks", "position_checks", "top"),
                "top_overlap": rounded(self.top_overlap),
                "entry_pearson": rounded(self.entry_correlation[0]),
                "entry_spearman": rounded(self.entry_correlation[1]),
                "position_pearson": rounded(self.position_correlation[0]),
                "position_spearman": rounded(self.position_correlation[1]),
                "attribution_ms": round(self.attribution_ms, 1),
                "verification_ms": round(self.verification_ms, 1),
                "exact_per_position": None if self.exact_effects is None else [rounded(v) for v in self.exact_effects],
                "exact_overlap": rounded(self.exact_overlap),
                "exact_pearson": rounded(self.exact_correlation[0]),
                "exact_spearman": rounded(self.exact_correlation[1]),
                "exact_ms": rounded(self.exact_ms, 1),
            },
        )


def _correlations(a: Sequence[float], b: Sequence[float]) -> tuple[float | None, float | None]:
    """Pearson and Spearman correlation (None with fewer than 2 points or no variance)."""
    if len(a) < 2:
        return None, None
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    if float(x.std()) == 0 or float(y.std()) == 0:
        return None, None
    ranks = [t.argsort().argsort().double() for t in (x, y)]
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1]), float(torch.corrcoef(torch.stack(ranks))[0, 1])


def _overlap(a: Sequence[int], b: Sequence[int]) -> float:
    return len(set(a) & set(b)) / max(len(a), 1)


def _top(values: dict, k: int, direction: float) -> list:
    """The k keys with the largest value times ``direction``."""
    return sorted(values, key=lambda key: -direction * values[key])[:k]


def _labels(notebook: Notebook, positions: Sequence[int]) -> tuple[list[str], list[str]]:
    """Token texts and segment labels of these positions."""
    texts = dict(zip(notebook.visible_positions(), notebook.token_texts()))
    segments = dict(zip(notebook.visible_positions(), notebook.visible_segments()))
    return [texts[p] for p in positions], [segments[p] for p in positions]


def _entry_checks(experiment: EditExperiment, effects: EffectMap, top: int, gap: Gap, tick: Tick) -> list[Check]:
    """Exact single-entry patches of the ``top`` attributed (layer, position) entries."""
    checks = []
    for layer, position in effects.top_entries(top, gap.direction):
        attributed = float(effects.effects[layer, effects.positions.index(position)])
        checks.append(Check(layer, position, attributed, patched_reading(experiment, [position], [layer]).margin - gap.stale))
        tick()
    return checks


def _position_checks(experiment: EditExperiment, summed: dict[int, float], positions: Sequence[int], gap: Gap, tick: Tick) -> list[Check]:
    """Exact all-layer patches of these positions."""
    checks = []
    for position in positions:
        checks.append(Check(None, position, summed[position], patched_reading(experiment, [position]).margin - gap.stale))
        tick()
    return checks


def probe_notes_map(experiment: EditExperiment, *, progress: StepProgress = None, top: int = 8, exact: bool = False) -> NotesMapResult:
    """Attribution map over the field and downstream, checked by exact patching of its top entries/positions.

    Verified: the ``top`` (layer, position) entries one by one, and the 2·``top`` strongest positions plus
    the entries' positions with all layers at once. ``exact`` also patches every candidate position (slow).
    """
    require_aligned(experiment, "notes_map")
    candidates = experiment.field_positions + experiment.downstream_positions
    if not 1 <= top <= len(candidates):
        raise ProbeError(f"top={top} must be between 1 and the {len(candidates)} candidate positions")
    gap, watch = Gap.of(experiment), Stopwatch()
    effects = attribution(experiment, candidates)
    attribution_ms, watch = watch.ms, Stopwatch()
    summed = dict(zip(candidates, effects.per_position().tolist()))
    entries = effects.top_entries(top, gap.direction)
    verified = list(dict.fromkeys(_top(summed, 2 * top, gap.direction) + [p for _, p in entries]))
    tick = ticker(progress, len(entries) + len(verified) + (len(candidates) if exact else 0))
    entry_checks = _entry_checks(experiment, effects, top, gap, tick)
    position_checks = _position_checks(experiment, summed, verified, gap, tick)
    exact_at = {c.position: c.exact for c in position_checks}
    texts, segments = _labels(experiment.stale.notebook, candidates)
    result = NotesMapResult(
        gap=gap,
        positions=candidates,
        token_texts=texts,
        segments=segments,
        effects=effects.effects.tolist(),
        entry_checks=entry_checks,
        position_checks=position_checks,
        top=top,
        top_overlap=_overlap(_top({p: summed[p] for p in verified}, top, gap.direction), _top(exact_at, top, gap.direction)),
        entry_correlation=_correlations([c.attribution for c in entry_checks], [c.exact for c in entry_checks]),
        position_correlation=_correlations([c.attribution for c in position_checks], [c.exact for c in position_checks]),
        attribution_ms=attribution_ms,
        verification_ms=watch.ms,
    )
    if exact:
        _add_exact_map(result, experiment, tick)
    return result


def _add_exact_map(result: NotesMapResult, experiment: EditExperiment, tick: Tick) -> None:
    """Exact all-layer patch of every candidate position, compared with the attribution map."""
    watch = Stopwatch()
    stale, oracle = experiment.stale.notebook, experiment.oracle.notebook
    full = exact_effects(stale, oracle, experiment.prompt, result.positions, progress=lambda done, total: tick())
    attributed, exact = result.per_position(), full.per_position().tolist()
    direction = result.gap.direction
    result.exact_effects = exact
    result.exact_overlap = _overlap(
        _top(dict(zip(result.positions, attributed)), result.top, direction),
        _top(dict(zip(result.positions, exact)), result.top, direction),
    )
    result.exact_correlation = _correlations(attributed, exact)
    result.exact_ms = watch.ms
