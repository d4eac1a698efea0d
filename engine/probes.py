"""Probes: where a field edit's effect lives in the cache, measured as in the paper (one function each).

Every probe takes an :class:`EditExperiment` (the stale run with the old value, the oracle run with the new
one) and returns a result dataclass whose ``as_dict()`` is JSON-ready. Recovery is measured on the decision
margin between two reference states: 0 = stale, 1 = oracle (trigger: original rule, flipped rule).

| probe | question | reads (R ≈ one decision read) | needs same-length values |
|---|---|---|---|
| ``locality`` | does recomputing the field alone recover the decision? | 2 strategies | no (reports n/a) |
| ``notes_map`` | which (layer, position) entries carry the change? | 1 backward + ~3·top R (+ P R with exact) | yes |
| ``suffix`` | how does recovery grow with the top-K patched notes, per layer band? | #K·(4 + seeds) R | yes |
| ``knockout`` | does hiding the top-K notes from the oracle's decision undo it? | #K·(1 + seeds) R | yes |
| ``heads`` | which heads read the notes, and does knocking them out matter? | 3 + seeds R | yes |
| ``false_note`` | does an injected note beat the live field? | 2 R | yes |
| ``trigger`` | flipping a rule word: do notes after it carry the flip, and the word alone not? | 1 prefill + 3 R | no |
| ``attention`` | where do the decision tokens look, in stale and oracle? | 2 R | no |

Notes are ranked by attribution patching (one backward, ``engine.patching``); positions before the field
hold identical K/V in both runs, so the maps cover the field and the downstream tokens only.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace as dataclass_replace

import numpy as np
import torch

from engine.decision import Decision, recovery
from engine.notebook import Knockout, Notebook, NotebookError
from engine.patching import EffectMap, attribution_effects, exact_effects
from engine.runs import ScenarioRun
from engine.scenario import render
from engine.strategies import EditExperiment

Progress = Callable[[int, int], None] | None


class ProbeError(NotebookError):
    """A probe that cannot run on this experiment or these options; the message says which input and why."""


# ---------------------------------------------------------------------------- shared results
def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def _nested(tensor: torch.Tensor, digits: int = 4) -> list:
    """A tensor as nested lists of rounded floats."""
    return np.round(tensor.detach().cpu().double().numpy(), digits).tolist()


@dataclass(frozen=True)
class Gap:
    """The two reference margins a probe's recovery is measured between (0 = ``stale``, 1 = ``oracle``)."""

    stale: float
    oracle: float
    stale_label: str
    oracle_label: str
    min_gap: float
    names: tuple[str, str] = ("stale", "oracle")

    @classmethod
    def of(cls, experiment: EditExperiment) -> "Gap":
        """Stale (old value) to oracle (new value) of an edit experiment."""
        stale, oracle = experiment.stale.decision, experiment.oracle.decision
        return cls(stale.margin, oracle.margin, stale.label, oracle.label, experiment.settings.min_gap)

    def recovery(self, margin: float) -> float | None:
        """(margin − stale) / (oracle − stale), or None when the gap is below ``min_gap``."""
        return recovery(margin, self.stale, self.oracle, self.min_gap).value

    @property
    def direction(self) -> float:
        """+1 when the oracle margin is above the stale one, else −1 (the sign that ranks notes)."""
        return 1.0 if self.oracle >= self.stale else -1.0

    @property
    def note(self) -> str | None:
        """Why recovery is undefined (gap below ``min_gap``), else None."""
        return recovery(self.oracle, self.stale, self.oracle, self.min_gap).reason

    def fraction(self, delta: float) -> float | None:
        """A margin change as a fraction of the gap (None when the gap is too small)."""
        return None if self.note else delta / (self.oracle - self.stale)

    def as_dict(self) -> dict:
        first, second = self.names
        return {
            f"{first}_margin": _round(self.stale),
            f"{second}_margin": _round(self.oracle),
            f"{first}_label": self.stale_label,
            f"{second}_label": self.oracle_label,
            "recovery_note": self.note,
        }


