"""What every probe shares: its error, the reference gap, readings, random controls and the steps they repeat.

A probe measures recovery on a :class:`Gap` (0 = stale, 1 = oracle), reads decisions as :class:`Reading` objects,
compares them with a :class:`RandomControl` over reproducible random draws, and (the patching probes) refuses
an edit whose new value changes the token count (:func:`require_aligned`). Notes are the downstream positions
ranked by attribution patching (:func:`ranked_notes`, one backward, ``kvscope.engine.cache.patching``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvscope.engine.cache.decision import Decision, recovery
from kvscope.engine.cache.notebook import Knockout, Notebook
from kvscope.engine.cache.patching import EffectMap, attribution_effects
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.errors import KVScopeError
from kvscope.engine.jsonable import rounded


class ProbeError(KVScopeError):
    """A probe that cannot run on this experiment or these options; the message says which input and why."""


# ---------------------------------------------------------------------------- shared results
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
        return cls(stale.margin, oracle.margin, stale.label, oracle.label, experiment.min_gap)

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

    def words(self) -> str:
        """The two references in words: "stale refuse (−2.00) → oracle dispense (+2.75)", and why recovery is undefined."""
        first, second = self.names
        said = f"{first} {self.stale_label} ({self.stale:+.2f}) → {second} {self.oracle_label} ({self.oracle:+.2f})"
        return said if self.note is None else f"{said}; recovery is undefined ({self.note}), so margins are given"

    def as_dict(self) -> dict:
        first, second = self.names
        return {
            f"{first}_margin": rounded(self.stale),
            f"{second}_margin": rounded(self.oracle),
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
        return {"margin": rounded(self.margin), "label": self.label, "recovery": rounded(self.recovery)}

    def words(self) -> str:
        """The reading in a sentence's words: "recovery 0.85 (dispense)", or its margin where recovery is undefined."""
        amount = f"margin {self.margin:+.2f}" if self.recovery is None else f"recovery {self.recovery:.2f}"
        return f"{amount} ({self.label})"


@dataclass(frozen=True)
class RandomControl:
    """The same operation on random draws: per-draw margins and their mean."""

    margins: tuple[float, ...]
    margin: float
    recovery: float | None

    def as_dict(self) -> dict:
        return {"margin": rounded(self.margin), "recovery": rounded(self.recovery), "margins": [rounded(m) for m in self.margins]}

    def words(self) -> str:
        """The mean in a sentence's words: "recovery 0.12", or its margin where recovery is undefined."""
        return f"margin {self.margin:+.2f}" if self.recovery is None else f"recovery {self.recovery:.2f}"


def probe_json(result: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """A probe result's JSON: its gap's margins and labels (``result.gap``), its one-sentence ``headline()``, then
    ``fields``."""
    return {**result.gap.as_dict(), "headline": result.headline(), **fields}


# ---------------------------------------------------------------------------- shared steps
def read(experiment: EditExperiment, notebook: Notebook, knockout: Knockout | Sequence[Knockout] | None = None, **options) -> Decision:
    """The experiment's decision read from ``notebook``, with knockouts and read options (e.g. capture_attention)."""
    return notebook.read_prompt(experiment.prompt, answer_texts=experiment.scenario.answers, knockout=knockout, **options)


def reading(decision: Decision, gap: Gap) -> Reading:
    """A decision as a reading on ``gap``."""
    return Reading(decision.margin, decision.label, gap.recovery(decision.margin))


def patched_reading(
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
    return reading(read(experiment, base.patch(donor, positions, layers)), gap or Gap.of(experiment))


def hidden_reading(experiment: EditExperiment, knockout: Knockout | Sequence[Knockout], gap: Gap) -> Reading:
    """The oracle's decision with ``knockout`` hidden from the decision tokens, as a reading on ``gap``."""
    return reading(read(experiment, experiment.oracle.notebook, knockout), gap)


def random_control(pool: Sequence, k: int, seeds: int, gap: Gap, margin_of: Callable[[list], float]) -> RandomControl:
    """The same operation on ``seeds`` reproducible random k-subsets of ``pool`` (seed 0, 1, ...): ``margin_of`` each
    draw, their mean and its recovery."""
    if seeds < 1:
        raise ProbeError(f"seeds must be ≥ 1 (random draws for the control), got {seeds}")
    margins = [margin_of(random.Random(seed).sample(list(pool), k)) for seed in range(seeds)]
    mean = sum(margins) / len(margins)
    return RandomControl(tuple(margins), mean, gap.recovery(mean))


def require_aligned(experiment: EditExperiment, probe: str) -> None:
    """Patching position by position needs the new value to keep the old one's token count."""
    if not experiment.same_length:
        old, new = len(experiment.stale.prompt.context_ids), len(experiment.oracle.prompt.context_ids)
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


def attribution(experiment: EditExperiment, positions: Sequence[int]) -> EffectMap:
    """Attribution-patching effects of the oracle's K/V patched into the stale cache."""
    return attribution_effects(experiment.stale.notebook, experiment.oracle.notebook, experiment.prompt, positions)


def ranked_notes(experiment: EditExperiment) -> list[int]:
    """Downstream positions ordered by their (attributed) effect toward the oracle, strongest first."""
    candidates = experiment.downstream_positions
    if not candidates:
        raise ProbeError(f"field {experiment.field!r} has no downstream tokens: there are no notes to rank")
    return attribution(experiment, candidates).top_positions(len(candidates), Gap.of(experiment).direction)
