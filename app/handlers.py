"""Event handlers: UI values in, engine results and viz figures out (no Gradio imports here).

Each handler takes the shared :class:`~app.state.ModelRegistry` / :class:`~app.state.SessionStore` and the
session id explicitly, so it can be unit-tested without a browser. Bad input raises :class:`AppError`
with a message for the user; nothing is stored before a computation succeeds.
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from app.hosting import HostingProfile
from app.state import ExportFolder, ModelRegistry, SessionStore, process_rss_bytes
from engine.audit.audit import (
    DEFAULT_MIN_AGREEMENT,
    DEFAULT_THRESHOLD,
    DEFAULT_TOKENS,
    AuditReport,
    audit_value,
    repaired_template,
    scenario_toml,
)
from engine.audit.caches import CacheSettings
from engine.audit.fields import BLOCK_TOKENS, candidate_spans
from engine.audit.gate import rewrite_markdown
from engine.audit.notes import NotesScenario, notes_scenario
from engine.audit.repairs import GRAINS, REPAIRS, content_chars
from engine.audit.requests import RenderedRequest, Request, RequestLog, RequestLogError, parse_prompt, read_log, render_request
from engine.audit.rewrite import apply_template, measure_rewrite
from engine.audit.traffic import DEFAULT_SAMPLE, audit_traffic, sample_groups, scan_log
from engine.cache.vision import check_vision_model
from engine.comparison import compare_models
from engine.compose.agent import run_agent
from engine.compose.choice import AUTO, RemedyChoice, cancel_calibration, resolve_remedy, stored_choice
from engine.compose.keystone import keystone
from engine.compose.pictures import IMAGE_QUESTION, compare_image
from engine.compose.splice import (
    DEFAULT_REMEDY,
    PLACEMENTS,
    Fidelity,
    Remedy,
    adhoc_scenario,
    compare,
    compose_scenario,
    skill_of_length,
    with_skills,
)
from engine.compose.study import first_field_values, run_study, skill_prefixes
from engine.edit.experiment import EditExperiment
from engine.edit.hybrid import read_scenario
from engine.edit.strategies import EditSettings
from engine.edit.weight_edit import LoraSettings, RomeSettings, compare_edits
from engine.errors import KVScopeError
from engine.models import LoadedModel, available_offline, dtype_name, is_offline_alias
from engine.probes.analysis import DEFAULT_STRATEGIES, analyse_edit
from engine.probes.frontier import probe_frontier
from engine.probes.registry import PROBES
from engine.progress import MessageProgress, StepMessage, StepProgress
from engine.reproduce import Recipe, matches, notebook, recipe_settings, script_text
from engine.scenario import DEMOS, Scenario, Skill, bundled_scenarios, bundled_skills
from viz import audit as audit_figures
from viz import benchmarks as benchmark_figures
from viz import compose as compose_figures
from viz import learn
from viz import models as model_figures
from viz import notes as notes_figures
from viz import text as panels
from viz.cards import strategy_cards_html
from viz.common import markdown_literal, message_figure
from viz.decision import decision_figure
from viz.probes import probe_figure
from viz.strategies import strategy_figure
from viz.weights import trade_off_markdown, weight_edit_figure

SAME_LENGTH_NOTE = "The notes map patches position by position: it needs old and new values of the same token length"
RESULTS_DIR = Path(__file__).parents[1] / "benchmarks" / "results"
# The bundled demo where the embedded model's notes carry the most of the decision (lowest field-only recovery
# among the scenarios that flip; `python -m engine calibrate`): the Notes tab's default and the Learn tab's case.
NOTES_SCENARIO = "pharmacy_prescription"
TTFT_SCENARIO = "refund_gate"  # the quick TTFT check measures what benchmarks/ttft.py measured


class AppError(Exception):
    """A message for the user (bad input or an engine refusal); the session stays usable."""


def guarded(function):
    """Turn engine refusals into :class:`AppError` with the engine's own message."""

    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except KVScopeError as error:
            raise AppError(str(error)) from error

    wrapper.__name__, wrapper.__doc__ = function.__name__, function.__doc__
    return wrapper


def number(value, name: str, default: float, kind: type = int) -> float:
    """A numeric UI value (an API client may send None, "" or text): ``default`` when empty, else ``kind``."""
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except (TypeError, ValueError) as error:
        raise AppError(f"{name} must be a {'whole ' if kind is int else ''}number, got {value!r}") from error


# ---------------------------------------------------------------------------- model
@guarded
def load_model_card(
    registry: ModelRegistry, spec: str, progress: MessageProgress | None = None, dtype: str | None = None
) -> tuple[str, dict]:
    """Load (or reuse) a model, in ``dtype`` when given (else as loaded, or auto), run its self-test once, and describe it."""
    spec = (spec or "").strip() or registry.default_spec
    mark = registry.drop_serial
    lm = registry.get(spec, progress=progress, dtype=dtype or None)
    support = registry.support(spec)
    report = registry.selftest(spec) if support.verdict("self-test").supported else None
    info = registry.model_info(lm)
    card = panels.model_card_markdown(info, lm.cache_layout(), report, support) + model_figures.dropped_markdown(registry.drops_since(mark))
    return card, {
        "model": info | {"fingerprint": lm.fingerprint.as_dict()},
        "selftest": report.as_dict() if report else None,
        "support": support.as_dict(),
        "hosting": registry.profile.as_dict(),
    }


def offered_models(registry: ModelRegistry) -> list[str]:
    """Model specs to offer: those that load without the hub, within the profile's allowlist (plus the
    HF ids its host named)."""
    allowed, found = registry.profile.allowed_models, available_offline()
    if allowed is None:
        return found
    return [spec for spec in allowed if spec in found or not is_offline_alias(spec)]


# ---------------------------------------------------------------------------- scenarios
def bundled_scenario_text(name: str) -> str:
    """The TOML text of a bundled scenario."""
    paths = bundled_scenarios()
    if name not in paths:
        raise AppError(f"unknown scenario {name!r}; bundled: {', '.join(sorted(paths))}")
    return paths[name].read_text(encoding="utf-8")


@guarded
def parse_scenario(text: str, profile: HostingProfile | None = None) -> Scenario:
    """A scenario from the editor's TOML text (refused before parsing when longer than the profile allows)."""
    if not (text or "").strip():
        raise AppError("the scenario editor is empty: pick a bundled scenario, upload a TOML file or write one")
    if profile is not None:
        profile.check_scenario_text(text)
    return Scenario.from_toml(text, source="scenario editor")