@dataclass(frozen=True)
class Reading:
    """One cache state's decision: margin, label and recovery on the probe's gap."""

    margin: float
    label: str
    recovery: float | None

    def as_dict(self) -> dict:
        return {"margin": _round(self.margin), "label": self.label, "recovery": _round(self.recovery)}


@dataclass(frozen=True)
class RandomControl:
    """The same operation on random draws: per-draw margins and their mean."""

    margins: tuple[float, ...]
    margin: float
    recovery: float | None

    def as_dict(self) -> dict:
        return {"margin": _round(self.margin), "recovery": _round(self.recovery), "margins": [_round(m) for m in self.margins]}


# ---------------------------------------------------------------------------- shared steps
def _ticker(progress: Progress, total: int) -> Callable[[], None]:
    """A callback advancing ``progress`` by one step of ``total``."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    return tick


def _read(experiment: EditExperiment, notebook: Notebook, knockout: Knockout | Sequence[Knockout] | None = None, **options) -> Decision:
    return notebook.read_prompt(experiment.prompt, answer_texts=experiment.scenario.answers, knockout=knockout, **options)


def _reading(decision: Decision, gap: Gap) -> Reading:
    return Reading(decision.margin, decision.label, gap.recovery(decision.margin))


def _patched_reading(
    experiment: EditExperiment,
    positions: Sequence[int],
    layers: Sequence[int] | None = None,
    *,
    base: Notebook | None = None,
    donor: Notebook | None = None,
    gap: Gap | None = None,
) -> Reading:
    """Patch the donor's K/V (default: oracle) into the base (default: stale) and read the decision."""
    base = experiment.stale.notebook if base is None else base
    donor = experiment.oracle.notebook if donor is None else donor
    return _reading(_read(experiment, base.patch(donor, positions, layers)), gap or Gap.of(experiment))


def _random_control(margins: Sequence[float], gap: Gap) -> RandomControl:
    mean = sum(margins) / len(margins)
    return RandomControl(tuple(margins), mean, gap.recovery(mean))


def _random_draws(pool: Sequence, k: int, seeds: int) -> list[list]:
    """``seeds`` reproducible random k-subsets of ``pool`` (seed 0, 1, ...)."""
    if seeds < 1:
        raise ProbeError(f"seeds must be ≥ 1 (random draws for the control), got {seeds}")
    return [random.Random(seed).sample(list(pool), k) for seed in range(seeds)]


def _require_aligned(experiment: EditExperiment, probe: str) -> None:
    """Patching position by position needs the old and new contexts to have the same length."""
    old, new = len(experiment.stale.prompt.context_ids), len(experiment.oracle.prompt.context_ids)
    if old != new:
        raise ProbeError(
            f"probe {probe!r} patches the new run's K/V position by position, but field {experiment.field!r} "
            f"changes the context from {old} to {new} tokens ({experiment.old!r} → {experiment.new!r}); "
            "choose a new value with the same token count"
        )


def k_ladder(ks: Sequence[int] | None, count: int, smallest: int = 1) -> list[int]:
    """The K values to sweep: given ones (checked), else smallest, 1, 2, 4, ... below ``count``, and ``count``."""
    if ks is None:
        doubling, k = [], 1
        while k < count:
            doubling.append(k)
            k *= 2
        return sorted({smallest, *doubling, count})
    bad = [k for k in ks if not smallest <= k <= count]
    if bad:
        raise ProbeError(f"K={bad[0]} is outside {smallest}..{count} (the downstream tokens after the field)")
    return sorted(set(ks))


def _layer_bands(layers: int) -> dict[str, list[int]]:
    """Early, mid and late thirds of the layers."""
    cuts = [round(layers * i / 3) for i in range(4)]
    return {name: list(range(cuts[i], cuts[i + 1])) for i, name in enumerate(("early", "mid", "late"))}


def _attribution(experiment: EditExperiment, positions: Sequence[int]) -> EffectMap:
    """Attribution-patching effects of the oracle's K/V patched into the stale cache."""
    return attribution_effects(experiment.stale.notebook, experiment.oracle.notebook, experiment.prompt, positions)


