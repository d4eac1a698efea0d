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
CLI's ``--remedy auto`` and the Composer's menu read it. A running calibration reports each step (prompt *k* of *n*,
remedy, an estimate of the time left from the steps measured so far) to every caller waiting for it, names itself at
the compute gate (so a request waiting there says what it waits for), takes turns at the gate forward by forward, and
stops before its next forward when :func:`cancel_calibration` is called, storing nothing.

:func:`model_remedies` is the Composer's menu for one model: its own default and numbers, from its stored N-skill
study, else its calibration, else the static default.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from engine.cache.budget import CancelToken, cancellable, labelled
from engine.cache.decision import DECISIVE_MARGIN
from engine.cache.loaded import LoadedModel
from engine.compose.keystone import keystone
from engine.compose.remedy import DEFAULT_REMEDY, Remedy
from engine.compose.skills import SkillStore
from engine.compose.study import Study, first_field_values, run_study, study_plan
from engine.errors import KVScopeError
from engine.models.store import cache_dir, read_json, write_json
from engine.once import SingleFlight
from engine.progress import MessageProgress, StepMessage, duration_words
from engine.scenario import Scenario, bundled_scenarios

GOAL_AGREEMENT = 0.97  # of decisive decisions (ties reported apart)
GOAL_SPEED_SHARE = 0.7  # of plain splice's median TTFT speedup, same run
KEYSTONE_MIN_DELTA = 1.0  # the keystone edit must move the recomputed decision this far to tell remedies apart
KEYSTONE_MAX_GAP = 0.15  # composed − recomputed recovery, every strategy
AUTO = "auto"
CHOICES_FILE = "remedy-choices.json"


@dataclass(frozen=True)
class CalibrationPlan:
    """The cases a per-model calibration measures: scenarios at both values of their first field, the first N skills
    for each N of ``sizes`` at each placement, every candidate remedy, then the keystone per deployable candidate
    (:func:`calibration_steps`; the embedded 0.5B model took 7 min 44 s on an idle 2-core CPU, 15–23 min under load)."""

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

    def words(self) -> str:
        """What the plan measures, counted: "8 prompts × 6 remedies, then 6 keystone runs"."""
        steps = calibration_steps(self)
        prompts = sum(step.phase == PROMPT for step in steps) // max(len(self.remedies), 1)
        keystones = sum(step.phase == KEYSTONE for step in steps)
        return f"{prompts} prompts × {len(self.remedies)} remedies" + (f", then {keystones} keystone runs" if keystones else "")


PROMPT, KEYSTONE = "prompt", "keystone"  # the two phases of a calibration


@dataclass(frozen=True)
class CalibrationStep:
    """One measured unit of a calibration: a composed prompt spliced with one remedy, or one remedy's keystone."""

    phase: str  # PROMPT or KEYSTONE
    number: int  # the prompt (or keystone run) within its phase, from 1
    of: int
    what: str  # the prompt (scenario, skills, placement, field value), or the keystone's scenario
    remedy: str

    def words(self) -> str:
        return f"{self.phase} {self.number}/{self.of} ({self.what}), remedy {self.remedy}"


def _prompt_words(scenario: str, skills: Sequence[str], placement: str, values: Mapping[str, str]) -> str:
    chosen = "".join(f", {name} = {value}" for name, value in values.items())
    return f"{scenario}, {len(skills)} skill{'' if len(skills) == 1 else 's'} at {placement}{chosen}"


def calibration_steps(plan: CalibrationPlan) -> list[CalibrationStep]:
    """Every step of a calibration in the order :func:`measure_choice` runs them (the keystone steps run only where a
    study case was decisive)."""
    prompts = [
        _prompt_words(name, skills, at, values)
        for name in plan.scenarios
        for skills, at, values in study_plan(
            [plan.skills[:size] for size in plan.sizes], plan.placements, first_field_values(Scenario.load(bundled_scenarios()[name]))
        )
    ]
    steps = [CalibrationStep(PROMPT, k, len(prompts), what, remedy) for k, what in enumerate(prompts, 1) for remedy in plan.remedies]
    deployable = [name for name in plan.remedies if not Remedy.parse(name).needs_reference] if plan.keystone_scenario else []
    return steps + [CalibrationStep(KEYSTONE, k, len(deployable), plan.keystone_scenario, name) for k, name in enumerate(deployable, 1)]


