"""Which remedy the composer offers by default: one rule over measurements, calibrated once per model.

A remedy is *deployable* when a server could run it (nothing ranked against a full recompute). The goal: at least
``GOAL_AGREEMENT`` of the decisive decisions agree with a full recompute while the median TTFT speedup keeps at least
``GOAL_SPEED_SHARE`` of plain splice's, both measured in the same run. :func:`choose_remedy` reads a study summary
(``Study.summary()`` or a stored study's ``"summary"``):

1. where the keystone was measured (an edit inside a spliced skill; ``KEYSTONE_MAX_GAP``), remedies failing its bar
   are set aside, unless every measured remedy fails it;
2. of the remedies meeting the goal, the fastest;
3. else the best measured trade-off: the largest sum of the two goals' attained shares,
   ``min(agreement / 0.97, 1) + min(speedup / (0.7 × splice's), 1)``, then the fastest.

:func:`calibrated_remedy` measures a small N-skill study on the bundled skills (and the keystone) once per model
fingerprint and device and keeps the choice in ``<cache>/remedy-choices.json``, as the dtype choice is kept; the
CLI's ``--remedy auto`` and the Composer's menu read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from engine.cache.decision import DECISIVE_MARGIN
from engine.cache.loaded import LoadedModel
from engine.compose.keystone import keystone
from engine.compose.skills import SkillStore
from engine.compose.splice import DEFAULT_REMEDY, Remedy
from engine.compose.study import Study, first_field_values, run_study
from engine.errors import KVScopeError
from engine.models.store import cache_dir, read_json, write_json
from engine.once import SingleFlight
from engine.progress import MessageProgress
from engine.scenario import Scenario, bundled_scenarios
from engine.timing import Stopwatch

GOAL_AGREEMENT = 0.97  # of decisive decisions (ties reported apart)
GOAL_SPEED_SHARE = 0.7  # of plain splice's median TTFT speedup, same run
KEYSTONE_MIN_DELTA = 1.0  # the keystone edit must move the recomputed decision this far to tell remedies apart
KEYSTONE_MAX_GAP = 0.15  # composed − recomputed recovery, every strategy
AUTO = "auto"
CHOICES_FILE = "remedy-choices.json"


@dataclass(frozen=True)
class CalibrationPlan:
    """The cases a per-model calibration measures: scenarios at both values of their first field, the first N skills
    for each N of ``sizes`` at each placement, every candidate remedy, then the keystone per candidate (about 8 minutes
    for the 0.5B model on a 2-core CPU)."""

    scenarios: tuple[str, ...] = ("refund_gate",)
    skills: tuple[str, ...] = ("refund_policy", "tone_guide", "tool_specs", "rag_shipping_facts")
    sizes: tuple[int, ...] = (2, 4)
    placements: tuple[str, ...] = ("start", "end")
    remedies: tuple[str, ...] = (
        "splice",
        "prefix+seam:1",
        "prefix+seam:1+query:0.05",
        "prefix+seam:1+query:0.15",
        "prefix+seam:1+blend:0.15",
        "prefix+seam:1+blend:0.3",
    )
    keystone_scenario: str | None = "keystone_safety"


@dataclass(frozen=True)
class RemedyPoint:
    """One deployable remedy's measured agreement and cost."""

    name: str
    agree_decisive: int
    decisive: int
    ties: int
    agreement: float
    speedup: float  # median TTFT of the full recompute over the splice
    recomputed_fraction: float
    mean_abs_margin_error: float | None
    keystone_gap: float | None = None  # worst |composed − recomputed recovery|; None where not measured

    @classmethod
    def of(cls, name: str, row: Mapping, keystone_gap: float | None = None) -> RemedyPoint:
        return cls(
            name,
            row["agree_decisive"],
            row["decisive"],
            row["ties"],
            row["agreement"],
            row["speedup"]["median"],
            row["recomputed_fraction"],
            row["mean_abs_margin_error"],
            keystone_gap,
        )

    def words(self) -> str:
        keystone_words = "" if self.keystone_gap is None else f", keystone gap {self.keystone_gap:.2f}"
        return (
            f"{self.name}: {self.agree_decisive}/{self.decisive} decisive decisions agree ({self.agreement:.0%}), "
            f"TTFT ×{self.speedup:.2f} (median), {self.recomputed_fraction:.0%} of skill tokens recomputed{keystone_words}"
        )


