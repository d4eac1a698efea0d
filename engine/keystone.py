"""Keystone: edit a field *inside* a spliced skill; composed vs recomputed cache, strategy by strategy."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.compose import splice_prompt
from engine.experiment import EditExperiment, EditReport
from engine.loaded import LoadedModel
from engine.progress import StepProgress
from engine.scenario import Scenario, ScenarioError
from engine.strategies import STRATEGIES, EditSettings


@dataclass
class KeystoneReport:
    """The same edit on a composed (spliced) and a recomputed cache."""

    field: str
    seam: int
    composed: EditReport
    recomputed: EditReport

    def as_dict(self) -> dict:
        rows = {}
        for name, composed in self.composed.strategies.items():
            recomputed = self.recomputed.strategies[name]
            rows[name] = {
                "applicable": composed.applicable,
                "composed": composed.as_dict(),
                "recomputed": recomputed.as_dict(),
                "decision_agree": composed.applicable and composed.decision.label == recomputed.decision.label,
            }
        return {
            "field": self.field,
            "seam": self.seam,
            "flips": self.recomputed.flips,
            "stale_margin": {"composed": round(self.composed.stale.decision.margin, 4), "recomputed": round(self.recomputed.stale.decision.margin, 4)},
            "oracle_margin": round(self.recomputed.oracle.decision.margin, 4),
            "strategies": rows,
        }


def keystone(
    lm: LoadedModel,
    scenario: Scenario,
    store,
    *,
    field_name: str | None = None,
    seam: int = 1,
    strategies: Sequence[str] = tuple(s for s in STRATEGIES if s not in ("field_only_cot", "auto")),
    settings: EditSettings | None = None,
    progress: StepProgress = None,
) -> KeystoneReport:
    """Run the edit strategies on a field that lives inside a skill (default: the first such field), spliced
    and recomputed."""
    inside = [name for skill in scenario.skills.values() for name in skill.fields]
    field = scenario.field(field_name or next(iter(inside), None))
    if field.name not in inside:
        raise ScenarioError(f"field {field.name!r} is not inside any skill of this scenario; the keystone needs a skill "
                            "with a mutable field in the context (e.g. account_gate)")
    spliced = EditExperiment(
        lm, scenario, field.name, settings=settings,
        build=lambda prompt: splice_prompt(lm, scenario, prompt, store, seam=seam),
    )
    recomputed = EditExperiment(lm, scenario, field.name, settings=settings)
    composed_report = spliced.report(strategies, progress=progress)
    return KeystoneReport(field.name, seam, composed_report, recomputed.report(strategies))
