"""User memory at the start vs the end of the prompt: what editing and transplanting it costs.

Editing a memory field exactly means recomputing the field and everything after it (``full_downstream``):
cheap when the memory sits at the end, O(context) when it sits at the start. Transplanting means splicing the
memory block compiled elsewhere; its fidelity is compared with a full recompute in both placements.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.fidelity import SpliceFidelity, compare
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import StrategyResult
from kvscope.engine.jsonable import JsonFields
from kvscope.engine.scenario import Scenario, ScenarioError

PLACEMENTS = ("start", "end")
EDIT_STRATEGIES = ("full_downstream", "field_erratum", "erratum")


@dataclass
class Placement:
    """One placement of the memory: its stale/oracle margins, each edit strategy and the transplant."""

    stale_margin: float
    oracle_margin: float
    oracle_decision: str
    edits: dict[str, StrategyResult]
    transplant: SpliceFidelity

    def as_dict(self) -> dict:
        edits = {}
        for name, result in self.edits.items():
            agree = result.decision.label == self.oracle_decision if result.applicable else None
            edits[name] = {**result.as_dict(), "decision_agree": agree}
        return {
            "stale_margin": round(self.stale_margin, 4),
            "oracle_margin": round(self.oracle_margin, 4),
            "edit": edits,
            "transplant": self.transplant.as_dict(),
        }


@dataclass
class MemoryPlacement(JsonFields):
    """The memory skill's edit and transplant costs at the start and at the end of the context."""

    scenario: str
    skill: str
    field: str
    seam: int
    placements: dict[str, Placement]


def without_skill(scenario: Scenario, skill_id: str) -> Scenario:
    """The scenario with one skill's placeholder (and the blank lines around it) removed."""
    if skill_id not in scenario.skills:
        raise ScenarioError(f"scenario {scenario.name!r} does not place skill {skill_id!r}")
    context = re.sub(r"\s*\{skill:" + re.escape(skill_id) + r"\}\s*", "\n\n", scenario.context).strip()
    skills = {k: v for k, v in scenario.skills.items() if k != skill_id}
    return dataclasses.replace(scenario, context=context, skills=skills)


def memory_placement(
    lm: LoadedModel, scenario: Scenario, store: SkillStore, *, skill_id: str = "user_memory", seam: int = 1
) -> MemoryPlacement:
    """Edit and transplant cost of a memory skill placed at the start and at the end of the context."""
    if skill_id not in scenario.skills or not scenario.skills[skill_id].fields:
        raise ScenarioError(f"scenario {scenario.name!r} must place skill {skill_id!r} with a mutable field")
    field = next(iter(scenario.skills[skill_id].fields))
    base = without_skill(scenario, skill_id)
    placements = {}
    for at in PLACEMENTS:
        placed = with_skills(base, [skill_id], at)
        experiment = EditExperiment(lm, placed, field)
        placements[at] = Placement(
            stale_margin=experiment.stale.decision.margin,
            oracle_margin=experiment.oracle.decision.margin,
            oracle_decision=experiment.oracle.decision.label,
            edits={name: experiment.run(name) for name in EDIT_STRATEGIES},
            transplant=compare(lm, placed, store, remedy=Remedy(seam=seam)),
        )
    return MemoryPlacement(scenario.name, skill_id, field, seam, placements)
