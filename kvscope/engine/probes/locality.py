"""Locality: does recomputing the field alone recover the decision, against the field and everything after it?

Runs the ``field_only`` and ``full_downstream`` strategies of the experiment (paper: ≈ 0 vs 1.0); a strategy
that does not apply (field_only on a token-count change) is reported with its reason, not refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.jsonable import attributes
from kvscope.engine.probes.common import Gap, Reading, probe_json, reading
from kvscope.engine.progress import StepProgress, ticker


@dataclass
class LocalityResult:
    """Field-only vs full-downstream recompute: None where a strategy does not apply (see ``reasons``)."""

    gap: Gap
    field_only: Reading | None
    full_downstream: Reading | None
    reasons: dict[str, str]
    ms: dict[str, float]

    def headline(self) -> str:
        """What the probe found, in one sentence computed from its numbers."""
        if self.field_only is None:
            field = f"field_only does not apply ({self.reasons.get('field_only')})"
        else:
            field = f"recomputing the field alone gives {self.field_only.words()}"
            if self.field_only.recovery is not None:
                change = "margin change" if self.gap.stale_label == self.gap.oracle_label else "decision"
                field += f": the notes after it carry {max(0.0, 1 - self.field_only.recovery):.0%} of the {change}"
        after = "" if self.full_downstream is None else f"; the field and everything after it give {self.full_downstream.words()}"
        return f"Between {self.gap.words()}, {field}{after}."

    def as_dict(self) -> dict:
        ms = {name: round(ms, 1) for name, ms in self.ms.items()}
        return probe_json(self, {**attributes(self, "field_only", "full_downstream", "reasons"), "ms": ms})


def probe_locality(experiment: EditExperiment, *, progress: StepProgress = None) -> LocalityResult:
    """Recompute only the field vs the field and everything after it (paper: ≈ 0 vs 1.0)."""
    gap, tick = Gap.of(experiment), ticker(progress, 2)
    readings, reasons, ms = {}, {}, {}
    for name in ("field_only", "full_downstream"):
        result = experiment.run(name)
        readings[name] = reading(result.decision, gap) if result.applicable else None
        if not result.applicable:
            reasons[name] = result.reason
        ms[name] = result.ms
        tick()
    return LocalityResult(gap, readings["field_only"], readings["full_downstream"], reasons, ms)
