"""Many skills at once: splice fidelity and decisions for N skills, orders and placements, remedy by remedy.

Every case (a scenario at one field value, an ordered skill set, a placement) is recomputed once and spliced
with each :class:`~kvscope.engine.compose.remedy.Remedy`; the summary per remedy counts decision agreement only where the
recomputed decision is decisive (|margin| ≥ ``DECISIVE_MARGIN``) and reports ties apart, beside the margin
error, logit cosine/KL, the fraction of skill tokens recomputed and the TTFT speedup over the full recompute.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.fidelity import Recomputed, SpliceFidelity, compare
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.errors import KVScopeError
from kvscope.engine.jsonable import attributes
from kvscope.engine.progress import StepProgress
from kvscope.engine.scenario import Scenario

REMEDIES = (
    "splice",
    "seam:1",
    "prefix+seam:1",
    "seam:1+aggregators",
    "prefix+seam:1+aggregators",
    "blend:0.3",
    "prefix+seam:1+blend:0.15",
    "prefix+seam:1+blend:0.3",
    "prefix+seam:1+blend:0.5",
    "prefix+seam:1+blend:0.7",
    "prefix+seam:1+query:0.15",
    "deviation:0.5",
    "causal:0.15",
    "seam:16",  # EPIC's sink:16 (LegoLink), skills compiled alone as EPIC compiles its chunks
    "prefix+seam:16",
    "prefix+ape:0.9,0.9",  # APE's paper default
    "prefix+ape:1,0.8",  # a probe of 4 cases: S < 1 moves the margin towards the recompute, T matters less
    "prefix+ape:1,0.7",
    "prefix+seam:1+ape:0.9,0.9",
    "prefix+seam:1+ape:1,0.8",
    "prefix+seam:1+ape:1,0.7",
)


@dataclass(frozen=True)
class StudyCase:
    """One composed prompt, spliced with every remedy."""

    scenario: str
    values: dict[str, str]
    skills: tuple[str, ...]
    placement: str
    results: dict[str, SpliceFidelity]  # remedy name -> fidelity

    def as_dict(self) -> dict:
        any_result = next(iter(self.results.values()))
        return {
            **attributes(self, "scenario", "values"),
            "skills": list(self.skills),
            "n": len(self.skills),
            "placement": self.placement,
            "context_tokens": any_result.context_tokens,
            "skill_tokens": any_result.skill_tokens,
            "recomputed": any_result.recomputed.as_dict(),
            "remedies": {name: _case_row(result) for name, result in self.results.items()},
        }


def _case_row(result: SpliceFidelity) -> dict:
    data = result.as_dict()
    keep = ("cosine", "kl", "top1_agree", "margin_error", "decisive", "decision_agree", "recomputed_fraction", "speedup", "ttft_ms")
    return {key: data[key] for key in keep} | {"spliced_margin": data["spliced"]["margin"], "spliced_decision": data["spliced"]["decision"]}


def _spread(values: Sequence[float]) -> dict[str, float] | None:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)} if values else None


def summarize(cases: Sequence[StudyCase], remedy: str, n: int | None = None) -> dict:
    """Tie-aware totals of one remedy over the cases (those with ``n`` skills when given)."""
    rows = [case.results[remedy] for case in cases if remedy in case.results and (n is None or len(case.skills) == n)]
    decisive = [row for row in rows if row.match.decisive]
    agreed = sum(bool(row.match.agree) for row in decisive)
    return {
        "cases": len(rows),
        "decisive": len(decisive),
        "ties": len(rows) - len(decisive),
        "agree_decisive": agreed,
        "agreement": round(agreed / len(decisive), 4) if decisive else None,
        "mean_abs_margin_error": round(statistics.fmean(abs(row.match.margin_error) for row in rows), 4) if rows else None,
        "cosine": _spread([row.agreement["cosine"] for row in rows]),
        "kl": _spread([row.agreement["kl"] for row in rows]),
        "recomputed_fraction": round(statistics.fmean(row.recomputed_tokens / max(row.skill_tokens, 1) for row in rows), 4)
        if rows
        else None,
        "speedup": _spread([row.ttft_ms["full"] / row.ttft_ms["splice"] for row in rows]),
    }


@dataclass
class Study:
    """Cases × remedies, with tie-aware summaries and the remedy to offer by default."""

    remedies: list[Remedy]
    cases: list[StudyCase]

    def summary(self) -> dict[str, dict]:
        """Per remedy: totals over every case and per number of skills."""
        sizes = sorted({len(case.skills) for case in self.cases})
        return {
            remedy.name: {
                **summarize(self.cases, remedy.name),
                "needs_reference": remedy.needs_reference,
                "by_n": {str(n): summarize(self.cases, remedy.name, n) for n in sizes},
            }
            for remedy in self.remedies
        }

    def perfect(self) -> list[str]:
        """Remedies (ranked ones included) that agree with the recompute on every decisive case."""
        return [name for name, row in self.summary().items() if row["decisive"] and row["agree_decisive"] == row["decisive"]]

    def best(self) -> str | None:
        """The deployable remedy to offer: most decisive cases agreeing, then the smallest mean margin error, then
        the fewest skill tokens recomputed; None without a deployable remedy or a decisive case."""
        summary = self.summary()
        deployable = [name for name, row in summary.items() if not row["needs_reference"] and row["decisive"]]
        return min(
            deployable,
            default=None,
            key=lambda name: (-summary[name]["agreement"], summary[name]["mean_abs_margin_error"], summary[name]["recomputed_fraction"]),
        )

    def as_dict(self) -> dict:
        return {
            "remedies": [remedy.as_dict() for remedy in self.remedies],
            "summary": self.summary(),
            "best": self.best(),
            "agree_on_every_decisive_case": self.perfect(),
            "cases": [case.as_dict() for case in self.cases],
        }


def first_field_values(scenario: Scenario) -> list[dict[str, str]]:
    """The values a study reads a scenario at: both values (old, then new) of its first field; one case at the
    scenario's own values when it declares no field."""
    field = next(iter(scenario.fields.values()), None)
    return [{field.name: field.old}, {field.name: field.new}] if field else [{}]


