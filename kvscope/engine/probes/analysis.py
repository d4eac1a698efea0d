"""Everything one edit shows at once (the Notes tab, an export): the strategy report with the notes share, the
decision tokens' attention in the stale and oracle caches, and the notes effects per (layer, position).

One call, :func:`analyse_edit`, so a front end turns UI values into one engine call and its result into figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.cache.patching import EffectMap
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.report import EditReport
from kvscope.engine.probes.attention import AttentionResult, probe_attention
from kvscope.engine.progress import StepProgress

DEFAULT_STRATEGIES = ("field_only", "erratum", "field_erratum", "full_downstream")


@dataclass
class EditAnalysis:
    """One edit's report, attention maps and notes effects (None when the values differ in token length)."""

    experiment: EditExperiment
    report: EditReport
    attention: AttentionResult
    effects: EffectMap | None

    def as_dict(self) -> dict:
        """The report's JSON and whether position-by-position views apply."""
        return self.report.as_dict() | {"same_length": self.experiment.same_length}


def analyse_edit(
    experiment: EditExperiment, names: Sequence[str] = DEFAULT_STRATEGIES, *, fused: bool = True, progress: StepProgress = None
) -> EditAnalysis:
    """Run the named strategies (read together in one forward when ``fused``), the attention maps and the
    notes effects (from the stale run's cached gradients) of one edit."""
    report = experiment.report(list(names) or list(DEFAULT_STRATEGIES), progress=progress, fused=fused)
    return EditAnalysis(experiment, report, probe_attention(experiment), experiment.notes_effects())