def _ranked_notes(experiment: EditExperiment) -> list[int]:
    """Downstream positions ordered by their (attributed) effect toward the oracle, strongest first."""
    candidates = experiment.downstream_positions
    if not candidates:
        raise ProbeError(f"field {experiment.field!r} has no downstream tokens: there are no notes to rank")
    return _attribution(experiment, candidates).top_positions(len(candidates), Gap.of(experiment).direction)


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


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


# ---------------------------------------------------------------------------- 1. locality
@dataclass
class LocalityResult:
    """Field-only vs full-downstream recompute: None where a strategy does not apply (see ``reasons``)."""

    gap: Gap
    field_only: Reading | None
    full_downstream: Reading | None
    reasons: dict[str, str]
    ms: dict[str, float]

    def as_dict(self) -> dict:
        return {
            **self.gap.as_dict(),
            "field_only": None if self.field_only is None else self.field_only.as_dict(),
            "full_downstream": None if self.full_downstream is None else self.full_downstream.as_dict(),
            "reasons": self.reasons,
            "ms": {name: round(ms, 1) for name, ms in self.ms.items()},
        }


def probe_locality(experiment: EditExperiment, *, progress: Progress = None) -> LocalityResult:
    """Recompute only the field vs the field and everything after it (paper: ≈ 0 vs 1.0)."""
    gap, tick = Gap.of(experiment), _ticker(progress, 2)
    readings, reasons, ms = {}, {}, {}
    for name in ("field_only", "full_downstream"):
        result = experiment.run(name)
        readings[name] = _reading(result.decision, gap) if result.applicable else None
        if not result.applicable:
            reasons[name] = result.reason
        ms[name] = result.ms
        tick()
    return LocalityResult(gap, readings["field_only"], readings["full_downstream"], reasons, ms)


# ---------------------------------------------------------------------------- 2. notes map
@dataclass(frozen=True)
class Check:
    """An attributed effect beside its exact patch (layer None: all layers of the position)."""

    layer: int | None
    position: int
    attribution: float
    exact: float

    def as_dict(self) -> dict:
        return {"layer": self.layer, "position": self.position, "attribution": _round(self.attribution), "exact": _round(self.exact)}


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

    def as_dict(self) -> dict:
        def fraction(value: float) -> float | None:
            return _round(self.gap.fraction(value))

        return {
            **self.gap.as_dict(),
            "positions": self.positions,
            "token_texts": self.token_texts,
            "segments": self.segments,
            "effects": [[_round(v) for v in row] for row in self.effects],
            "effects_fraction": [[fraction(v) for v in row] for row in self.effects],
            "per_position": [_round(v) for v in self.per_position()],
            "per_position_fraction": [fraction(v) for v in self.per_position()],
            "entry_checks": [c.as_dict() for c in self.entry_checks],
            "position_checks": [c.as_dict() for c in self.position_checks],
            "top": self.top,
            "top_overlap": _round(self.top_overlap),
            "entry_pearson": _round(self.entry_correlation[0]),
            "entry_spearman": _round(self.entry_correlation[1]),
            "position_pearson": _round(self.position_correlation[0]),
            "position_spearman": _round(self.position_correlation[1]),
            "attribution_ms": round(self.attribution_ms, 1),
            "verification_ms": round(self.verification_ms, 1),
            "exact_per_position": None if self.exact_effects is None else [_round(v) for v in self.exact_effects],
            "exact_overlap": _round(self.exact_overlap),
            "exact_pearson": _round(self.exact_correlation[0]),
            "exact_spearman": _round(self.exact_correlation[1]),
            "exact_ms": None if self.exact_ms is None else round(self.exact_ms, 1),
        }


def _labels(notebook: Notebook, positions: Sequence[int]) -> tuple[list[str], list[str]]:
    """Token texts and segment labels of these positions."""
    texts = dict(zip(notebook.visible_positions(), notebook.token_texts()))
    segments = dict(zip(notebook.visible_positions(), notebook.visible_segments()))
    return [texts[p] for p in positions], [segments[p] for p in positions]


