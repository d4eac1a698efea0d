"""Keystone: edit a field *inside* a spliced skill; composed vs recomputed cache, strategy by strategy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.cache.decision import DecisionMatch
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.splice import splice_prompt
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.report import EditReport
from kvscope.engine.edit.strategies import STRATEGIES, EditSettings
from kvscope.engine.jsonable import rounded
from kvscope.engine.progress import StepProgress
from kvscope.engine.scenario import Scenario, ScenarioError


@dataclass
class KeystoneReport:
    """The same edit on a composed (spliced) and a recomputed cache."""

    field: str
    remedy: Remedy
    composed: EditReport
    recomputed: EditReport

    @property
    def delta_margin(self) -> float:
        """Oracle − stale margin of the recomputed side: how far the edit should move the decision."""
        return self.recomputed.oracle.decision.margin - self.recomputed.stale.decision.margin

    def recovery_gaps(self) -> dict[str, float | None]:
        """Per applicable strategy (the stale and oracle references left out), composed − recomputed recovery
        (None where either is undefined)."""
        gaps = {}
        for name, composed in self.composed.strategies.items():
            if name in ("stale", "oracle"):
                continue
            recomputed = self.recomputed.strategies[name]
            if composed.applicable and recomputed.applicable:
                a, b = composed.recovery.value, recomputed.recovery.value
                gaps[name] = None if a is None or b is None else a - b
        return gaps

    def as_dict(self) -> dict:
        rows = {}
        gaps = self.recovery_gaps()
        for name, composed in self.composed.strategies.items():
            recomputed = self.recomputed.strategies[name]
            rows[name] = {
                "applicable": composed.applicable,
                "composed": composed.as_dict(),
                "recomputed": recomputed.as_dict(),
                "recovery_gap": rounded(gaps.get(name)),
                **(
                    DecisionMatch.of(composed.decision, recomputed.decision).as_dict()
                    if composed.applicable and recomputed.applicable
                    else {}
                ),
            }
        defined = [abs(gap) for gap in gaps.values() if gap is not None]
        return {
            "field": self.field,
            "remedy": self.remedy.name,
            "flips": self.recomputed.flips,
            "delta_margin": round(self.delta_margin, 4),
            "stale_margin": {
                "composed": round(self.composed.stale.decision.margin, 4),
                "recomputed": round(self.recomputed.stale.decision.margin, 4),
            },
            "oracle_margin": round(self.recomputed.oracle.decision.margin, 4),
            "max_recovery_gap": round(max(defined), 4) if defined else None,
            "strategies": rows,
        }


def keystone(
    lm: LoadedModel,
    scenario: Scenario,
    store: SkillStore,
    *,
    field_name: str | None = None,
    remedy: Remedy = DEFAULT_REMEDY,
    strategies: Sequence[str] = tuple(s for s in STRATEGIES if s not in ("field_only_cot", "auto")),
    settings: EditSettings | None = None,
    progress: StepProgress = None,
    recomputed: EditReport | None = None,
) -> KeystoneReport:
    """Run the edit strategies on a field that lives inside a skill (default: the first such field), spliced
    and recomputed; ``recomputed`` is the recomputed side of an earlier keystone of the same scenario, field, settings
    and strategies (it does not depend on the remedy), reused instead of run again."""
    inside = [name for skill in scenario.skills.values() for name in skill.fields]
    field = scenario.field(field_name or next(iter(inside), None))
    if field.name not in inside:
        raise ScenarioError(
            f"field {field.name!r} is not inside any skill of this scenario; the keystone needs a skill "
            "with a mutable field in the context (e.g. account_gate)"
        )
    remedy.require_deployable("the keystone")
    spliced = EditExperiment(
        lm,
        scenario,
        field.name,
        settings=settings,
        build=lambda prompt: splice_prompt(lm, scenario, prompt, store, remedy).notebook,
    )
    composed_report = spliced.report(strategies, progress=progress)
    if recomputed is None:
        recomputed = EditExperiment(lm, scenario, field.name, settings=settings).report(strategies)
    elif (recomputed.scenario, recomputed.field) != (scenario.name, field.name):
        raise ScenarioError(
            f"the recomputed keystone passed in edits {recomputed.field!r} of {recomputed.scenario!r}, "
            f"not {field.name!r} of {scenario.name!r}"
        )
    return KeystoneReport(field.name, remedy, composed_report, recomputed)