@dataclass(frozen=True)
class RemedyChoice:
    """The remedy the rule picks (see the module docstring), why, and the measured points it chose from."""

    remedy: str
    goal_met: bool
    reason: str
    splice_speedup: float
    points: tuple[RemedyPoint, ...]
    source: str = ""  # where the numbers come from (a study file, or a calibration of a model)
    measured: dict = field(default_factory=dict)  # what a calibration ran: plan, dtype, device, seconds

    def point(self, name: str) -> RemedyPoint:
        return next(point for point in self.points if point.name == name)

    @property
    def chosen(self) -> RemedyPoint | None:
        """The chosen remedy's measured point (None for a fallback measured on no decisive case)."""
        return next((point for point in self.points if point.name == self.remedy), None)

    @property
    def fastest(self) -> RemedyPoint | None:
        """The fastest measured deployable remedy (may be the chosen one)."""
        return max(self.points, key=lambda point: point.speedup, default=None)

    @property
    def most_faithful(self) -> RemedyPoint | None:
        """The deployable remedy with the most decisive agreement, then the smallest margin error."""
        return max(self.points, key=lambda point: (point.agreement, -(point.mean_abs_margin_error or 0.0)), default=None)

    def frontier(self) -> list[RemedyPoint]:
        """Points no other point beats on both agreement and speedup, fastest first."""
        return sorted(
            (
                p
                for p in self.points
                if not any(
                    q.agreement >= p.agreement and q.speedup >= p.speedup and (q.agreement, q.speedup) != (p.agreement, p.speedup)
                    for q in self.points
                )
            ),
            key=lambda point: -point.speedup,
        )

    def as_dict(self) -> dict:
        return {
            "remedy": self.remedy,
            "goal_met": self.goal_met,
            "goal": {"agreement": GOAL_AGREEMENT, "speed_share_of_splice": GOAL_SPEED_SHARE, "keystone_max_gap": KEYSTONE_MAX_GAP},
            "reason": self.reason,
            "splice_speedup": self.splice_speedup,
            "fastest": self.fastest.name if self.fastest else None,
            "most_faithful": self.most_faithful.name if self.most_faithful else None,
            "frontier": [point.name for point in self.frontier()],
            "points": [asdict(point) for point in self.points],
            "source": self.source,
            "measured": self.measured,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> RemedyChoice:
        points = tuple(RemedyPoint(**point) for point in data["points"])
        return cls(data["remedy"], data["goal_met"], data["reason"], data["splice_speedup"], points, data["source"], dict(data["measured"]))


def _attained(point: RemedyPoint, speed_goal: float) -> float:
    return min(point.agreement / GOAL_AGREEMENT, 1.0) + min(point.speedup / speed_goal, 1.0)


def choose_remedy(summary: Mapping[str, Mapping], gaps: Mapping[str, float | None] | None = None, source: str = "") -> RemedyChoice:
    """The default remedy for a study summary (and, where measured, each remedy's worst keystone gap), by the rule of
    the module docstring."""
    gaps = gaps or {}
    points = [
        RemedyPoint.of(name, row, gaps.get(name))
        for name, row in summary.items()
        if not row["needs_reference"] and row["decisive"] and row["speedup"]
    ]
    if not points:
        raise KVScopeError("no deployable remedy with a decisive case and a measured speedup to choose from")
    splice = next((point.speedup for point in points if point.name == "splice"), max(point.speedup for point in points))
    speed_goal = GOAL_SPEED_SHARE * splice
    passing = [point for point in points if point.keystone_gap is not None and point.keystone_gap <= KEYSTONE_MAX_GAP]
    measured_keystone = any(point.keystone_gap is not None for point in points)
    pool = passing if passing else points
    keystone_words = ""
    if measured_keystone:
        keystone_words = (
            f" among the remedies within the keystone bar (gap ≤ {KEYSTONE_MAX_GAP})"
            if passing
            else f" (no remedy is within the keystone bar, gap ≤ {KEYSTONE_MAX_GAP}: all were kept)"
        )
    goal = [point for point in pool if point.agreement >= GOAL_AGREEMENT and point.speedup >= speed_goal]
    if goal:
        chosen = max(goal, key=lambda point: (point.speedup, -point.recomputed_fraction))
        reason = (
            f"the fastest remedy keeping ≥ {GOAL_AGREEMENT:.0%} decisive agreement and ≥ {GOAL_SPEED_SHARE:.0%} of splice's "
            f"×{splice:.2f}{keystone_words}"
        )
    else:
        chosen = max(pool, key=lambda point: (round(_attained(point, speed_goal), 6), point.speedup))
        reason = (
            f"no remedy keeps ≥ {GOAL_AGREEMENT:.0%} decisive agreement at ≥ {GOAL_SPEED_SHARE:.0%} of splice's ×{splice:.2f} "
            f"(≥ ×{speed_goal:.2f}); this is the best measured trade-off{keystone_words}, by the largest sum of the shares of "
            "both goals attained"
        )
    return RemedyChoice(chosen.name, bool(goal), reason, splice, tuple(points), source)


def choice_record(summary: Mapping[str, Mapping], gaps: Mapping[str, float | None] | None = None, source: str = "") -> dict:
    """What a stored study says of its default: ``default`` and ``choice`` (:func:`choose_remedy`), both None with the
    reason in ``no_default`` where nothing deployable had a decisive case."""
    try:
        choice = choose_remedy(summary, gaps, source)
    except KVScopeError as error:
        return {"default": None, "choice": None, "no_default": str(error)}
    return {"default": choice.remedy, "choice": choice.as_dict()}


def _key(lm: LoadedModel) -> str:
    fingerprint = lm.fingerprint
    return f"{fingerprint.name}|{fingerprint.config_hash}|{fingerprint.dtype}|{lm.device.type}"


def stored_choice(lm: LoadedModel) -> RemedyChoice | None:
    """This model's calibrated choice, when one was measured on this kind of device."""
    data = read_json(cache_dir() / CHOICES_FILE).get(_key(lm))
    return RemedyChoice.from_dict(data) if data else None


def keystone_gaps(lm: LoadedModel, store: SkillStore, remedies: list[Remedy], scenario_name: str, report: MessageProgress = None) -> dict:
    """Per deployable remedy the worst keystone recovery gap (an edit inside a spliced skill, composed vs recomputed),
    with the edit's Δmargin; no gaps where the edit moves the decision less than ``KEYSTONE_MIN_DELTA`` (the keystone
    cannot tell remedies apart there)."""
    target = Scenario.load(bundled_scenarios()[scenario_name])
    rows = {}
    for remedy in (remedy for remedy in remedies if not remedy.needs_reference):
        if report:
            report(f"keystone with {remedy.name}")
        rows[remedy.name] = keystone(lm, target, store, remedy=remedy).as_dict()
    return {"scenario": scenario_name, **gaps_of(rows)}


def gaps_of(rows: Mapping[str, Mapping]) -> dict:
    """From keystone reports by remedy (``KeystoneReport.as_dict()``): the edit's Δmargin and each remedy's worst gap,
    no gaps where the edit moves the decision less than ``KEYSTONE_MIN_DELTA``."""
    delta = next(iter(rows.values()))["delta_margin"] if rows else 0.0
    gaps = {name: row["max_recovery_gap"] for name, row in rows.items()} if abs(delta) >= KEYSTONE_MIN_DELTA else {}
    return {"delta_margin": delta, "gaps": gaps}


def measure_choice(lm: LoadedModel, store: SkillStore, plan: CalibrationPlan | None = None, report: MessageProgress = None) -> RemedyChoice:
    """Run the plan's (default: :class:`CalibrationPlan`'s) study and keystone on this model and choose (nothing is stored)."""
    plan = plan or CalibrationPlan()
    watch, say = Stopwatch(), report or (lambda message: None)
    remedies = [Remedy.parse(name) for name in plan.remedies]
    cases = []
    for name in plan.scenarios:
        scenario = Scenario.load(bundled_scenarios()[name])
        say(f"calibrating the composer's remedy on {name} ({', '.join(map(str, plan.sizes))} skills at {', '.join(plan.placements)})")
        study = run_study(
            lm,
            scenario,
            [plan.skills[:size] for size in plan.sizes],
            store,
            remedies=remedies,
            placements=plan.placements,
            values=first_field_values(scenario),
            progress=lambda done, total, name=name: say(f"{name}: {done}/{total} splices"),
        )
        cases += study.cases
    summary = Study(remedies, cases).summary()
    source = f"calibration of {lm.fingerprint.name} ({lm.fingerprint.dtype}, {lm.device.type})"
    if not any(row["decisive"] for row in summary.values()):
        choice = RemedyChoice(
            DEFAULT_REMEDY.name,
            False,
            f"none of the {len(cases)} calibration cases had a decisive decision (|margin| ≥ {DECISIVE_MARGIN}): the static default",
            0.0,
            (),
            source,
        )
        gaps: dict = {}
    else:
        gaps = keystone_gaps(lm, store, remedies, plan.keystone_scenario, say)["gaps"] if plan.keystone_scenario else {}
        choice = choose_remedy(summary, gaps, source=source)
    plan_data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(plan).items()}
    measured = {"plan": plan_data, "cases": len(cases), "seconds": round(watch.ms / 1000, 1), "keystone_measured": bool(gaps)}
    return replace(choice, measured=measured)