@dataclass(frozen=True)
class CalibrationProgress:
    """Where a running calibration stands: the step running now (k of n), the time so far, and the time left as
    estimated from the steps measured so far, phase by phase (a keystone run costs many study steps)."""

    model: str
    step: CalibrationStep
    index: int  # the running step, from 1
    total: int
    elapsed_s: float
    left_s: float | None  # the remaining time of the phases measured so far; None where no remaining phase is
    unmeasured: dict[str, int]  # phase -> steps left in a phase with no finished step yet

    def message(self, before: str = "") -> StepMessage:
        """:meth:`words` after ``before``, with the steps finished of the total for a progress bar."""
        return StepMessage(before + self.words(), self.index - 1, self.total)

    def words(self) -> str:
        later = " and ".join(f"{count} {phase} steps" for phase, count in self.unmeasured.items())
        if self.left_s is None:
            estimate = f"; {later} left, timed once the first of each kind ends"
        else:
            estimate = f", about {duration_words(self.left_s)} left" + (f" plus {later}, timed once the first ends" if later else "")
        return (
            f"calibrating remedy auto for {self.model}: {self.step.words()}; step {self.index} of {self.total}, "
            f"{duration_words(self.elapsed_s)} so far{estimate}"
        )


class CalibrationRun:
    """A calibration in progress: its steps, the step running now, each phase's measured step times, the callers
    hearing its progress and the token that cancels it."""

    def __init__(self, model: str, steps: Sequence[CalibrationStep], clock: Callable[[], float] = time.perf_counter) -> None:
        self.model, self.steps, self.clock = model, list(steps), clock
        self.token = CancelToken()
        self._lock = threading.Lock()
        self._listeners: list[MessageProgress] = []
        self._started = self._step_started = clock()
        self._index = 0
        self._times: dict[str, list[float]] = {}  # phase -> seconds of each finished step

    def listen(self, report: MessageProgress) -> None:
        """Tell ``report`` every step from now on."""
        with self._lock:
            self._listeners.append(report)

    def begin(self, index: int) -> CalibrationProgress:
        """Step ``index`` (from 0) starts: the running one is timed, and every listener hears where the run stands."""
        with self._lock:
            now = self.clock()
            if index > self._index:
                self._times.setdefault(self.steps[self._index].phase, []).append(now - self._step_started)
            self._index, self._step_started = index, now
            progress, listeners = self._progress(now), list(self._listeners)
        for report in listeners:
            report(progress.message())
        return progress

    def progress(self) -> CalibrationProgress:
        """Where the run stands now."""
        with self._lock:
            return self._progress(self.clock())

    def _progress(self, now: float) -> CalibrationProgress:
        ahead = self.steps[self._index :]
        left, unmeasured = None, {}
        for phase in dict.fromkeys(step.phase for step in ahead):
            remaining = sum(step.phase == phase for step in ahead)
            if phase not in self._times:
                unmeasured[phase] = remaining
                continue
            mean = statistics.fmean(self._times[phase])
            running = min(now - self._step_started, mean) if ahead[0].phase == phase else 0.0
            left = (left or 0.0) + mean * remaining - running
        return CalibrationProgress(self.model, ahead[0], self._index + 1, len(self.steps), now - self._started, left, unmeasured)

    def cancel(self) -> CalibrationProgress:
        """Stop the run before its next forward (every caller waiting for it gets :class:`~engine.cache.budget.Cancelled`)."""
        progress = self.progress()
        self.token.cancel(
            f"the calibration of {self.model} was cancelled at step {progress.index} of {progress.total} "
            f"({progress.step.words()}) after {duration_words(progress.elapsed_s)}; nothing was stored: pick a remedy from "
            "the menu, or choose auto again to start over"
        )
        return progress


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

    def numbers(self) -> str:
        """Its agreement and speed against a full recompute in a few plain words (the Composer's menu label)."""
        return f"keeps {self.agree_decisive}/{self.decisive} decisions of a full recompute, ×{self.speedup:.2f} faster first token (median)"

    def words(self) -> str:
        """:meth:`numbers` with the share agreeing, the tokens recomputed and the keystone gap."""
        keystone_words = "" if self.keystone_gap is None else f", keystone gap {self.keystone_gap:.2f}"
        return (
            f"{self.name}: keeps {self.agree_decisive}/{self.decisive} decisive decisions of a full recompute ({self.agreement:.0%}), "
            f"first token ×{self.speedup:.2f} faster than a full recompute's (median TTFT), "
            f"{self.recomputed_fraction:.0%} of skill tokens recomputed{keystone_words}"
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


def keystone_gaps(
    lm: LoadedModel, store: SkillStore, remedies: list[Remedy], scenario_name: str, starting: Callable[[int], None] | None = None
) -> dict:
    """Per deployable remedy the worst keystone recovery gap (an edit inside a spliced skill, composed vs recomputed),
    with the edit's Δmargin; no gaps where the edit moves the decision less than ``KEYSTONE_MIN_DELTA`` (the keystone
    cannot tell remedies apart there). ``starting(k)`` is called before the k-th remedy's keystone (from 0)."""
    target = Scenario.load(bundled_scenarios()[scenario_name])
    rows, recomputed = {}, None
    for index, remedy in enumerate(remedy for remedy in remedies if not remedy.needs_reference):
        if starting:
            starting(index)
        report = keystone(lm, target, store, remedy=remedy, recomputed=recomputed)
        rows[remedy.name], recomputed = report.as_dict(), report.recomputed
    return {"scenario": scenario_name, **gaps_of(rows)}


def gaps_of(rows: Mapping[str, Mapping]) -> dict:
    """From keystone reports by remedy (``KeystoneReport.as_dict()``): the edit's Δmargin and each remedy's worst gap,
    no gaps where the edit moves the decision less than ``KEYSTONE_MIN_DELTA``."""
    delta = next(iter(rows.values()))["delta_margin"] if rows else 0.0
    gaps = {name: row["max_recovery_gap"] for name, row in rows.items()} if abs(delta) >= KEYSTONE_MIN_DELTA else {}
    return {"delta_margin": delta, "gaps": gaps}


def measure_choice(
    lm: LoadedModel,
    store: SkillStore,
    plan: CalibrationPlan | None = None,
    report: MessageProgress = None,
    run: CalibrationRun | None = None,
) -> RemedyChoice:
    """Run the plan's (default: :class:`CalibrationPlan`'s) study and keystone on this model and choose (nothing is
    stored), telling ``report`` and ``run``'s listeners each step; ``run.token`` cancels it before its next forward."""
    plan = plan or CalibrationPlan()
    run = run or CalibrationRun(lm.fingerprint.name, calibration_steps(plan))
    if report:
        run.listen(report)
    with cancellable(run.token), labelled(f"calibrating remedy auto for {lm.fingerprint.name}") as relabel:
        cases, summary, gaps = _calibrate(lm, store, plan, lambda index: relabel(run.begin(index).words()))
    source = f"calibration of {lm.fingerprint.name} ({lm.fingerprint.dtype}, {lm.device.type})"
    if gaps is None:
        choice = RemedyChoice(
            DEFAULT_REMEDY.name,
            False,
            f"none of the {len(cases)} calibration cases had a decisive decision (|margin| ≥ {DECISIVE_MARGIN}): the static default",
            0.0,
            (),
            source,
        )
    else:
        choice = choose_remedy(summary, gaps, source=source)
    plan_data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(plan).items()}
    measured = {"plan": plan_data, "cases": len(cases), "seconds": round(run.progress().elapsed_s, 1), "keystone_measured": bool(gaps)}
    return replace(choice, measured=measured)