@dataclass(frozen=True)
class ScenarioChoices:
    description: str
    fields: list[str]
    values: list[str]
    new: str


def scenario_choices(text: str, field: str | None = None) -> ScenarioChoices:
    """Fields and values to offer for the scenario in the editor."""
    scenario = parse_scenario(text)
    chosen = scenario.fields[field] if field in scenario.fields else scenario.field()
    return ScenarioChoices(
        description=f"**{markdown_literal(scenario.name)}** — {markdown_literal(scenario.description)}",
        fields=list(scenario.fields),
        values=list(chosen.values),
        new=chosen.new,
    )


# ---------------------------------------------------------------------------- notes
@dataclass
class NotesView:
    """Everything the Notes tab shows after an edit."""

    cards_html: str
    strategy_figure: go.Figure
    text_html: str
    attention_figure: go.Figure
    notes_figure: go.Figure
    summary: dict


def _experiment(registry: ModelRegistry, spec: str | None, text: str, field: str | None, new: str | None, top_k: int = 8) -> EditExperiment:
    """The edit on the editor's scenario, its stale run reused from the registry's baselines."""
    scenario = parse_scenario(text, registry.profile)
    stale = registry.baseline(spec, text, scenario)
    return EditExperiment(
        registry.get(spec),
        scenario,
        field or None,
        (new or None),
        EditSettings(top_k=number(top_k, "K", 8)),
        capture_attention=True,
        stale=stale,
    )


@guarded
def prepare_baseline(registry: ModelRegistry, spec: str | None, text: str) -> str:
    """Prefill the scenario at its old values (and the decision's gradients) ahead of the first edit;
    returns the current decision as Markdown."""
    scenario = parse_scenario(text, registry.profile)
    lm = registry.get(spec)
    if lm.recurrent_layers:
        read = read_scenario(lm, scenario)
        return panels.hybrid_baseline_markdown(read.prompt.values, read.decision, len(read.context), lm.recurrent_layers)
    run = registry.baseline(spec, text, scenario)
    run.gradients  # noqa: B018 — the backward runs now, so the next edit's notes map is free
    return panels.baseline_markdown(run.prompt.values, run.decision, len(run.prompt.context_ids))


@guarded
def run_edit(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    text: str,
    field: str | None,
    new: str | None,
    strategies: Sequence[str],
    top_k: int = 8,
    head: int | None = None,
    progress: StepProgress = None,
    separately: bool = False,
    all_positions: bool = False,
) -> NotesView:
    """Change a field, run the chosen strategies (read together in one forward unless ``separately``, which
    times each on its own), and build every Notes panel."""
    chosen = registry.profile.checked_strategies(strategies)
    analysis = analyse_edit(_experiment(registry, spec, text, field, new, top_k), chosen, fused=not separately, progress=progress)
    experiment, notebook, effects = analysis.experiment, analysis.experiment.stale.notebook, analysis.effects
    model = registry.resolve(spec)
    sessions.put(session, "edit", experiment, model)
    sessions.put(session, "effects", effects, model)
    return NotesView(
        cards_html=strategy_cards_html(analysis.report),
        strategy_figure=strategy_figure(analysis.report),
        text_html=notes_figures.effect_text_html(effects, notebook.token_texts(), notebook.visible_segments())
        if effects
        else f"<p>{html.escape(SAME_LENGTH_NOTE)}</p>",
        attention_figure=notes_figures.attention_figure(analysis.attention.oracle, head=head),
        notes_figure=_notes_map(experiment, effects, all_positions),
        summary=analysis.as_dict(),
    )


def _notes_map(experiment: EditExperiment, effects, all_positions: bool) -> go.Figure:
    if effects is None:
        return message_figure(SAME_LENGTH_NOTE)
    notebook = experiment.stale.notebook
    return notes_figures.effect_map_figure(effects, notebook.token_texts(), notebook.visible_segments(), all_positions=all_positions)


def notes_map_view(sessions: SessionStore, session: str, all_positions: bool) -> go.Figure:
    """The last edit's notes map over the field and downstream tokens, or every position (no model call)."""
    experiment: EditExperiment | None = sessions.get(session, "edit")
    if experiment is None:
        return message_figure("run an edit first: the notes map belongs to an edit")
    return _notes_map(experiment, sessions.get(session, "effects"), bool(all_positions))


@guarded
def run_frontier(sessions: SessionStore, session: str, progress: StepProgress = None) -> tuple[go.Figure, dict]:
    """The cost–quality frontier of the session's last edit (field_topk over K, both rankings, and the strategies)."""
    experiment: EditExperiment | None = sessions.get(session, "edit")
    if experiment is None:
        raise AppError("run an edit first: the frontier measures that edit")
    result = probe_frontier(experiment, progress=progress)
    return notes_figures.frontier_figure(result), result.as_dict()


@guarded
def run_knockout(sessions: SessionStore, session: str, positions_text: str, top_k: int) -> tuple[str, go.Figure, dict]:
    """Hide chosen positions (or the top-K notes) from the decision in the new-value cache and re-read it."""
    experiment: EditExperiment | None = sessions.get(session, "edit")
    effects = sessions.get(session, "effects")
    if experiment is None:
        raise AppError("run an edit first: the knockout acts on its new-value cache")
    if (positions_text or "").strip():
        try:
            positions = sorted({int(p) for p in positions_text.replace(",", " ").split()})
        except ValueError as error:
            raise AppError(f"positions must be integers separated by commas or spaces, got {positions_text!r}") from error
    elif effects is not None:
        positions = experiment.top_notes(effects, number(top_k, "K", 8))
    else:
        raise AppError("give positions to knock out (the top-K ranking needs same-length values)")
    oracle = experiment.oracle
    knocked = experiment.knocked_out(positions)
    verdict = panels.knockout_markdown(positions, oracle.notebook.token_texts(), knocked, oracle.decision, experiment.stale.decision)
    return verdict, decision_figure(knocked, title="after knockout"), {"positions": positions, **knocked.as_dict()}


