"""User memory at the start vs the end of the prompt: what editing and transplanting it costs.

Editing a memory field exactly means recomputing the field and everything after it (``full_downstream``):
cheap when the memory sits at the end, O(context) when it sits at the start. Transplanting means splicing the
memory block compiled elsewhere; its fidelity is compared with a full recompute in both placements.
"""
from __future__ import annotations

import dataclasses
import re

from engine.compose import compare, with_skills
from engine.experiment import EditExperiment
from engine.loaded import LoadedModel
from engine.scenario import Scenario, ScenarioError

PLACEMENTS = ("start", "end")


def without_skill(scenario: Scenario, skill_id: str) -> Scenario:
    """The scenario with one skill's placeholder (and the blank lines around it) removed."""
    if skill_id not in scenario.skills:
        raise ScenarioError(f"scenario {scenario.name!r} does not place skill {skill_id!r}")
    context = re.sub(r"\s*\{skill:" + re.escape(skill_id) + r"\}\s*", "\n\n", scenario.context).strip()
    skills = {k: v for k, v in scenario.skills.items() if k != skill_id}
    return dataclasses.replace(scenario, context=context, skills=skills)


def memory_placement(lm: LoadedModel, scenario: Scenario, store, *, skill_id: str = "user_memory", seam: int = 1) -> dict:
    """Edit and transplant cost of a memory skill placed at the start and at the end of the context."""
    if skill_id not in scenario.skills or not scenario.skills[skill_id].fields:
        raise ScenarioError(f"scenario {scenario.name!r} must place skill {skill_id!r} with a mutable field")
    field = next(iter(scenario.skills[skill_id].fields))
    base = without_skill(scenario, skill_id)
    rows = {}
    for at in PLACEMENTS:
        placed = with_skills(base, [skill_id], at)
        experiment = EditExperiment(lm, placed, field)
        edits = {name: experiment.run(name).as_dict() for name in ("full_downstream", "field_erratum", "erratum")}
        for name, edit in edits.items():
            edit["decision_agree"] = edit["decision"] == experiment.oracle.decision.label if edit["applicable"] else None
        rows[at] = {
            "stale_margin": round(experiment.stale.decision.margin, 4),
            "oracle_margin": round(experiment.oracle.decision.margin, 4),
            "edit": edits,
            "transplant": compare(lm, placed, store, seam=seam).as_dict(),
        }
    return {"scenario": scenario.name, "skill": skill_id, "field": field, "seam": seam, "placements": rows}