def _calibrate(lm: LoadedModel, store: SkillStore, plan: CalibrationPlan, begin: Callable[[int], None]) -> tuple[list, dict, dict | None]:
    """The plan's study cases, their summary and the keystone gaps (None where no case was decisive), calling
    ``begin(index)`` before each step of :func:`calibration_steps`."""
    remedies = [Remedy.parse(name) for name in plan.remedies]
    cases: list = []
    for name in plan.scenarios:
        offset = len(cases) * len(remedies)

        def step_done(done: int, total: int, offset: int = offset) -> None:
            if done < total:
                begin(offset + done)

        begin(offset)
        scenario = Scenario.load(bundled_scenarios()[name])
        sets = [plan.skills[:size] for size in plan.sizes]
        cases += run_study(
            lm,
            scenario,
            sets,
            store,
            remedies=remedies,
            placements=plan.placements,
            values=first_field_values(scenario),
            progress=step_done,
        ).cases
    summary = Study(remedies, cases).summary()
    if not any(row["decisive"] for row in summary.values()):
        return cases, summary, None
    if not plan.keystone_scenario:
        return cases, summary, {}
    study_steps = len(cases) * len(remedies)
    return cases, summary, keystone_gaps(lm, store, remedies, plan.keystone_scenario, lambda k: begin(study_steps + k))["gaps"]


_CALIBRATIONS: SingleFlight[RemedyChoice] = SingleFlight()
_RUNS: dict[str, CalibrationRun] = {}  # model key -> the calibration running for it
_RUNS_LOCK = threading.Lock()