@guarded
def run_probe(
    registry: ModelRegistry,
    spec: str | None,
    text: str,
    field: str | None,
    new: str | None,
    name: str,
    options: dict | None = None,
    progress: StepProgress = None,
) -> tuple[go.Figure, dict]:
    """One probe (causal, linear or attribution) on the Notes tab's edit, with its figure."""
    if name not in PROBES:
        raise AppError(f"unknown probe {name!r}; choose from {', '.join(PROBES)}")
    experiment = _experiment(registry, spec, text, field, new)
    result = PROBES[name](experiment, progress=progress, **(options or {}))
    return probe_figure(name, result), result.as_dict()


@guarded
def run_weight_edits(
    registry: ModelRegistry,
    spec: str | None,
    text: str,
    field: str | None,
    new: str | None,
    methods: Sequence[str],
    lora_steps: int,
    rome_layer: int | None,
    progress: StepProgress = None,
) -> tuple[go.Figure, str, dict]:
    """ROME and LoRA beside field_erratum on the Notes tab's edit, measured against the bundled scenarios
    (``rome_layer`` −1 or None: the layer the notes map points to)."""
    if not methods:
        raise AppError("choose at least one method to compare")
    scenario = parse_scenario(text, registry.profile)
    others = [Scenario.load(path) for path in bundled_scenarios().values()]
    layer = number(rome_layer, "ROME layer", -1)
    layer = None if layer < 0 else layer
    report = compare_edits(
        registry.get(spec),
        scenario,
        others,
        field or None,
        new or None,
        list(methods),
        lora=LoraSettings(steps=number(lora_steps, "LoRA steps", LoraSettings.steps)),
        rome=RomeSettings(layer=layer),
        progress=progress,
    )
    return weight_edit_figure(report), trade_off_markdown(report), report.as_dict()


# ---------------------------------------------------------------------------- composer
def skill_library() -> dict[str, str]:
    """Skill id -> title, for the composer."""
    return {skill_id: Skill.load(path).title for skill_id, path in bundled_skills().items()}


@guarded
def composed_scenario(
    skill_ids: Sequence[str], before: str, between: str, after_scenario: str | None, profile: HostingProfile | None = None
) -> Scenario:
    """The composer's context: literal text before, the skills (literal text between them), then a bundled
    scenario or a generic question."""
    if profile is not None:
        profile.check_scenario_text(f"{before or ''}{between or ''}")
    base = parse_scenario(bundled_scenario_text(after_scenario)) if after_scenario else None
    return compose_scenario(skill_ids, before, between, base)


@dataclass
class ComposeView:
    metrics_markdown: str
    logits_figure: go.Figure
    deviation_figure: go.Figure
    summary: dict


def stored_study_choice() -> tuple[str, RemedyChoice] | None:
    """The default-remedy choice a stored N-skill study names (the short study first), with the file's stem."""
    for path in sorted(RESULTS_DIR.glob("compose_many-*.json"), key=lambda path: ("-long-" in path.stem, path.stem)):
        data = json.loads(path.read_text())
        if "choice" in data:
            return path.stem, RemedyChoice.from_dict(data["choice"])
    return None


def remedy_info() -> str:
    """What the default remedy costs and buys in the stored N-skill study, the fastest alternative beside it (plain text)."""
    stored = stored_study_choice()
    return panels.remedy_info(DEFAULT_REMEDY.name, *(stored or (None, None)))


def remedy_summary() -> str:
    """The remedy menu's one-line info: the default and its numbers in the stored N-skill study."""
    stored = stored_study_choice()
    return panels.remedy_summary(DEFAULT_REMEDY.name, stored[1] if stored else None)


def remedy_menu(names: Sequence[str]) -> list[tuple[str, str]]:
    """(label, spec) pairs for the Composer's menu: the default and ``auto`` first, each measured remedy labelled with
    its agreement and speedup in the stored study."""
    stored = stored_study_choice()
    return panels.remedy_menu(DEFAULT_REMEDY.name, AUTO, [*dict.fromkeys([DEFAULT_REMEDY.name, *names])], stored[1] if stored else None)


def remedy_of(text: str | None) -> Remedy:
    """A remedy spec (such as ``prefix+seam:1``); empty means the default."""
    if text is not None and not isinstance(text, str):
        raise AppError(f"the remedy must be a spec such as prefix+seam:1 (parts joined by +), got {text!r}")
    return Remedy.parse(text.strip()) if text and text.strip() else DEFAULT_REMEDY


def remedy_for(
    registry: ModelRegistry, spec: str | None, lm: LoadedModel, text: str | None, report: MessageProgress | None = None
) -> Remedy:
    """The composer's remedy for this model: ``auto`` is its calibrated choice (measured once where the server allows
    it), anything else a spec as :func:`remedy_of` reads it."""
    if not isinstance(text, str) or text.strip() != AUTO:
        return remedy_of(text)
    if stored_choice(lm) is None and not registry.profile.calibrate_remedies:
        raise AppError(
            f"remedy auto needs {lm.fingerprint.name}'s calibration (minutes of model time), which {registry.profile.label} "
            f"does not run for visitors; pick a remedy from the menu (default {DEFAULT_REMEDY.name})"
        )
    return resolve_remedy(lm, AUTO, registry.skills(spec), report)


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


COMPOSER_TIMED_ROUNDS = 2  # rounds of splice and full recompute, alternating, after one untimed warm-up round


@guarded
def run_compose(
    registry: ModelRegistry,
    spec: str | None,
    skill_ids: Sequence[str],
    before: str,
    between: str,
    after_scenario: str | None,
    remedy: str | None = None,
    report: MessageProgress | None = None,
) -> ComposeView:
    """Splice the composed skills (repaired by ``remedy``; ``auto`` calibrates the model once, telling ``report``) and
    compare with a full recompute, both timed in this call."""
    lm = registry.get(spec)
    scenario = composed_scenario(skill_ids, before, between, after_scenario, registry.profile)
    chosen = remedy_for(registry, spec, lm, remedy, report)
    fidelity: Fidelity = compare(lm, scenario, registry.skills(spec), remedy=chosen, reps=COMPOSER_TIMED_ROUNDS, warmup=1)
    decode = lambda token: lm.tokenizer.decode([token])  # noqa: E731
    return ComposeView(
        metrics_markdown=panels.compose_metrics_markdown(fidelity),
        logits_figure=compose_figures.logit_bars_figure(fidelity.spliced, fidelity.recomputed, decode),
        deviation_figure=compose_figures.deviation_figure(fidelity),
        summary={"model": lm.fingerprint.name, **fidelity.as_dict()},
    )


