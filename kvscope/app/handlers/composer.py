"""The Composer tab's handlers: skills spliced into a context vs a full recompute, the remedy menu and ``auto``'s
calibration, a picture's K/V, the keystone, the agent loop and the N-skill study."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from kvscope.app.handlers import benchmarks as stored_results
from kvscope.app.handlers.common import AppCancelled, AppError, bundled_scenario_text, guarded, number, parse_scenario
from kvscope.app.hosting import HostingProfile
from kvscope.app.state import ModelRegistry
from kvscope.engine import (
    AUTO_REMEDY,
    IMAGE_QUESTION,
    PLACEMENTS,
    CancelToken,
    LoadedModel,
    MessageProgress,
    ModelRemedies,
    Remedy,
    Scenario,
    Skill,
    StepProgress,
    adhoc_scenario,
    bundled_skills,
    cancel_calibration,
    cancellable,
    check_vision_model,
    compare,
    compare_image,
    compose_scenario,
    first_field_values,
    keystone,
    model_remedies,
    resolve_remedy,
    run_agent,
    run_study,
    skill_prefixes,
    stored_choice,
)
from kvscope.viz import compose as compose_figures
from kvscope.viz import text as panels
from kvscope.viz.common import markdown_literal

COMPOSER_TIMED_ROUNDS = 2  # rounds of splice and full recompute, alternating, after one untimed warm-up round
MAX_PICTURE_SIDE = 448  # pixels: an uploaded picture is scaled down to fit (a few hundred image tokens at most)


@dataclass(frozen=True)
class Composition:
    """The composer's context: literal text before the skills, the skills in order (literal text between them), then a
    bundled scenario (None or empty: a generic yes/no question); ``remedy`` repairs the spliced skills (empty: the
    default, ``auto``: this model's calibrated choice)."""

    skills: Sequence[str]
    before: str | None = ""
    between: str | None = ""
    after: str | None = None
    remedy: str | None = None


def selection(registry: ModelRegistry, spec: str | None, composition: Composition) -> dict:
    """What the page selects, as a result carries it (``"selection"``): the model and the composition, empty values alike."""
    return {
        "model": (spec or "").strip() or registry.default_spec,
        "skills": list(composition.skills or ()),
        "before": composition.before or "",
        "between": composition.between or "",
        "scenario": composition.after or "",
        "remedy": (composition.remedy or "").strip(),
    }


def stale_words(shown: dict | None, current: dict, rerunning: bool) -> str:
    """The line above a result whose selection (``shown["selection"]``) is not the page's: what it was computed for, and
    what happens now (Markdown); empty where the result is the page's own, or none is shown."""
    was = (shown or {}).get("selection") if isinstance(shown, dict) else None
    if was is None or was == current:
        return ""
    changed = ", ".join(name for name in current if was.get(name) != current[name])
    what = "it is being recomputed for the page's selection" if rerunning else "press **Splice vs recompute** for the page's selection"
    skills = ", ".join(was.get("skills", [])) or "none"
    return (
        f"⚠️ The result below was computed for an earlier selection ({markdown_literal(changed)} differ: skills "
        f"{markdown_literal(skills)}, remedy {markdown_literal(was.get('remedy') or 'default')}); {what}."
    )


class ComposerRuns:
    """Each browser session's newest Composer selection and its run: a new selection cancels the session's run for an
    older one (before its next forward) and drops its result; a session's runs take turns, so an earlier run's work never
    overlaps a later run's timed rounds (and the timed rounds hold the model: see :func:`kvscope.engine.compare`)."""

    SUPERSEDED = "superseded by a newer selection on the page: its result is not shown"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        self._latest: dict[str, tuple[int, dict]] = {}  # session -> its newest selection's ticket, and that selection
        self._running: dict[str, tuple[int, CancelToken]] = {}  # session -> the ticket and token of its run in flight
        self._turns: dict[str, threading.Lock] = {}  # session -> one run at a time

    def select(self, session: str, chosen: dict) -> int:
        """The page of ``session`` shows the selection ``chosen`` (:func:`selection`): its ticket. A selection other than
        the newest gets a new ticket and cancels the session's run for an earlier one; the same selection again (two
        changes that one click made) keeps its ticket."""
        with self._lock:
            newest = self._latest.get(session)
            if newest is not None and newest[1] == chosen:
                return newest[0]
            ticket = next(self._tickets)
            self._latest[session] = (ticket, chosen)
            running = self._running.get(session)
        if running is not None:
            running[1].cancel(self.SUPERSEDED)
        return ticket

    def latest(self, session: str, ticket: int) -> bool:
        """Whether ``ticket`` is still the session's newest selection."""
        with self._lock:
            return self._latest.get(session, (None,))[0] == ticket

    @contextmanager
    def running(self, session: str, ticket: int) -> Iterator[CancelToken]:
        """Within: the session's run for ``ticket``, once its earlier run has ended; every forward checks the yielded
        token, which a newer selection cancels (a run for a selection already superseded stops at its first forward)."""
        with self._lock:
            turn = self._turns.setdefault(session, threading.Lock())
        with turn:
            token = CancelToken()
            with self._lock:
                self._running[session] = (ticket, token)
                if self._latest.get(session, (None,))[0] != ticket:
                    token.cancel(self.SUPERSEDED)
            try:
                with cancellable(token):
                    yield token
            finally:
                with self._lock:
                    if self._running.get(session, (None,))[0] == ticket:
                        del self._running[session]


@dataclass
class ComposeView:
    """What the Composer shows after splice vs recompute; ``summary`` carries the selection it was computed for."""

    metrics_markdown: str
    logits_figure: go.Figure
    deviation_figure: go.Figure
    summary: dict
    speed_markdown: str  # the menu's speed-ups: where they were measured, and what this context's length predicts


def skill_library() -> dict[str, str]:
    """Skill id -> title, for the composer."""
    return {skill_id: Skill.load(path).title for skill_id, path in bundled_skills().items()}


@guarded
def composed_scenario(composition: Composition, profile: HostingProfile | None = None) -> Scenario:
    """The composer's context as a scenario (the user's text kept literal)."""
    before, between = composition.before or "", composition.between or ""
    if profile is not None:
        profile.check_scenario_text(f"{before}{between}")
    base = parse_scenario(bundled_scenario_text(composition.after)) if composition.after else None
    return compose_scenario(composition.skills, before, between, base)


# ---------------------------------------------------------------------------- remedies
def model_menu(registry: ModelRegistry, spec: str | None) -> ModelRemedies:
    """The remedy menu of the model ``spec`` names (:func:`kvscope.engine.model_remedies`): the choice its own stored N-skill study
    names, else its stored calibration where it is loaded, else the static default. Nothing is loaded."""
    resolved = registry.resolve(spec)
    lm = registry.in_memory(resolved)
    return model_remedies(lm.fingerprint.name if lm else resolved, stored_results.STUDY_RESULTS, lm)


def remedy_info(registry: ModelRegistry, spec: str | None) -> str:
    """What the model's default remedy costs and buys where it was measured, the fastest alternative beside it (plain text)."""
    menu = model_menu(registry, spec)
    return panels.remedy_info(menu.default, menu.source, menu.choice, model=menu.model)


def remedy_summary(registry: ModelRegistry, spec: str | None) -> str:
    """The remedy menu's one-line info: the model's default and its numbers where it was measured."""
    menu = model_menu(registry, spec)
    return panels.remedy_summary(menu.default, menu.choice, model=menu.model, measured_at=menu.measured_at(menu.default))


def remedy_menu(registry: ModelRegistry, spec: str | None, names: Sequence[str]) -> list[tuple[str, str]]:
    """(label, spec) pairs for the Composer's menu: the model's default and ``auto`` first, each remedy labelled with its
    agreement and speedup where the model's default was measured."""
    menu = model_menu(registry, spec)
    names = [*dict.fromkeys([menu.default, *names])]
    where = {name: at for name in names if (at := menu.measured_at(name))}
    return panels.remedy_menu(menu.default, AUTO_REMEDY, names, menu.choice, where)


def remedy_for(registry: ModelRegistry, spec: str | None, lm: LoadedModel, text, report: MessageProgress | None = None) -> Remedy:
    """The composer's remedy for this model (:func:`kvscope.engine.resolve_remedy`: empty is the model's default, ``auto`` its
    calibrated choice), refused where ``auto`` would calibrate on a server that does not run calibrations for visitors."""
    if text is not None and not isinstance(text, str):
        raise AppError(f"the remedy must be a spec such as prefix+seam:1 (parts joined by +), got {text!r}")
    default = model_menu(registry, spec).default
    calibrates = (text or "").strip() == AUTO_REMEDY and stored_choice(lm) is None
    if calibrates and not registry.profile.calibrate_remedies:
        raise AppError(
            f"remedy auto needs {lm.fingerprint.name}'s calibration (minutes of model time), which {registry.profile.label} "
            f"does not run for visitors; pick a remedy from the menu (default {default})"
        )
    return resolve_remedy(lm, text, registry.skills(spec), report, default=default)


def calibration_pending(registry: ModelRegistry, spec: str | None, remedy: str | None) -> bool:
    """Whether splicing with ``remedy`` would first calibrate the model (``auto`` without a stored choice, on a server that
    runs calibrations): what a Cancel button is for. A model not in memory is not loaded for this (it would calibrate)."""
    if (remedy or "").strip() != AUTO_REMEDY or not registry.profile.calibrate_remedies:
        return False
    spec = registry.resolve(spec)
    return spec not in registry.loaded() or stored_choice(registry.get(spec)) is None


def stop_calibration(registry: ModelRegistry, spec: str | None) -> str:
    """Cancel the running ``auto`` calibration of the model ``spec`` names (it stops before its next forward and stores
    nothing); says what was cancelled (Markdown). A model not in memory is not loaded for this."""
    spec = registry.resolve(spec)
    if spec not in registry.loaded():
        return f"No calibration of {markdown_literal(spec)} is running (the model is not loaded)."
    lm = registry.get(spec)
    stopped = cancel_calibration(lm)
    if stopped is None:
        return f"No calibration of {markdown_literal(lm.fingerprint.name)} is running."
    return (
        f"Cancelled the calibration of {markdown_literal(lm.fingerprint.name)} at step {stopped.index} of {stopped.total} "
        f"({markdown_literal(stopped.step.words())}): it stops before its next forward and stores nothing."
    )


# ---------------------------------------------------------------------------- splice, picture, keystone, agent, study
@guarded
def run_compose(
    registry: ModelRegistry, composition: Composition, *, spec: str | None = None, report: MessageProgress | None = None
) -> ComposeView:
    """Splice the composed skills (repaired by the composition's remedy; ``auto`` calibrates the model once, telling
    ``report``) and compare with a full recompute, both timed in this call."""
    lm = registry.get(spec)
    scenario = composed_scenario(composition, registry.profile)
    remedy = remedy_for(registry, spec, lm, composition.remedy, report)
    fidelity = compare(lm, scenario, registry.skills(spec), remedy=remedy, reps=COMPOSER_TIMED_ROUNDS, warmup=1)
    decode = lambda token: lm.tokenizer.decode([token])  # noqa: E731
    chosen = selection(registry, spec, composition)
    return ComposeView(
        metrics_markdown=f"{compose_figures.selection_markdown(chosen)}  \n{panels.compose_metrics_markdown(fidelity)}",
        logits_figure=compose_figures.logit_bars_figure(fidelity.spliced, fidelity.recomputed, fidelity.agreement, decode),
        deviation_figure=compose_figures.deviation_figure(fidelity),
        summary={"model": lm.fingerprint.name, **fidelity.as_dict(), "selection": chosen},
        speed_markdown=compose_figures.speed_markdown(model_menu(registry, spec), fidelity),
    )


def compose_for_page(
    registry: ModelRegistry,
    runs: ComposerRuns,
    session: str,
    ticket: int | None,
    composition: Composition,
    *,
    spec: str | None = None,
    report: MessageProgress | None = None,
) -> ComposeView | None:
    """:func:`run_compose` for the page of ``session`` (``ticket``: its selection, None for an API call, which is its own
    newest selection), after the session's earlier run; None where a newer selection superseded it (cancelled before its
    next forward, or finished but no longer the page's), so that its result is never shown. A calibration the person
    cancelled raises :class:`AppCancelled`, as :func:`run_compose` does."""
    ticket = runs.select(session, selection(registry, spec, composition)) if ticket is None else ticket
    try:
        with runs.running(session, ticket):
            view = run_compose(registry, composition, spec=spec, report=report)
    except AppCancelled:
        if runs.latest(session, ticket):
            raise
        return None
    return view if runs.latest(session, ticket) else None


def fitted_picture(picture: np.ndarray) -> np.ndarray:
    """An uploaded picture as RGB, scaled down (aspect kept) so that neither side exceeds MAX_PICTURE_SIDE."""
    image = Image.fromarray(np.asarray(picture, dtype=np.uint8)).convert("RGB")
    image.thumbnail((MAX_PICTURE_SIDE, MAX_PICTURE_SIDE))
    return np.asarray(image)


@guarded
def run_image_compose(
    registry: ModelRegistry,
    spec: str | None = None,
    *,
    picture: np.ndarray | None,
    before: str | None = "",
    after: str | None = "",
    question: str | None = "",
    seam=0,
) -> tuple[str, go.Figure, dict]:
    """Splice a picture's stored K/V after ``before`` (seam repair ``seam``) vs a full recompute from its pixels."""
    if picture is None:
        raise AppError("add a picture first (the bundled shipping label is the default)")
    lm = registry.get(spec)
    check_vision_model(lm)
    result = compare_image(
        lm,
        fitted_picture(picture),
        "picture",
        before=before or "",
        after=after or "",
        question=(question or "").strip() or IMAGE_QUESTION,
        seam=int(number(seam, "seam", 0)),
    )
    decode = lambda token: lm.tokenizer.decode([token])  # noqa: E731
    return (
        panels.image_metrics_markdown(result),
        compose_figures.logit_bars_figure(result.spliced, result.recomputed, result.agreement, decode),
        {"model": lm.fingerprint.name, **result.as_dict()},
    )


@guarded
def run_keystone(
    registry: ModelRegistry, composition: Composition, *, spec: str | None = None, progress: StepProgress = None
) -> tuple[go.Figure, dict]:
    """Edit the field inside a spliced skill: composed vs recomputed per strategy."""
    lm = registry.get(spec)
    scenario = composed_scenario(composition, registry.profile)
    report = keystone(lm, scenario, registry.skills(spec), remedy=remedy_for(registry, spec, lm, composition.remedy), progress=progress)
    return compose_figures.keystone_figure(report), {**report.as_dict(), "selection": selection(registry, spec, composition)}


@guarded
def run_agent_loop(
    registry: ModelRegistry,
    composition: Composition,
    *,
    spec: str | None = None,
    turns,
    toggle: bool,
    policy: str | None = "adaptive",
    progress: StepProgress = None,
) -> tuple[go.Figure, dict]:
    """Multi-turn episode with errata on a cached, composed context (compacted by ``policy``), against the
    clean-state prefill and the identical-token re-prefill every turn."""
    turns = number(turns, "turns", 4)
    registry.profile.check_turns(turns)
    lm = registry.get(spec)
    scenario = composed_scenario(composition, registry.profile)
    report = run_agent(
        lm,
        scenario,
        registry.skills(spec),
        turns=turns,
        toggle=bool(toggle),
        remedy=remedy_for(registry, spec, lm, composition.remedy),
        policy=policy or "never",
        progress=progress,
    )
    return compose_figures.agent_figure(report), {**report.as_dict(), "selection": selection(registry, spec, composition)}


@guarded
def run_composition_study(
    registry: ModelRegistry,
    spec: str | None = None,
    *,
    skills: Sequence[str],
    after: str | None,
    placements: Sequence[str],
    remedies: Sequence[str],
    progress: StepProgress = None,
) -> tuple[go.Figure, str, dict]:
    """The N-skill study on this composition: the first 1..N skills (in the composer's order) at each placement
    in the scenario, both values of its first field, every remedy; tie-aware summary and the remedy frontier."""
    lm = registry.get(spec)
    if not skills:
        raise AppError("place at least one skill in the context (drag one from the library)")
    if not remedies:
        raise AppError("choose at least one remedy to compare")
    unknown = [p for p in placements or () if p not in PLACEMENTS]
    if unknown or not placements:
        raise AppError(f"placements must be chosen among {', '.join(PLACEMENTS)}, got {list(placements or [])}")
    base = parse_scenario(bundled_scenario_text(after)) if after else adhoc_scenario([])
    study = run_study(
        lm,
        base,
        skill_prefixes(list(skills)),
        registry.skills(spec),
        remedies=[Remedy.parse(name) for name in dict.fromkeys(remedies)],
        placements=list(dict.fromkeys(placements)),
        values=first_field_values(base),
        library=bundled_skills(),
        progress=progress,
    )
    data = {"model": lm.fingerprint.name, **study.as_dict()}
    return compose_figures.study_figure(data), panels.study_markdown(data), data


def placed_skills(after: str | None) -> list[str]:
    """The skills a bundled scenario places itself (its ``{skill:ID}``), in order; none without a scenario."""
    return list(parse_scenario(bundled_scenario_text(after)).skills) if after else []