def _entry_checks(experiment: EditExperiment, attribution: EffectMap, top: int, gap: Gap, tick: Callable[[], None]) -> list[Check]:
    """Exact single-entry patches of the ``top`` attributed (layer, position) entries."""
    checks = []
    for layer, position in attribution.top_entries(top, gap.direction):
        attributed = float(attribution.effects[layer, attribution.positions.index(position)])
        checks.append(Check(layer, position, attributed, _patched_reading(experiment, [position], [layer]).margin - gap.stale))
        tick()
    return checks


def _position_checks(experiment: EditExperiment, summed: dict[int, float], positions: Sequence[int], gap: Gap, tick: Callable[[], None]) -> list[Check]:
    """Exact all-layer patches of these positions."""
    checks = []
    for position in positions:
        checks.append(Check(None, position, summed[position], _patched_reading(experiment, [position]).margin - gap.stale))
        tick()
    return checks


def probe_notes_map(experiment: EditExperiment, *, progress: Progress = None, top: int = 8, exact: bool = False) -> NotesMapResult:
    """Attribution map over the field and downstream, checked by exact patching of its top entries/positions.

    Verified: the ``top`` (layer, position) entries one by one, and the 2·``top`` strongest positions plus
    the entries' positions with all layers at once. ``exact`` also patches every candidate position (slow).
    """
    _require_aligned(experiment, "notes_map")
    candidates = experiment.field_positions + experiment.downstream_positions
    if not 1 <= top <= len(candidates):
        raise ProbeError(f"top={top} must be between 1 and the {len(candidates)} candidate positions")
    gap, started = Gap.of(experiment), time.perf_counter()
    attribution = _attribution(experiment, candidates)
    attribution_ms, started = _ms(started), time.perf_counter()
    summed = dict(zip(candidates, attribution.per_position().tolist()))
    entries = attribution.top_entries(top, gap.direction)
    verified = list(dict.fromkeys(_top(summed, 2 * top, gap.direction) + [p for _, p in entries]))
    tick = _ticker(progress, len(entries) + len(verified) + (len(candidates) if exact else 0))
    entry_checks = _entry_checks(experiment, attribution, top, gap, tick)
    position_checks = _position_checks(experiment, summed, verified, gap, tick)
    exact_at = {c.position: c.exact for c in position_checks}
    texts, segments = _labels(experiment.stale.notebook, candidates)
    result = NotesMapResult(
        gap=gap,
        positions=candidates,
        token_texts=texts,
        segments=segments,
        effects=attribution.effects.tolist(),
        entry_checks=entry_checks,
        position_checks=position_checks,
        top=top,
        top_overlap=_overlap(_top({p: summed[p] for p in verified}, top, gap.direction), _top(exact_at, top, gap.direction)),
        entry_correlation=_correlations([c.attribution for c in entry_checks], [c.exact for c in entry_checks]),
        position_correlation=_correlations([c.attribution for c in position_checks], [c.exact for c in position_checks]),
        attribution_ms=attribution_ms,
        verification_ms=_ms(started),
    )
    if exact:
        _add_exact_map(result, experiment, tick)
    return result


def _add_exact_map(result: NotesMapResult, experiment: EditExperiment, tick: Callable[[], None]) -> None:
    """Exact all-layer patch of every candidate position, compared with the attribution map."""
    started = time.perf_counter()
    stale, oracle = experiment.stale.notebook, experiment.oracle.notebook
    full = exact_effects(stale, oracle, experiment.prompt, result.positions, progress=lambda done, total: tick())
    attributed, exact = result.per_position(), full.per_position().tolist()
    direction = result.gap.direction
    result.exact_effects = exact
    result.exact_overlap = _overlap(
        _top(dict(zip(result.positions, attributed)), result.top, direction), _top(dict(zip(result.positions, exact)), result.top, direction)
    )
    result.exact_correlation = _correlations(attributed, exact)
    result.exact_ms = _ms(started)