def skill_prefixes(skill_ids: Sequence[str]) -> list[tuple[str, ...]]:
    """N = 1..len: the first N skills, in order."""
    return [tuple(skill_ids[:n]) for n in range(1, len(skill_ids) + 1)]


def study_plan(
    skill_sets: Sequence[Sequence[str]], placements: Sequence[str], values: Sequence[Mapping[str, str]]
) -> list[tuple[tuple[str, ...], str, Mapping[str, str]]]:
    """The composed prompts of a study in the order :func:`run_study` runs them: (skills, placement, field values)."""
    return [(tuple(skills), at, chosen) for skills in skill_sets for at in placements for chosen in values]


def run_study(
    lm: LoadedModel,
    scenario: Scenario,
    skill_sets: Sequence[Sequence[str]],
    store: SkillStore,
    *,
    remedies: Sequence[Remedy],
    placements: Sequence[str] = ("start",),
    values: Sequence[Mapping[str, str]] = ({},),
    library: Mapping | None = None,
    progress: StepProgress = None,
) -> Study:
    """Every skill set at every placement and field value, recomputed once and spliced with every remedy."""
    if not remedies or not skill_sets:
        raise KVScopeError("the study needs at least one remedy and one skill set")
    names = [remedy.name for remedy in remedies]
    if len(set(names)) != len(names):
        raise KVScopeError(f"remedies repeat: {', '.join(names)}")
    plan = study_plan(skill_sets, placements, values)
    cases, total = [], len(plan) * len(remedies)
    for index, (skills, at, chosen) in enumerate(plan):
        placed = with_skills(scenario, list(skills), at, library)
        references: dict[tuple, Recomputed] = {}
        results = {}
        for step, remedy in enumerate(remedies):
            results[remedy.name] = compare(lm, placed, store, remedy=remedy, values=chosen, references=references)
            if progress:
                progress(index * len(remedies) + step + 1, total)
        cases.append(StudyCase(scenario.name, dict(placed.values_with(**chosen)), tuple(skills), at, results))
    return Study(list(remedies), cases)