def calibrated_remedy(
    lm: LoadedModel, store: SkillStore, plan: CalibrationPlan | None = None, report: MessageProgress = None, refresh: bool = False
) -> RemedyChoice:
    """This model's default remedy: the stored calibration, else measured once (concurrent callers share the run and
    hear its progress) and stored in ``<cache>/remedy-choices.json``; a cancelled run stores nothing."""
    if not refresh and (known := stored_choice(lm)) is not None:
        return known
    key = _key(lm)

    def measure_and_store() -> RemedyChoice:
        if not refresh and (known := stored_choice(lm)) is not None:  # another calibration finished meanwhile
            return known
        chosen_plan = plan or CalibrationPlan()
        run = CalibrationRun(lm.fingerprint.name, calibration_steps(chosen_plan))
        with _RUNS_LOCK:
            _RUNS[key] = run
        try:
            choice = measure_choice(lm, store, chosen_plan, report, run)
        finally:
            with _RUNS_LOCK:
                del _RUNS[key]
        path = cache_dir() / CHOICES_FILE
        choices = read_json(path)
        choices[key] = choice.as_dict()
        write_json(path, choices)
        return choice

    with _RUNS_LOCK:
        running = _RUNS.get(key)
    if running is not None and report is not None:
        report(running.progress().message("waiting for the calibration another request started: "))
        running.listen(report)
    return _CALIBRATIONS.run(key, measure_and_store)


def cancel_calibration(lm: LoadedModel) -> CalibrationProgress | None:
    """Cancel this model's running calibration before its next forward, and say where it stood (None: none runs)."""
    with _RUNS_LOCK:
        run = _RUNS.get(_key(lm))
    return run.cancel() if run is not None else None


STUDY_PATTERN = "compose_many-*.json"  # stored N-skill studies (benchmarks/results), the short one first


def same_model(stored: str | None, model: str) -> bool:
    """Whether a stored result's model (a fingerprint name such as ``qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct``) is ``model``,
    given as that name or as its alias (``qwen-1.5b``)."""
    return stored is not None and (stored == model or stored.split(":")[0] == model.split(":")[0])


def stored_study_choice(folder: Path, model: str) -> tuple[str, RemedyChoice] | None:
    """The default-remedy choice that ``model``'s stored N-skill study in ``folder`` names (the short study before the long
    one), with the file's stem; None where no stored study of that model names one."""
    for path in sorted(folder.glob(STUDY_PATTERN), key=lambda path: ("-long-" in path.stem, path.stem)):
        data = json.loads(path.read_text())
        if data.get("choice") and same_model(data.get("model"), model):
            return path.stem, RemedyChoice.from_dict(data["choice"])
    return None


@dataclass(frozen=True)
class ModelRemedies:
    """What the Composer offers one model: its default remedy, and the measured choice whose numbers label the menu."""

    model: str
    default: str
    choice: RemedyChoice | None  # None: nothing measured for this model, the static default
    source: str | None  # the stored study's file stem, "calibration", or None

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "default": self.default,
            "source": self.source,
            "choice": self.choice.as_dict() if self.choice else None,
        }


def model_remedies(model: str, folder: Path, lm: LoadedModel | None = None) -> ModelRemedies:
    """``model``'s menu (an alias or fingerprint name): its stored N-skill study in ``folder`` (the rule's choice and every
    remedy's numbers there), else the loaded ``lm``'s stored calibration, else the static
    :data:`~engine.compose.remedy.DEFAULT_REMEDY` with no numbers."""
    stored = stored_study_choice(folder, model)
    if stored is not None:
        return ModelRemedies(model, stored[1].remedy, stored[1], stored[0])
    calibrated = stored_choice(lm) if lm is not None else None
    if calibrated is not None:
        return ModelRemedies(model, calibrated.remedy, calibrated, "calibration")
    return ModelRemedies(model, DEFAULT_REMEDY.name, None, None)


def resolve_remedy(lm: LoadedModel, text: str | None, store: SkillStore, report: MessageProgress = None) -> Remedy:
    """A remedy spec, where ``auto`` is this model's calibrated default (measured once when it was not) and empty is
    the static :data:`~engine.compose.remedy.DEFAULT_REMEDY`."""
    spec = (text or "").strip()
    if spec == AUTO:
        return Remedy.parse(calibrated_remedy(lm, store, report=report).remedy)
    return Remedy.parse(spec) if spec else DEFAULT_REMEDY