# ---------------------------------------------------------------------------- 3. suffix concentration
@dataclass
class SuffixPoint:
    """Patching the top-K notes: all layers, each layer band, and random K positions (all layers)."""

    k: int
    positions: list[int]
    all_layers: Reading
    bands: dict[str, Reading]
    random: RandomControl

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "positions": self.positions,
            "all_layers": self.all_layers.as_dict(),
            "bands": {name: reading.as_dict() for name, reading in self.bands.items()},
            "random": self.random.as_dict(),
        }


@dataclass
class SuffixResult:
    """Recovery as the top-K downstream notes (ranked by the notes map) are patched into the stale cache."""

    gap: Gap
    bands: dict[str, list[int]]
    points: list[SuffixPoint]

    def as_dict(self) -> dict:
        return {**self.gap.as_dict(), "bands": self.bands, "points": [p.as_dict() for p in self.points]}


def _suffix_point(experiment: EditExperiment, chosen: list[int], bands: dict[str, list[int]], seeds: int, gap: Gap) -> SuffixPoint:
    """Patch the chosen notes in all layers and per band, and as many random downstream positions."""
    draws = _random_draws(experiment.downstream_positions, len(chosen), seeds)
    return SuffixPoint(
        k=len(chosen),
        positions=chosen,
        all_layers=_patched_reading(experiment, chosen),
        bands={name: _patched_reading(experiment, chosen, layers) for name, layers in bands.items()},
        random=_random_control([_patched_reading(experiment, draw).margin for draw in draws], gap),
    )


def probe_suffix(experiment: EditExperiment, *, progress: Progress = None, ks: Sequence[int] | None = None, seeds: int = 3) -> SuffixResult:
    """Suffix concentration: recovery vs K (1, 2, 4, ... all), per layer band, and a random-K control."""
    _require_aligned(experiment, "suffix")
    gap, ranked = Gap.of(experiment), _ranked_notes(experiment)
    ks, bands = k_ladder(ks, len(ranked)), _layer_bands(len(experiment.stale.notebook.keys))
    tick = _ticker(progress, len(ks))
    points = []
    for k in ks:
        points.append(_suffix_point(experiment, ranked[:k], bands, seeds, gap))
        tick()
    return SuffixResult(gap, bands, points)


# ---------------------------------------------------------------------------- 4. knockout
@dataclass
class KnockoutPoint:
    """The oracle's decision with the top-K notes (and K random downstream positions) hidden."""

    k: int
    positions: list[int]
    top: Reading
    random: RandomControl | None

    def as_dict(self) -> dict:
        return {"k": self.k, "positions": self.positions, "top": self.top.as_dict(), "random": None if self.random is None else self.random.as_dict()}


@dataclass
class KnockoutResult:
    """Dose-response: recovery 1 = oracle unchanged, toward 0 = back to the stale decision."""

    gap: Gap
    points: list[KnockoutPoint]

    def as_dict(self) -> dict:
        return {**self.gap.as_dict(), "points": [p.as_dict() for p in self.points]}


def probe_knockout(experiment: EditExperiment, *, progress: Progress = None, ks: Sequence[int] | None = None, seeds: int = 3) -> KnockoutResult:
    """Hide the top-K notes from the decision tokens in the oracle cache, K = 0, 1, 2, 4, ... all."""
    _require_aligned(experiment, "knockout")
    gap, ranked, oracle = Gap.of(experiment), _ranked_notes(experiment), experiment.oracle.notebook
    ks = k_ladder(ks, len(ranked), smallest=0)
    tick = _ticker(progress, len(ks))

    def hidden(positions: Sequence[int]) -> Reading:
        return _reading(_read(experiment, oracle, Knockout(tuple(positions))), gap)

    points = []
    for k in ks:
        draws = _random_draws(experiment.downstream_positions, k, seeds) if k else []
        control = _random_control([hidden(draw).margin for draw in draws], gap) if draws else None
        points.append(KnockoutPoint(k, ranked[:k], hidden(ranked[:k]), control))
        tick()
    return KnockoutResult(gap, points)