_CALIBRATIONS: SingleFlight[RemedyChoice] = SingleFlight()


def calibrated_remedy(
    lm: LoadedModel, store: SkillStore, plan: CalibrationPlan | None = None, report: MessageProgress = None, refresh: bool = False
) -> RemedyChoice:
    """This model's default remedy: the stored calibration, else measured once (concurrent callers share the run) and
    stored in ``<cache>/remedy-choices.json``."""
    if not refresh and (known := stored_choice(lm)) is not None:
        return known

    def measure_and_store() -> RemedyChoice:
        choice = measure_choice(lm, store, plan, report)
        path = cache_dir() / CHOICES_FILE
        choices = read_json(path)
        choices[_key(lm)] = choice.as_dict()
        write_json(path, choices)
        return choice

    return _CALIBRATIONS.run(_key(lm), measure_and_store)


def resolve_remedy(lm: LoadedModel, text: str | None, store: SkillStore, report: MessageProgress = None) -> Remedy:
    """A remedy spec, where ``auto`` is this model's calibrated default (measured once when it was not) and empty is
    the static :data:`~engine.compose.splice.DEFAULT_REMEDY`."""
    spec = (text or "").strip()
    if spec == AUTO:
        return Remedy.parse(calibrated_remedy(lm, store, report=report).remedy)
    return Remedy.parse(spec) if spec else DEFAULT_REMEDY
