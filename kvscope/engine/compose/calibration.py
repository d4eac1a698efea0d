"""This model's default remedy, calibrated once (``--remedy auto``), and what the Composer offers each model.

:func:`calibrated_remedy` measures a small N-skill study on the bundled skills (and the keystone) once per model
fingerprint and device, applies :func:`kvscope.engine.compose.choice.choose_remedy` and keeps the choice in
``<cache>/remedy-choices.json``, as the dtype choice is kept; the CLI's ``--remedy auto`` and the Composer's menu read
it. A running calibration reports each step (prompt *k* of *n*, remedy, an estimate of the time left from the steps
measured so far) to every caller waiting for it, names itself at the compute gate (so a request waiting there says
what it waits for), takes turns at the gate forward by forward, and stops before its next forward when
:func:`cancel_calibration` is called, storing nothing.

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

from kvscope.engine.cache.budget import CancelToken, cancellable, labelled
from kvscope.engine.cache.decision import DECISIVE_MARGIN
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.choice import RemedyChoice, choose_remedy, keystone_gaps
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.speed import SpeedupFit, speedup_fits
from kvscope.engine.compose.study import Study, first_field_values, run_study, study_plan
from kvscope.engine.jsonable import attributes
from kvscope.engine.models.store import cache_dir, read_json, write_json
from kvscope.engine.once import SingleFlight
from kvscope.engine.progress import MessageProgress, StepMessage, duration_words
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.engine.words import counted

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
        "prefix+seam:1+blend:0.15",
        "prefix+seam:1+blend:0.3",
        "prefix+ape:0.9,0.9",  # APE recomputes nothing: the default on qwen-1.5b's short study is an ape setting
        "prefix+ape:1,0.7",
    )
    keystone_scenario: str | None = "keystone_safety"

    def words(self) -> str:
        """What the plan measures, counted: "8 prompts × 6 remedies, then 6 keystone runs"."""
        steps = calibration_steps(self)
        prompts = sum(step.phase == PROMPT for step in steps) // max(len(self.remedies), 1)
        keystones = sum(step.phase == KEYSTONE for step in steps)
        return f"{counted(prompts, 'prompt')} × {counted(len(self.remedies), 'remedy', 'remedies')}" + (
            f", then {counted(keystones, 'keystone run')}" if keystones else ""
        )


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
        """Stop the run before its next forward (every caller waiting for it gets :class:`~kvscope.engine.cache.budget.Cancelled`)."""
        progress = self.progress()
        self.token.cancel(
            f"the calibration of {self.model} was cancelled at step {progress.index} of {progress.total} "
            f"({progress.step.words()}) after {duration_words(progress.elapsed_s)}; nothing was stored: pick a remedy from "
            "the menu, or choose auto again to start over"
        )
        return progress


def _key(lm: LoadedModel) -> str:
    fingerprint = lm.fingerprint
    return f"{fingerprint.name}|{fingerprint.config_hash}|{fingerprint.dtype}|{lm.device.type}"


def stored_choice(lm: LoadedModel) -> RemedyChoice | None:
    """This model's calibrated choice, when one was measured on this kind of device."""
    data = read_json(cache_dir() / CHOICES_FILE).get(_key(lm))
    return RemedyChoice.from_dict(data) if data else None


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
    measured = {
        "plan": plan_data,
        "cases": len(cases),
        "seconds": round(run.progress().elapsed_s, 1),
        "keystone_separates_remedies": bool(gaps),  # the keystone ran and its edit moved the decision enough to judge remedies
    }
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


STUDY_PATTERN = "compose_many-*.json"  # stored N-skill studies (benchmarks/studies/results), the short one first


def same_model(stored: str | None, model: str) -> bool:
    """Whether a stored result's model (a fingerprint name such as ``qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct``) is ``model``,
    given as that name or as its alias (``qwen-1.5b``)."""
    return stored is not None and (stored == model or stored.split(":")[0] == model.split(":")[0])


def stored_study_choice(folder: Path, model: str) -> tuple[str, RemedyChoice, dict[str, SpeedupFit]] | None:
    """The default-remedy choice that ``model``'s stored N-skill study in ``folder`` names (the short study before the long
    one), with the file's stem and each remedy's speed-up fit over its cases; None where no stored study of that model
    names one."""
    for path in sorted(folder.glob(STUDY_PATTERN), key=lambda path: ("-long-" in path.stem, path.stem)):
        data = json.loads(path.read_text())
        if data.get("choice") and same_model(data.get("model"), model):
            return path.stem, RemedyChoice.from_dict(data["choice"]), speedup_fits(data.get("cases", ()))
    return None


@dataclass(frozen=True)
class ModelRemedies:
    """What the Composer offers one model: its default remedy, and the measured choice whose numbers label the menu."""

    model: str
    default: str
    choice: RemedyChoice | None  # None: nothing measured for this model, the static default
    source: str | None  # the stored study's file stem, "calibration", or None
    speed: dict[str, SpeedupFit] = field(default_factory=dict)  # remedy -> its speed-up against the context length (stored study)

    def measured_at(self, remedy: str) -> str | None:
        """Where the menu's speed-up of ``remedy`` was measured ("451–1,711-token contexts"); None where unknown."""
        fit = self.speed.get(remedy)
        return fit.measured_words() if fit else None

    def predicted(self, remedy: str, tokens: int) -> str | None:
        """What the stored study's points predict for ``remedy`` at ``tokens`` context tokens, in words (None: no fit)."""
        fit = self.speed.get(remedy)
        return fit.words(tokens) if fit else None

    def as_dict(self) -> dict:
        return attributes(self, "model", "default", "source", "choice")


def model_remedies(model: str, folder: Path, lm: LoadedModel | None = None) -> ModelRemedies:
    """``model``'s menu (an alias or fingerprint name): its stored N-skill study in ``folder`` (the rule's choice and every
    remedy's numbers there), else the loaded ``lm``'s stored calibration, else the static
    :data:`~kvscope.engine.compose.remedy.DEFAULT_REMEDY` with no numbers."""
    stored = stored_study_choice(folder, model)
    if stored is not None:
        return ModelRemedies(model, stored[1].remedy, stored[1], stored[0], stored[2])
    calibrated = stored_choice(lm) if lm is not None else None
    if calibrated is not None:
        return ModelRemedies(model, calibrated.remedy, calibrated, "calibration")
    return ModelRemedies(model, DEFAULT_REMEDY.name, None, None)


def resolve_remedy(
    lm: LoadedModel, text: str | None, store: SkillStore, report: MessageProgress = None, *, default: str | None = None
) -> Remedy:
    """A remedy spec, where ``auto`` is this model's calibrated default (measured once when it was not) and empty is
    ``default`` (the model's own, :func:`model_remedies`), else the static :data:`~kvscope.engine.compose.remedy.DEFAULT_REMEDY`."""
    spec = (text or "").strip()
    if spec == AUTO:
        return Remedy.parse(calibrated_remedy(lm, store, report=report).remedy)
    if spec:
        return Remedy.parse(spec)
    return Remedy.parse(default) if default else DEFAULT_REMEDY