MAX_PICTURE_SIDE = 448  # pixels: an uploaded picture is scaled down to fit (a few hundred image tokens at most)


def fitted_picture(picture: np.ndarray) -> np.ndarray:
    """An uploaded picture as RGB, scaled down (aspect kept) so that neither side exceeds MAX_PICTURE_SIDE."""
    image = Image.fromarray(np.asarray(picture, dtype=np.uint8)).convert("RGB")
    image.thumbnail((MAX_PICTURE_SIDE, MAX_PICTURE_SIDE))
    return np.asarray(image)


@guarded
def run_image_compose(
    registry: ModelRegistry, spec: str | None, picture: np.ndarray | None, before: str, after: str, question: str, seam: int | None
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
        compose_figures.logit_bars_figure(result.spliced, result.recomputed, decode),
        {"model": lm.fingerprint.name, **result.as_dict()},
    )


@guarded
def run_keystone(
    registry: ModelRegistry,
    spec: str | None,
    skill_ids: Sequence[str],
    before: str,
    between: str,
    after_scenario: str | None,
    remedy: str | None = None,
    progress: StepProgress = None,
) -> tuple[go.Figure, dict]:
    """Edit the field inside a spliced skill: composed vs recomputed per strategy."""
    lm = registry.get(spec)
    scenario = composed_scenario(skill_ids, before, between, after_scenario, registry.profile)
    report = keystone(lm, scenario, registry.skills(spec), remedy=remedy_for(registry, spec, lm, remedy), progress=progress)
    return compose_figures.keystone_figure(report), report.as_dict()


@guarded
def run_composition_study(
    registry: ModelRegistry,
    spec: str | None,
    skill_ids: Sequence[str],
    after_scenario: str | None,
    placements: Sequence[str],
    remedies: Sequence[str],
    progress: StepProgress = None,
) -> tuple[go.Figure, str, dict]:
    """The N-skill study on this composition: the first 1..N skills (in the composer's order) at each placement
    in the scenario, both values of its first field, every remedy; tie-aware summary and the remedy frontier."""
    lm = registry.get(spec)
    if not skill_ids:
        raise AppError("place at least one skill in the context (drag one from the library)")
    if not remedies:
        raise AppError("choose at least one remedy to compare")
    unknown = [p for p in placements or () if p not in PLACEMENTS]
    if unknown or not placements:
        raise AppError(f"placements must be chosen among {', '.join(PLACEMENTS)}, got {list(placements or [])}")
    base = parse_scenario(bundled_scenario_text(after_scenario)) if after_scenario else adhoc_scenario([])
    study = run_study(
        lm,
        base,
        skill_prefixes(list(skill_ids)),
        registry.skills(spec),
        remedies=[remedy_of(r) for r in dict.fromkeys(remedies)],
        placements=list(dict.fromkeys(placements)),
        values=first_field_values(base),
        library=bundled_skills(),
        progress=progress,
    )
    data = {"model": lm.fingerprint.name, **study.as_dict()}
    return compose_figures.study_figure(data), panels.study_markdown(data), data


@guarded
def run_agent_loop(
    registry: ModelRegistry,
    spec: str | None,
    skill_ids: Sequence[str],
    before: str,
    between: str,
    after_scenario: str | None,
    remedy: str | None,
    turns: int,
    toggle: bool,
    policy: str = "adaptive",
    progress: StepProgress = None,
) -> tuple[go.Figure, dict]:
    """Multi-turn episode with errata on a cached, composed context (compacted by ``policy``), against the
    clean-state prefill and the identical-token re-prefill every turn."""
    turns = number(turns, "turns", 4)
    registry.profile.check_turns(turns)
    lm = registry.get(spec)
    scenario = composed_scenario(skill_ids, before, between, after_scenario, registry.profile)
    report = run_agent(
        lm,
        scenario,
        registry.skills(spec),
        turns=turns,
        toggle=bool(toggle),
        remedy=remedy_for(registry, spec, lm, remedy),
        policy=policy or "never",
        progress=progress,
    )
    return compose_figures.agent_figure(report), report.as_dict()


# ---------------------------------------------------------------------------- models side by side
@dataclass
class ModelsView:
    """The Models panel: the table (with what the registry dropped to make room), the two figures and the JSON."""

    summary: str
    share_figure: go.Figure
    metrics_figure: go.Figure
    result: dict


@guarded
def run_model_comparison(
    registry: ModelRegistry,
    specs: Sequence[str] | None,
    text: str,
    field: str | None,
    new: str | None,
    progress: StepProgress = None,
    messages: MessageProgress | None = None,
) -> ModelsView:
    """The Notes tab's scenario and edit on up to three models, loaded through the registry (which drops what no
    longer fits its budget, and says so)."""
    chosen = [str(spec).strip() for spec in specs or [] if spec and str(spec).strip()]
    scenario = parse_scenario(text, registry.profile)
    for spec in chosen:
        registry.resolve(spec)  # the profile's allowlist, before any model loads
    mark = registry.drop_serial
    comparison = compare_models(
        chosen,
        lambda spec: registry.get(spec, progress=messages),
        scenario,
        field or None,
        new or None,
        stores=registry.skills,
        progress=messages,
        steps=progress,
    )
    data = comparison.as_dict() | {"dropped": registry.drops_since(mark)}
    summary = model_figures.comparison_markdown(data) + model_figures.dropped_markdown(data["dropped"])
    return ModelsView(summary, model_figures.notes_share_figure(data), model_figures.model_metrics_figure(data), data)


# ---------------------------------------------------------------------------- your prompt: request-log audit
AUDIT_STEM = "kvscope-audit"
AUDIT_REPAIRS = [name for name in REPAIRS if name != "recompute"]  # recompute always runs: the reference


def bundled_logs() -> dict[str, Path]:
    """The demo request logs shipped in demos/logs and its folders (``traffic/``: interleaved sessions), by file stem."""
    return {path.stem: path for path in sorted((DEMOS / "logs").rglob("*.jsonl"))}


def bundled_log_text(name: str) -> str:
    """The text of a bundled request log."""
    paths = bundled_logs()
    if name not in paths:
        raise AppError(f"unknown demo log {name!r}; bundled: {', '.join(paths)}")
    return paths[name].read_text(encoding="utf-8")