# ---------------------------------------------------------------------------- 5. read heads
@dataclass
class HeadsResult:
    """Attention mass on the top notes per (layer, head) in the oracle cache, and head knockouts."""

    gap: Gap
    notes: list[int]
    mass_last: list[list[float]]  # (layers, heads): last decision token → notes
    mass_mean: list[list[float]]  # (layers, heads): mean over decision tokens
    top_heads: list[tuple[int, int]]  # (layer, head), most mass (last token) first
    top: Reading  # top heads' access to the notes knocked out
    random: RandomControl  # as many random heads
    all_heads: Reading  # every head's access to the notes knocked out (reference)

    def as_dict(self) -> dict:
        def drop(reading: Reading | RandomControl) -> float | None:
            return None if reading.recovery is None else _round(1 - reading.recovery)

        return {
            **self.gap.as_dict(),
            "notes": self.notes,
            "mass_last": [[_round(v) for v in row] for row in self.mass_last],
            "mass_mean": [[_round(v) for v in row] for row in self.mass_mean],
            "top_heads": [list(pair) for pair in self.top_heads],
            "top": {**self.top.as_dict(), "recovery_drop": drop(self.top)},
            "random": {**self.random.as_dict(), "recovery_drop": drop(self.random)},
            "all_heads": {**self.all_heads.as_dict(), "recovery_drop": drop(self.all_heads)},
        }