@dataclass
class AuditView:
    """Everything the Your prompt tab shows after an audit."""

    recommendation_markdown: str
    timeline_figure: go.Figure
    fidelity_figure: go.Figure
    prompt_html: str
    summary: dict
    notes_markdown: str = ""  # what Open in Notes would study, said before it is offered
    # a log audited as traffic (none for one prompt with a new value): sessions, engines' reuse, causes, sampled groups
    traffic_markdown: str = ""
    groups_markdown: str = ""
    sessions_figure: go.Figure | None = None
    engines_figure: go.Figure | None = None


def audit_options(
    profile: HostingProfile, requests: int, repairs: Sequence[str] | None, tokens, threshold, min_agreement, grain: str | None
) -> dict:
    """The audit's settings from UI values, checked (the profile bounds the requests and the greedy tokens)."""
    tokens = number(tokens, "greedy tokens N", DEFAULT_TOKENS)
    threshold = number(threshold, "KL threshold", DEFAULT_THRESHOLD, float)
    min_agreement = number(min_agreement, "minimum agreement", DEFAULT_MIN_AGREEMENT, float)
    if not 0 <= min_agreement <= 1:
        raise AppError(f"the minimum agreement is a share between 0 and 1, got {min_agreement:g}")
    if threshold < 0:
        raise AppError(f"the KL threshold cannot be negative, got {threshold:g}")
    grain = (grain or "").strip() or None
    if grain is not None and grain not in GRAINS:
        raise AppError(f"unknown grain {grain!r}; choose one of {', '.join(GRAINS)} (or none)")
    profile.check_audit(requests, tokens)
    return {"repairs": list(repairs or []), "tokens": tokens, "threshold": threshold, "min_agreement": min_agreement, "grain": grain}


def _audit_text(text: str | None, what: str) -> str:
    if not (text or "").strip():
        raise AppError(f"paste {what} first, upload a file or pick a bundled demo log")
    return text


def engine_settings(block=BLOCK_TOKENS, budget_blocks=None, budget_tokens=None, cache_reuse=0) -> CacheSettings:
    """The simulated engines' settings from UI values (a budget of 0 or empty: unbounded)."""
    block = number(block, "block size", BLOCK_TOKENS)
    values = {
        "vLLM block budget": number(budget_blocks, "vLLM block budget", 0),
        "SGLang token budget": number(budget_tokens, "SGLang token budget", 0),
        "llama.cpp --cache-reuse": number(cache_reuse, "llama.cpp --cache-reuse", 0),
    }
    if block < 1:
        raise AppError(f"the block size is at least 1 token, got {block}")
    negative = [name for name, value in values.items() if value < 0]
    if negative:
        raise AppError(f"the {negative[0]} cannot be negative (0: unbounded, or off)")
    blocks, tokens, reuse = values.values()
    return CacheSettings(block, blocks or None, tokens or None, None, reuse)


def bounded_sample(
    profile: HostingProfile, lm: LoadedModel, log: RequestLog, settings: CacheSettings, sample: int, progress: StepProgress = None
) -> tuple[int, str | None]:
    """The turns per change signature the model measures: ``sample``, lowered until every group's measured turns
    together fit the profile's ``max_audit_requests`` (a token pass of its own, only where the profile bounds them);
    and the words saying so (None when nothing was lowered)."""
    most = profile.max_audit_requests
    if most is None or sample <= 0:
        return sample, None
    limit = profile.max_context_tokens or int(lm.info().get("max_positions") or 32_768)  # as ``audit_traffic`` renders
    scan = scan_log(lm.tokenizer, log, settings, limit=limit, model=lm.name, progress=progress)
    fits = next(k for k in range(sample, -1, -1) if sum(len(g.measured) for g in sample_groups(scan, k)) <= most)
    if fits == sample:
        return sample, None
    return fits, f"{profile.label} measures at most {most} turns of a log: --sample lowered from {sample} to {fits}"


def _steps(progress: MessageProgress | None, unit: str) -> StepProgress:
    """A step callback that reports ``unit: done/total`` as a message carrying its fraction (the tab's bar)."""
    if progress is None:
        return None
    return lambda done, total: progress(StepMessage(f"{unit}: {done:,}/{total:,}", done, total))


@guarded
def run_audit(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    text: str,
    repairs: Sequence[str] | None,
    tokens=DEFAULT_TOKENS,
    threshold=DEFAULT_THRESHOLD,
    min_agreement=DEFAULT_MIN_AGREEMENT,
    grain: str | None = None,
    x: str = "computed",
    y: str = "kl",
    sample=DEFAULT_SAMPLE,
    engines: CacheSettings = CacheSettings(),
    progress: MessageProgress | None = None,
) -> AuditView:
    """Audit a request log as traffic: the token pass over every request (sessions, matches, causes, the simulated
    engines), then every repair measured on up to ``sample`` turns of each change signature (malformed records are
    skipped and named). The measured turns are kept for this session (Open in Notes, export, redrawn axes)."""
    log = read_log(_audit_text(text, "a request log (one JSON request a line)"))
    sample = number(sample, "--sample K", DEFAULT_SAMPLE)
    profile = registry.profile
    # at most this many turns are measured: every request, or the profile's bound that ``bounded_sample`` keeps to
    measured = min(len(log.requests), profile.max_audit_requests or len(log.requests))
    options = audit_options(profile, measured, repairs, tokens, threshold, min_agreement, grain)
    lm = registry.get(spec)
    sample, bound = bounded_sample(profile, lm, log, engines, sample, _steps(progress, "token pass (bounding the sample): requests"))
    traffic = audit_traffic(
        lm,
        log,
        sample=sample,
        settings=engines,
        max_tokens=profile.max_context_tokens,
        scan_progress=_steps(progress, "token pass: requests"),
        progress=_steps(progress, "measured steps"),
        **options,
    )
    data = traffic.as_dict() | {"sample_bound": bound}
    return _kept_audit(registry, sessions, session, spec, lm, traffic.measured_report(), x, y, None, data)


def _rendered_prompt(registry: ModelRegistry, spec: str | None, text: str) -> tuple[Request, RenderedRequest]:
    request = parse_prompt(_audit_text(text, "a prompt (plain text or messages JSON)"))
    return request, render_request(registry.get(spec), request, registry.profile.max_context_tokens)


@guarded
def prompt_candidates(registry: ModelRegistry, spec: str | None, text: str) -> tuple[str, list[str]]:
    """One prompt rendered with the model's chat template, its volatile-looking spans highlighted and numbered, and
    the choices naming them (``"3 · datetime · 2026-05-12 09:41"``)."""
    _, rendered = _rendered_prompt(registry, spec, text)
    found = candidate_spans(rendered)
    marks = [
        audit_figures.Mark(c.char_span[0], c.char_span[1], "candidate", f"{index} · {c.kind}: {c.text}", str(index))
        for index, c in enumerate(found, 1)
    ]
    choices = [f"{index} · {c.kind} · {c.text if len(c.text) <= 40 else c.text[:39] + '…'}" for index, c in enumerate(found, 1)]
    return audit_figures.candidates_html(rendered.text, marks), choices


def _message_chars(rendered: RenderedRequest, span: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """A span of the rendered text as (message, characters of that message's content)."""
    for message, (start, end) in enumerate(rendered.content_spans):
        if start <= span[0] and span[1] <= end:
            return message, content_chars(rendered, message, span)
    raise AppError("that span is not inside one message's text")


def find_in_request(request: Request, find: str) -> tuple[int, tuple[int, int]]:
    """The message and characters of the first occurrence of ``find`` in a prompt's messages."""
    for message, content in enumerate(request.contents):
        at = content.find(find)
        if at >= 0:
            return message, (at, at + len(find))
    raise AppError(f"{find!r} does not occur in the prompt's text")


@guarded
def run_audit_value(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    text: str,
    choice: str | None,
    find: str | None,
    new_value: str | None,
    repairs: Sequence[str] | None,
    tokens=DEFAULT_TOKENS,
    threshold=DEFAULT_THRESHOLD,
    min_agreement=DEFAULT_MIN_AGREEMENT,
    grain: str | None = None,
    x: str = "computed",
    y: str = "kl",
    progress: StepProgress = None,
) -> AuditView:
    """One prompt as cached, then as it arrives with one value changed: the span a candidate ``choice`` names (its
    number first), or the first occurrence of ``find`` (which wins when given), set to ``new_value``."""
    request, rendered = _rendered_prompt(registry, spec, text)
    options = audit_options(registry.profile, 2, repairs, tokens, threshold, min_agreement, grain)
    if (find or "").strip():
        message, chars = find_in_request(request, find)
    elif (choice or "").strip():
        found = candidate_spans(rendered)
        head = choice.split("·")[0].strip()
        if not head.isdigit() or not 1 <= int(head) <= len(found):
            raise AppError(f"no candidate span {choice!r}: find the spans again, then pick one of the {len(found)} offered")
        message, chars = _message_chars(rendered, found[int(head) - 1].char_span)
    else:
        raise AppError("pick a candidate span (Find volatile spans) or type the text to change")
    if new_value is None or not str(new_value).strip():
        raise AppError("type the new value the changed request carries")
    lm = registry.get(spec)
    report = audit_value(
        lm,
        request,
        chars,
        str(new_value),
        message=message,
        max_tokens=registry.profile.max_context_tokens,
        progress=progress,
        **options,
    )
    return _kept_audit(registry, sessions, session, spec, lm, report, x, y, progress)


@guarded
def run_rewrite(
    registry: ModelRegistry, spec: str | None, text: str, rewritten_text: str, template: bool, tokens=DEFAULT_TOKENS, progress=None
) -> tuple[str, dict]:
    """A rewrite of the log (a linter's rewritten log, or a prompt template applied to the log's values) measured against
    it: each engine's reuse before and after, and each rewritten prompt's output against the original's clean prefill."""
    log = read_log(_audit_text(text, "the original request log"))
    given = _audit_text(rewritten_text, "the rewritten log (or a prompt template)")
    rewritten = apply_template(given, log) if template else read_log(given)
    tokens = number(tokens, "greedy tokens N", DEFAULT_TOKENS)
    registry.profile.check_audit(len(log.requests), tokens)
    measured = measure_rewrite(
        registry.get(spec), log, rewritten, tokens=tokens, max_tokens=registry.profile.max_context_tokens, progress=progress
    )
    rows = [row.as_dict() for row in measured.requests]
    return rewrite_markdown(measured.verdict(), rows), {"rewrite": rows, "verdict": measured.verdict()}


def _kept_audit(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    lm: LoadedModel,
    report: AuditReport,
    x: str,
    y: str,
    progress: StepProgress,
    traffic: dict | None = None,
) -> AuditView:
    """Keep the audit and its Notes scenario (the model's own answers: two more prefills) for this session; their view.
    ``traffic``: the log's token pass (``TrafficReport.as_dict()``) when ``report`` holds its measured turns."""
    try:
        notes = notes_scenario(lm, report)
    except KVScopeError as error:  # no field to edit: the tab says why, Open in Notes refuses with the same words
        notes = str(error)
    sessions.put(session, "audit", report, registry.resolve(spec))
    sessions.put(session, "audit_notes", notes, registry.resolve(spec))
    sessions.put(session, "audit_traffic", traffic, registry.resolve(spec))
    return audit_view(report, x, y, notes, traffic)


def _turn_marks(report: AuditReport, index: int) -> list[audit_figures.Mark]:
    """The changed fields, where an exact prefix cache stops, and the appended turns, in request ``index``'s text."""
    turn, rendered = report.turns[index], report.rendered[index]
    diff, text = turn.diff, rendered.text
    marks = [
        audit_figures.Mark(*change.char_span, "field", f"{change.name}: {change.old!r} → {change.new!r}", change.name)
        for change in turn.fields
    ]
    cut = rendered.offsets[diff.common_prefix_tokens][0] if diff.common_prefix_tokens < len(rendered) else len(text)
    cut = min([cut, *(change.char_span[0] for change in turn.fields if change.char_span[0] <= cut < change.char_span[1])])
    reused = f"an exact prefix cache reuses the {diff.common_prefix_tokens:,} tokens before this point"
    marks.append(audit_figures.Mark(cut, cut, "cut", reused))
    if diff.growth_start < len(rendered):
        appended = len(rendered) - diff.growth_start
        where = rendered.offsets[diff.growth_start][0]
        marks.append(audit_figures.Mark(where, len(text), "growth", f"{appended:,} tokens appended since the previous request"))
    return marks


def audit_view(
    report: AuditReport, x: str = "computed", y: str = "kl", notes: NotesScenario | str | None = None, traffic: dict | None = None
) -> AuditView:
    """The tab's panels of an audit: recommendations, the timeline, fidelity against cost, the marked prompts and what
    Open in Notes would study (``notes``: its scenario, or why there is none); with ``traffic`` (the log's token pass,
    whose measured turns ``report`` holds), its sessions, engines, causes, groups and timeline per session, and the
    summary is the traffic's JSON."""
    data = report.as_dict()
    turns = [(turn.request, report.rendered[i].text, _turn_marks(report, i)) for i, turn in enumerate(report.turns) if turn.diff]
    shown = report.last_with_fields() or report.turns[-1]
    view = AuditView(
        recommendation_markdown=audit_figures.recommendations_markdown(data),
        timeline_figure=audit_figures.reuse_timeline_figure(data),
        fidelity_figure=audit_figures.fidelity_cost_figure(data, *_axes(x, y)),
        prompt_html=audit_figures.turns_html(turns, shown.request),
        summary=data,
        notes_markdown=panels.open_in_notes_markdown(notes),
    )
    if traffic is None:
        return view
    return dataclasses.replace(
        view,
        summary=traffic,
        traffic_markdown=audit_figures.traffic_markdown(traffic),
        groups_markdown=audit_figures.groups_markdown(traffic),
        sessions_figure=audit_figures.session_timeline_figure(traffic),
        engines_figure=audit_figures.engine_reuse_figure(traffic),
    )


def _axes(x: str | None, y: str | None) -> tuple[str, str]:
    x, y = x or "computed", y or "kl"
    if x not in audit_figures.X_AXES or y not in audit_figures.Y_AXES:
        raise AppError(f"axes are x in {', '.join(audit_figures.X_AXES)} and y in {', '.join(audit_figures.Y_AXES)}")
    return x, y


def _audit_report(sessions: SessionStore, session: str) -> AuditReport:
    report = sessions.get(session, "audit")
    if report is None:
        raise AppError("run an audit first: paste a log (or one prompt and a new value) and press Audit")
    return report


def audit_fidelity_view(sessions: SessionStore, session: str, x: str, y: str) -> go.Figure:
    """The session's last audit drawn on other axes (no model call)."""
    report = sessions.get(session, "audit")
    if report is None:
        return message_figure("run an audit first: the figure draws its repairs")
    return audit_figures.fidelity_cost_figure(report.as_dict(), *_axes(x, y))


def answer_labels(text: str | None) -> list[str] | None:
    """Two answer labels from ``"yes, no"`` (None when empty: the scenario's default)."""
    labels = [label.strip() for label in (text or "").split(",") if label.strip()]
    if not labels:
        return None
    if len(labels) != 2:
        raise AppError(f"name two answer labels separated by a comma (e.g. yes, no), got {len(labels)}")
    return labels


@guarded
def audit_notes_scenario(sessions: SessionStore, session: str, labels: str | None = None) -> tuple[str, ScenarioChoices]:
    """The scenario TOML built from the session's last audit (the last turn with a changed field, its value as the
    field; its answers the model's own, unless ``labels`` names two), and the Notes tab's field and value choices."""
    report, named = _audit_report(sessions, session), answer_labels(labels)
    kept = sessions.get(session, "audit_notes")
    if named:
        text = scenario_toml(report, named)
    elif isinstance(kept, NotesScenario):
        text = kept.toml
    else:
        raise AppError(kept or "audit a log first")
    return text, scenario_choices(text)


@guarded
def export_audit(folder: ExportFolder, sessions: SessionStore, session: str, x: str = "computed", y: str = "kl") -> list[str]:
    """The audit JSON, its figures and marked prompts (HTML), the auto-built scenario TOML and the repaired prompt
    template (each where the audit allows one); returns the files' paths."""
    report = _audit_report(sessions, session)
    view = audit_view(report, x, y, traffic=sessions.get(session, "audit_traffic"))
    chat = report.rendered[-1].request.messages is not None
    notes = sessions.get(session, "audit_notes")
    extra = {}
    for name, build in (
        (f"{AUDIT_STEM}-scenario.toml", (lambda _: notes.toml) if isinstance(notes, NotesScenario) else scenario_toml),
        (f"{AUDIT_STEM}-template.{'json' if chat else 'txt'}", repaired_template),
    ):
        try:
            extra[name] = build(report)
        except RequestLogError:
            pass  # no field changed, or (the scenario) one in the last message, which a scenario reads as its question
    figures = [view.sessions_figure, view.engines_figure, view.timeline_figure, view.fidelity_figure]
    paths = folder.write(view.summary, [figure for figure in figures if figure is not None], AUDIT_STEM, [view.prompt_html], extra)
    return [str(path) for path in paths]


# ---------------------------------------------------------------------------- benchmarks
def benchmark_results() -> dict[str, dict]:
    """Every JSON under benchmarks/results, by file stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(RESULTS_DIR.glob("*.json"))}


def benchmark_figures_for(results: dict[str, dict]) -> list[go.Figure]:
    """A figure per known result kind (TTFT, edit latency, prefill, serving, agent policies, soak, N-skill study,
    cache reuse, picture splice, request logs replayed on llama-server)."""
    builders = {
        "ttft": benchmark_figures.ttft_figure,
        "edit": benchmark_figures.edit_latency_figure,
        "prefill": benchmark_figures.prefill_figure,
        "serving": benchmark_figures.serving_figure,
        "agent": benchmark_figures.agent_policy_figure,
        "soak": benchmark_figures.soak_figure,
        "compose_many": compose_figures.remedy_choice_figure,
        "cache_reuse": benchmark_figures.cache_reuse_figure,
        "image": benchmark_figures.image_splice_figure,
        "compare_models": benchmark_figures.compare_models_figure,
        "audit": benchmark_figures.audit_benchmark_figure,
        "audit_replay": benchmark_figures.audit_replay_figure,
    }
    figures = []
    for stem, data in results.items():
        kind = stem.split("-")[0]
        if kind in builders:
            figures.append(builders[kind](data))
    return figures


@guarded
def quick_ttft(registry: ModelRegistry, spec: str | None, lengths: Sequence[int] = (128, 512), progress: StepProgress = None) -> dict:
    """A small live TTFT table: the long policy cut to each length, spliced before the refund gate."""
    lm = registry.get(spec)
    scenario = parse_scenario(bundled_scenario_text(TTFT_SCENARIO))
    policy = Skill.load(bundled_skills()["long_policy"])
    rows = []
    for index, length in enumerate(lengths):
        skill = skill_of_length(lm, policy, length)
        placed = with_skills(scenario, [skill.id], "start", library={skill.id: skill})
        data = compare(lm, placed, registry.skills(spec)).as_dict()
        rows.append(
            {
                "skill_tokens": data["skill_tokens"],
                "full_ms": data["ttft_ms"]["full"],
                "splice_ms": data["ttft_ms"]["splice"],
                "speedup": data["speedup"],
                "cosine": data["cosine"],
            }
        )
        if progress:
            progress(index + 1, len(lengths))
    return {"model": lm.fingerprint.name, "device": str(lm.device), "rows": rows}


# ---------------------------------------------------------------------------- learn
LEARN_STRATEGIES = {1: ("field_only", "full_downstream"), 2: ("erratum", "field_erratum")}


@guarded
def _learn_experiment(registry: ModelRegistry, sessions: SessionStore, session: str, spec: str | None) -> EditExperiment:
    """The notes demo's edit, one per session and model: every Learn step reads the same computed strategies, so a
    number (the notes share, a margin) is the same on every step that shows it."""
    lm = registry.get(spec)
    kept = sessions.get(session, "learn")
    if kept is not None and kept.lm is lm:
        return kept
    experiment = _experiment(registry, spec, bundled_scenario_text(NOTES_SCENARIO), None, None)
    sessions.put(session, "learn", experiment, registry.resolve(spec))
    return experiment


def learn_step(registry: ModelRegistry, sessions: SessionStore, session: str, index: int, spec: str | None) -> tuple[str, go.Figure]:
    """Run one classroom step on the notes demo: decisions, field-only vs downstream, erratum, splicing; the text
    says what the loaded model did, beside the paper's figures."""
    lm = registry.get(spec)
    if index == 0:
        experiment = _learn_experiment(registry, sessions, session, spec)
        new = experiment.oracle.decision  # the clean prefill at the new value (a forward on first use)
        return (
            learn.decisions_html(lm.fingerprint.name, experiment.old, experiment.new, experiment.stale.decision, new),
            decision_figure(new, title=f"{experiment.field} = {experiment.new}"),
        )
    if index in LEARN_STRATEGIES:
        experiment = _learn_experiment(registry, sessions, session, spec)
        report = experiment.report(LEARN_STRATEGIES[index], fused=True)
        return learn.strategies_html(report, index) + strategy_cards_html(report), strategy_figure(report)
    view = run_compose(registry, spec, ["refund_policy"], "", "", NOTES_SCENARIO)  # the composer's default remedy
    return learn.splice_html(view.summary), view.logits_figure


# ---------------------------------------------------------------------------- export
@guarded
def export_files(
    folder: ExportFolder,
    result: dict | None,
    figures: Sequence[go.Figure],
    stem: str,
    html_parts: Sequence[str] = (),
    recipe: Recipe | None = None,
) -> list[str]:
    """Write the result JSON and one HTML file with every figure (and any HTML views); with the ``recipe`` that
    computed this result, also ``STEM.py`` and ``STEM.ipynb``, which rerun it. Returns their paths."""
    if not result:
        raise AppError("nothing to export yet: run something first")
    extra = reproduction_files(recipe, stem) if recipe is not None and matches(recipe, result) else {}
    return [str(path) for path in folder.write(result, [figure for figure in figures if figure is not None], stem, html_parts, extra)]


def reproduction_files(recipe: Recipe, stem: str) -> dict[str, str]:
    """The recipe as a runnable script and a notebook (the engine's public API only), by file name."""
    import nbformat  # exports alone need it

    book = nbformat.from_dict(notebook(recipe, f"{stem}.json"))
    nbformat.validate(book)
    return {f"{stem}.py": script_text(recipe, f"{stem}.json"), f"{stem}.ipynb": nbformat.writes(book)}


def edit_recipe(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    text: str,
    strategies: Sequence[str],
    separately: bool = False,
    head: int | None = None,
    all_positions: bool = False,
) -> Recipe | None:
    """The recipe of the session's last edit, just run by :func:`run_edit` with these inputs (None once it is gone):
    the model it ran on, the scenario text, the field and value it resolved, the strategies and every setting."""
    experiment: EditExperiment | None = sessions.get(session, "edit")
    if experiment is None:
        return None
    chosen = registry.profile.checked_strategies(strategies or [])
    return Recipe(
        kind="edit",
        model=registry.resolve(spec),
        dtype=dtype_name(experiment.lm.dtype),
        device=str(experiment.lm.device),
        scenario_toml=text,
        field=experiment.field,
        new=experiment.new,
        settings=recipe_settings(experiment.settings),
        strategies=tuple(chosen or DEFAULT_STRATEGIES),
        fused=not separately,
        head=head,
        all_positions=bool(all_positions),
        scenario_name=experiment.scenario.name,
    )


def knockout_recipe(recipe: Recipe | None, positions: Sequence[int]) -> Recipe | None:
    """An edit's recipe followed by a knockout of ``positions`` (what the Notes tab's JSON then shows)."""
    return None if recipe is None else dataclasses.replace(recipe, kind="knockout", knockout=tuple(int(p) for p in positions))


@guarded
def probe_recipe(
    registry: ModelRegistry, spec: str | None, text: str, field: str | None, new: str | None, name: str, options: dict | None = None
) -> Recipe:
    """The recipe of :func:`run_probe` with these inputs."""
    scenario = parse_scenario(text, registry.profile)
    chosen = scenario.field(field or None)
    lm = registry.get(spec)
    return Recipe(
        kind="probe",
        model=registry.resolve(spec),
        dtype=dtype_name(lm.dtype),
        device=str(lm.device),
        scenario_toml=text,
        field=chosen.name,
        new=new or chosen.new,
        settings=recipe_settings(EditSettings(top_k=8)),  # the K of _experiment's default, which run_probe uses
        probe=name,
        probe_options=dict(options or {}),
        scenario_name=scenario.name,
    )


# ---------------------------------------------------------------------------- server memory
def memory_markdown(registry: ModelRegistry, sessions: SessionStore) -> str:
    """What this server keeps in memory against its budgets, as Markdown."""
    text = panels.memory_markdown(registry.profile.as_dict(), registry.loaded(), process_rss_bytes(), registry.memory(), sessions.stats())
    return text + model_figures.model_memory_markdown(registry.model_bytes(), registry.profile.model_budget_bytes)