def _head_knockouts(pairs: Sequence[tuple[int, int]], positions: Sequence[int]) -> list[Knockout]:
    """One knockout per layer hiding ``positions`` from that layer's chosen query heads."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)
    return [Knockout(tuple(positions), (layer,), tuple(sorted(heads))) for layer, heads in sorted(by_layer.items())]


def probe_heads(
    experiment: EditExperiment, *, progress: Progress = None, heads: int = 12, notes: int = 8, seeds: int = 3
) -> HeadsResult:
    """Read heads: rank (layer, head) by the last decision token's attention to the top notes; knock them out."""
    _require_aligned(experiment, "heads")
    ranked = _ranked_notes(experiment)
    if not 1 <= notes <= len(ranked):
        raise ProbeError(f"notes={notes} must be between 1 and the {len(ranked)} downstream tokens")
    if heads < 1:
        raise ProbeError(f"heads={heads} must be ≥ 1")
    gap, oracle, chosen = Gap.of(experiment), experiment.oracle.notebook, ranked[:notes]
    tick = _ticker(progress, 3 + seeds)
    attention = _read(experiment, oracle, capture_attention=True).attention  # (layers, heads, decode, entries + decode)
    tick()
    on_notes = attention[..., oracle.entries_at(chosen)].sum(-1)  # (layers, heads, decode)
    mass_last, mass_mean = on_notes[..., -1], on_notes.mean(-1)
    layer_count, head_count = mass_last.shape
    count = min(heads, layer_count * head_count)
    flat = mass_last.flatten().topk(count).indices.tolist()
    top_heads = [(i // head_count, i % head_count) for i in flat]

    def knocked(pairs: Sequence[tuple[int, int]]) -> Reading:
        reading = _reading(_read(experiment, oracle, _head_knockouts(pairs, chosen)), gap)
        tick()
        return reading

    top = knocked(top_heads)
    pool = [(layer, head) for layer in range(layer_count) for head in range(head_count)]
    control = _random_control([knocked(draw).margin for draw in _random_draws(pool, count, seeds)], gap)
    all_heads = _reading(_read(experiment, oracle, Knockout(tuple(chosen))), gap)
    tick()
    return HeadsResult(gap, chosen, mass_last.tolist(), mass_mean.tolist(), top_heads, top, control, all_heads)


# ---------------------------------------------------------------------------- 6. false note
@dataclass
class FalseNoteResult:
    """The stale cache (old field) with the new value's top-K notes injected: does the decision follow them?"""

    gap: Gap
    field_value: str
    note_value: str
    positions: list[int]
    injected: Reading
    all_downstream: Reading  # every downstream note injected (reference)

    def follows(self, reading: Reading) -> bool | None:
        """Whether a reading takes the note's (oracle) label; None when stale and oracle agree anyway."""
        return None if self.gap.stale_label == self.gap.oracle_label else reading.label == self.gap.oracle_label

    def as_dict(self) -> dict:
        return {
            **self.gap.as_dict(),
            "field_value": self.field_value,
            "note_value": self.note_value,
            "k": len(self.positions),
            "positions": self.positions,
            "injected": self.injected.as_dict(),
            "follows_note": self.follows(self.injected),
            "all_downstream": self.all_downstream.as_dict(),
            "all_downstream_follows_note": self.follows(self.all_downstream),
        }


def probe_false_note(experiment: EditExperiment, *, progress: Progress = None, k: int = 8) -> FalseNoteResult:
    """Inject the new value's top-K downstream K/V (not the field) into the stale cache (paper: follows, ≈ 1.0)."""
    _require_aligned(experiment, "false_note")
    ranked = _ranked_notes(experiment)
    if not 1 <= k <= len(ranked):
        raise ProbeError(f"k={k} must be between 1 and the {len(ranked)} downstream tokens")
    tick = _ticker(progress, 2)
    injected = _patched_reading(experiment, ranked[:k])
    tick()
    everything = _patched_reading(experiment, experiment.downstream_positions)
    tick()
    return FalseNoteResult(Gap.of(experiment), experiment.old, experiment.new, ranked[:k], injected, everything)


# ---------------------------------------------------------------------------- 7. trigger control
@dataclass
class TriggerResult:
    """A rule word flipped with the field byte-identical: 0 = original rule, 1 = flipped rule."""

    gap: Gap
    find: str
    replace: str
    trigger_positions: list[int]
    trigger_texts: list[tuple[str, str]]  # (original, flipped) token text
    note_positions: list[int]
    notes_patched: Reading  # the flipped run's K/V after the trigger (trigger excluded): ≈ 1 expected
    trigger_patched: Reading  # only the trigger tokens' K/V: ≈ 0 expected

    def as_dict(self) -> dict:
        return {
            **self.gap.as_dict(),
            "find": self.find,
            "replace": self.replace,
            "trigger_positions": self.trigger_positions,
            "trigger_texts": [list(pair) for pair in self.trigger_texts],
            "note_count": len(self.note_positions),
            "notes_patched": self.notes_patched.as_dict(),
            "trigger_patched": self.trigger_patched.as_dict(),
        }


def _flipped_run(experiment: EditExperiment, find: str | None, replace: str | None) -> tuple[ScenarioRun, list[int]]:
    """The scenario with ``find`` → ``replace`` in its context (same field values), and the changed positions."""
    if not find or not replace:
        raise ProbeError(
            "probe 'trigger' needs the options find=WORD and replace=WORD: a rule phrase in the context after "
            "the field and its flip with the same token count (e.g. find='only if', replace='unless')"
        )
    if any(brace in text for text in (find, replace) for brace in "{}"):
        raise ProbeError(f"trigger find={find!r} / replace={replace!r} must not contain braces")
    scenario, lm = experiment.scenario, experiment.lm
    count = scenario.context.count(find)
    if count != 1:
        raise ProbeError(f"trigger find={find!r} occurs {count} times in the scenario context; give a phrase that occurs exactly once")
    flipped = dataclass_replace(scenario, context=scenario.context.replace(find, replace))
    original = experiment.stale.prompt
    prompt = render(flipped, lm.tokenizer, original.values, max_tokens=lm.model.config.max_position_embeddings)
    if len(prompt.context_ids) != len(original.context_ids):
        raise ProbeError(
            f"replacing {find!r} by {replace!r} changes the context from {len(original.context_ids)} to "
            f"{len(prompt.context_ids)} tokens; the trigger probe patches position by position: use a replacement with the same token count"
        )
    changed = [i for i, (a, b) in enumerate(zip(original.context_ids, prompt.context_ids)) if a != b]
    if not changed:
        raise ProbeError(f"replacing {find!r} by {replace!r} changes no token")
    field_end = experiment.field_positions[-1]
    if changed[0] <= field_end:
        raise ProbeError(f"trigger {find!r} must come after field {experiment.field!r} (it changes position {changed[0]}, the field ends at {field_end})")
    notebook = Notebook.from_prompt(lm, prompt)
    return ScenarioRun(flipped, prompt, notebook, _read(experiment, notebook)), changed


def probe_trigger(experiment: EditExperiment, *, progress: Progress = None, find: str | None = None, replace: str | None = None) -> TriggerResult:
    """Flip a rule word; patch the flipped run's notes after it (≈ 1) vs only the trigger tokens (≈ 0)."""
    flipped, changed = _flipped_run(experiment, find, replace)
    notes = [p for p in experiment.downstream_positions if p > changed[0] and p not in changed]
    if not notes:
        raise ProbeError(f"no tokens follow the trigger {find!r}: there are no notes to patch")
    original = experiment.stale.decision
    gap = Gap(original.margin, flipped.decision.margin, original.label, flipped.decision.label,
              experiment.settings.min_gap, ("original", "flipped"))
    tick = _ticker(progress, 2)
    notes_patched = _patched_reading(experiment, notes, donor=flipped.notebook, gap=gap)
    tick()
    trigger_patched = _patched_reading(experiment, changed, donor=flipped.notebook, gap=gap)
    tick()
    decode = experiment.lm.tokenizer.decode
    texts = [(decode([experiment.stale.prompt.context_ids[p]]), decode([flipped.prompt.context_ids[p]])) for p in changed]
    return TriggerResult(gap, find, replace, changed, texts, notes, notes_patched, trigger_patched)


# ---------------------------------------------------------------------------- 8. attention
@dataclass
class AttentionMap:
    """One run's last-decision-token attention over its context, in reading order."""

    label: str
    positions: list[int]
    token_texts: list[str]
    segments: list[str]
    attention: list  # (layers, heads, context tokens)
    mass: dict[str, list[float]]  # field / downstream / rest (prefix and question tokens) per layer, mean over heads

    def as_dict(self) -> dict:
        return {
            "label": self.label,
            "positions": self.positions,
            "token_texts": self.token_texts,
            "segments": self.segments,
            "attention": self.attention,
            "mass": {name: [_round(v) for v in values] for name, values in self.mass.items()},
        }


@dataclass
class AttentionResult:
    """Where the decision looks in the stale and the oracle cache."""

    gap: Gap
    stale: AttentionMap
    oracle: AttentionMap

    def as_dict(self) -> dict:
        return {**self.gap.as_dict(), "stale": self.stale.as_dict(), "oracle": self.oracle.as_dict()}


def _attention_map(experiment: EditExperiment, run: ScenarioRun) -> AttentionMap:
    notebook = run.notebook
    decision = run.decision if run.decision.attention is not None else _read(experiment, notebook, capture_attention=True)
    last = decision.attention[:, :, -1, notebook.order]  # (layers, heads, context) in reading order
    positions = notebook.visible_positions()
    span = run.prompt.field_spans[experiment.field]
    in_field = torch.tensor([span.start <= p < span.end for p in positions])
    downstream = torch.tensor([p >= span.end for p in positions])
    field_mass, downstream_mass = (last[..., mask].sum(-1).mean(1) for mask in (in_field, downstream))
    mass = {"field": field_mass.tolist(), "downstream": downstream_mass.tolist(), "rest": (1 - field_mass - downstream_mass).tolist()}
    return AttentionMap(decision.label, positions, notebook.token_texts(), notebook.visible_segments(), _nested(last), mass)


def probe_attention(experiment: EditExperiment, *, progress: Progress = None) -> AttentionResult:
    """Attention of the last decision token to every context token, per layer and head, stale and oracle."""
    tick = _ticker(progress, 2)
    maps = []
    for run in (experiment.stale, experiment.oracle):
        maps.append(_attention_map(experiment, run))
        tick()
    return AttentionResult(Gap.of(experiment), *maps)


PROBES: dict[str, Callable] = {
    "locality": probe_locality,
    "notes_map": probe_notes_map,
    "suffix": probe_suffix,
    "knockout": probe_knockout,
    "heads": probe_heads,
    "false_note": probe_false_note,
    "trigger": probe_trigger,
    "attention": probe_attention,
}
