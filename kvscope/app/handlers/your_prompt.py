"""The Your prompt tab's handlers: a request log audited as traffic (or one prompt with a value changed), every repair
measured; the marked prompts, Open in Notes, a rewrite measured against the log, and the exports."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go

from kvscope.app.handlers.audit_progress import AuditPhases
from kvscope.app.handlers.common import AppError, ScenarioChoices, guarded, number, scenario_choices
from kvscope.app.hosting import HostingProfile
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.engine import (
    DEFAULT_ENGINE,
    DEFAULT_SAMPLE,
    REPAIRS,
    AuditReport,
    CacheSettings,
    KVScopeError,
    LoadedModel,
    LoadedTokenizer,
    MeasureSettings,
    MessageProgress,
    NotesChoice,
    RenderedRequest,
    Request,
    RequestLogError,
    ScanSettings,
    StepProgress,
    appended_chars,
    apply_template,
    audit_traffic,
    audit_value,
    bounded_sample,
    bundled_logs,
    candidate_menu,
    candidate_span,
    candidate_spans,
    find_span,
    fleet_grid,
    measure_rewrite,
    notes_choices,
    parse_prompt,
    pending_report,
    preferred_choice,
    prefix_cache_stop,
    read_log,
    render_request,
    repaired_template,
    rewrite_markdown,
    scenario_toml,
    traffic_scan,
)
from kvscope.viz import audit as audit_figures
from kvscope.viz import fleet as fleet_figures
from kvscope.viz import text as panels
from kvscope.viz.common import markdown_literal, message_figure

AUDIT_STEM = "kvscope-audit"
AUDIT_REPAIRS = [name for name in REPAIRS if name != "recompute"]  # recompute always runs: the reference
DEFAULTS = MeasureSettings(tuple(AUDIT_REPAIRS))  # the greedy tokens, KL threshold and minimum agreement by default
NO_GRAIN = "none"  # the grain menu's entry for no coarsening


def bundled_log_text(name: str) -> str:
    """The text of a bundled request log."""
    paths = bundled_logs()
    if name not in paths:
        raise AppError(f"unknown demo log {name!r}; bundled: {', '.join(paths)}")
    return paths[name].read_text(encoding="utf-8")


def size_words(count: int) -> str:
    """A file's size as people read it: bytes, KB or MB (of 1,024)."""
    if count < 2**10:
        return f"{count:,} bytes"
    return f"{count / 2**10:,.1f} KB" if count < 2**20 else f"{count / 2**20:,.1f} MB"


def upload_markdown(path: str | None) -> str:
    """What the tab says of an uploaded log: the file's name and size, and when the audit reads it (empty: none)."""
    if not path:
        return ""
    file = Path(path)
    return (
        f"Uploaded: **{markdown_literal(file.name)}** · {size_words(file.stat().st_size)}. The audit reads this file while the "
        "box below is empty (text typed or pasted there is read instead); upload another file to replace it."
    )


def given_log(text: str | None, upload: str | None) -> str | None:
    """The log (or prompt) the tab audits: the text box's text where it holds any (typed, pasted or a demo's), else the
    uploaded file, read from its path (an upload empties the box). The upload is read here, once, rather than pasted into
    the text box (a 20 MB log took 23 s to show there)."""
    if (text or "").strip() or not upload:
        return text
    try:
        return Path(upload).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError as error:
        raise AppError(
            f"the uploaded file {Path(upload).name} is no longer on the server (uploads are kept an hour): upload it again"
        ) from error


@dataclass
class AuditView:
    """Everything the Your prompt tab shows after an audit."""

    recommendation_markdown: str
    timeline_figure: go.Figure
    fidelity_figure: go.Figure
    prompt_html: str
    summary: dict
    notes_markdown: str = ""  # what Open in Notes would study, said before it is offered
    notes_menu: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (label, key): every changed field, pre-checked
    notes_pick: str | None = None  # the key Open in Notes opens unless the user picks another
    # a log audited as traffic (none for one prompt with a new value): sessions, engines' reuse, causes, sampled groups
    traffic_markdown: str = ""
    groups_markdown: str = ""
    sessions_figure: go.Figure | None = None
    engines_figure: go.Figure | None = None
    fleet_markdown: str = ""  # fleets of replicas behind each router, when replicas were given
    fleet_figure: go.Figure | None = None


@dataclass(frozen=True)
class AuditInputs:
    """What every audit of the tab is measured and drawn with, as its widgets give it (:meth:`measure` checks it):
    the repairs, greedy tokens, the recommendation's bars, coarsen's grain, and the fidelity figure's axes."""

    repairs: Sequence[str] | None = None
    tokens: int | float | str | None = DEFAULTS.tokens
    threshold: float | str | None = DEFAULTS.threshold
    min_agreement: float | str | None = DEFAULTS.min_agreement
    grain: str | None = None
    x: str = "computed"
    y: str = "kl"

    def measure(self, profile: HostingProfile, requests: int) -> MeasureSettings:
        """The model pass's settings, checked (the profile bounds the requests, the greedy tokens and the context)."""
        tokens = number(self.tokens, "greedy tokens N", DEFAULTS.tokens)
        threshold = number(self.threshold, "KL threshold", DEFAULTS.threshold, float)
        min_agreement = number(self.min_agreement, "minimum agreement", DEFAULTS.min_agreement, float)
        grain = (self.grain or "").strip()
        profile.check_audit(requests, tokens)
        grain = None if grain in ("", NO_GRAIN) else grain
        return MeasureSettings(tuple(self.repairs or ()), tokens, threshold, min_agreement, grain, profile.max_context_tokens)


NOTHING_TO_AUDIT = (
    "**Nothing to audit yet:** the log is empty. Paste a request log (one JSON request a line), upload one or pick a "
    "bundled demo log, then press *Audit the log*."
)


def nothing_to_audit(text: str | None) -> str | None:
    """The tab's information where the log is empty or only blank lines (shown in one place, not as an error), else None."""
    return NOTHING_TO_AUDIT if not (text or "").strip() else None


def audit_text(text: str | None, what: str) -> str:
    if not (text or "").strip():
        raise AppError(f"paste {what} first, upload a file or pick a bundled demo log")
    return text


def engine_settings(*, block=CacheSettings.block, budget_blocks=None, budget_tokens=None, cache_reuse=0) -> CacheSettings:
    """The simulated engines' settings from UI values (a budget of 0 or empty: unbounded)."""
    block = number(block, "block size", CacheSettings.block)
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


@dataclass(frozen=True)
class StartedAudit:
    """An audit whose token pass is done: its view while the model pass runs (None when no turn is measured), and the
    model pass that gives the audit's view."""

    pending: AuditView | None
    finish: Callable[[], AuditView]


@guarded
def start_audit(
    registry: ModelRegistry,
    sessions: SessionStore,
    text: str | None,
    *,
    session: str,
    spec: str | None = None,
    inputs: AuditInputs = AuditInputs(),
    sample=DEFAULT_SAMPLE,
    engines: CacheSettings = CacheSettings(),
    observed_engine: str = DEFAULT_ENGINE,
    replicas: str | None = None,
    progress: MessageProgress | None = None,
) -> StartedAudit:
    """Audit a request log as traffic, its token pass first: every request (sessions, matches, causes, the simulated
    engines, the observed cached counts against ``observed_engine``, and fleets of ``replicas``, comma-separated,
    behind each router), shown while the model pass (``finish``) measures every repair on up to ``sample`` turns of each
    change signature (malformed records are skipped and named). The measured turns are kept for this session (Open in
    Notes, export, redrawn axes). ``progress`` hears every phase on one bar (:class:`AuditPhases`); with ``sample`` 0
    only the tokenizer is loaded."""
    settings = ScanSettings(engines, observed_engine, tuple(fleets(replicas)), registry.profile.max_context_tokens)
    phases = AuditPhases(progress)
    phases.report("reading", "reading the log")
    log = read_log(audit_text(text, "a request log (one JSON request a line)"))
    sample = number(sample, "--sample K", DEFAULT_SAMPLE)
    profile = registry.profile
    # at most this many turns are measured: every request, or the profile's bound that ``bounded_sample`` keeps to
    measured = min(len(log.requests), profile.max_audit_requests or len(log.requests))
    measure = inputs.measure(profile, measured)
    phases.report("loading", "loading the model" if sample > 0 else "loading the tokenizer (the token pass needs no weights)")
    loading = phases.messages("loading")
    lm = registry.get(spec, progress=loading) if sample > 0 else registry.token_model(spec, progress=loading)
    scan = traffic_scan(lm, log, settings, progress=phases.steps("token pass", "token pass: requests"))
    most = profile.max_audit_requests
    fits = bounded_sample(scan, sample, most)
    bound = None if fits == sample else f"{profile.label} measures at most {most} turns of a log: --sample lowered from {sample} to {fits}"
    pending = None
    if fits > 0 and scan.requests:
        waiting = dataclasses.replace(pending_report(lm, scan, fits, measure), sample_bound=bound)
        why = "the model pass is running: Open in Notes is offered once it has measured the turns"
        pending = audit_view(waiting.measured_report(), inputs.x, inputs.y, why, waiting.as_dict())

    @guarded
    def finish() -> AuditView:
        traffic = audit_traffic(
            lm,
            log,
            scan=scan,
            sample=fits,
            measure=measure,
            messages=phases.model_pass(),
        )
        data = dataclasses.replace(traffic, sample_bound=bound).as_dict()
        return _kept_audit(registry, sessions, session, spec, lm, traffic.measured_report(), inputs.x, inputs.y, data, phases)

    return StartedAudit(pending, finish)


def run_audit(registry: ModelRegistry, sessions: SessionStore, text: str | None, **options) -> AuditView:
    """The audit :func:`start_audit` starts, run to its end: its view."""
    return start_audit(registry, sessions, text, **options).finish()


def _rendered_prompt(registry: ModelRegistry, spec: str | None, text: str | None) -> tuple[Request, RenderedRequest]:
    request = parse_prompt(audit_text(text, "a prompt (plain text or messages JSON)"))
    return request, render_request(registry.get(spec), request, registry.profile.max_context_tokens)


@guarded
def prompt_candidates(registry: ModelRegistry, text: str | None, *, spec: str | None = None) -> tuple[str, list[tuple[str, int]]]:
    """One prompt rendered with the model's chat template, its volatile-looking spans highlighted and numbered, and
    the menu naming them: (label, number) pairs such as ``("3 · datetime · 2026-05-12 09:41", 3)``."""
    _, rendered = _rendered_prompt(registry, spec, text)
    found = candidate_spans(rendered)
    marks = [
        audit_figures.Mark(c.char_span[0], c.char_span[1], "candidate", f"{index} · {c.kind}: {c.text}", str(index))
        for index, c in enumerate(found, 1)
    ]
    return audit_figures.candidates_html(rendered.text, marks), candidate_menu(found)


@guarded
def run_audit_value(
    registry: ModelRegistry,
    sessions: SessionStore,
    text: str | None,
    *,
    session: str,
    spec: str | None = None,
    candidate=None,
    find: str | None = None,
    new_value: str | None = None,
    inputs: AuditInputs = AuditInputs(),
    progress: StepProgress = None,
) -> AuditView:
    """One prompt as cached, then as it arrives with one value changed: candidate span number ``candidate`` (as
    :func:`prompt_candidates` numbers them), or the first occurrence of ``find`` (which wins when given), set to
    ``new_value``."""
    request, rendered = _rendered_prompt(registry, spec, text)
    measure = inputs.measure(registry.profile, 2)
    if (find or "").strip():
        site = find_span(request, find)
    elif candidate is not None and str(candidate).strip():
        site = candidate_span(rendered, candidate_spans(rendered), number(candidate, "the candidate span", 0))
    else:
        raise AppError("pick a candidate span (Find volatile spans) or type the text to change")
    if new_value is None or not str(new_value).strip():
        raise AppError("type the new value the changed request carries")
    lm = registry.get(spec)
    report = audit_value(
        lm,
        request,
        site.chars,
        str(new_value),
        message=site.message,
        measure=measure,
        progress=progress,
    )
    return _kept_audit(registry, sessions, session, spec, lm, report, inputs.x, inputs.y)


@guarded
def run_rewrite(
    registry: ModelRegistry,
    text: str | None,
    *,
    spec: str | None = None,
    rewritten: str | None,
    template: bool = False,
    tokens=DEFAULTS.tokens,
    progress: StepProgress = None,
) -> tuple[str, dict]:
    """A rewrite of the log (a linter's rewritten log, or a prompt template applied to the log's values) measured against
    it: each engine's reuse before and after, and each rewritten prompt's output against the original's clean prefill."""
    log = read_log(audit_text(text, "the original request log"))
    given = audit_text(rewritten, "the rewritten log (or a prompt template)")
    changed = apply_template(given, log) if template else read_log(given)
    tokens = number(tokens, "greedy tokens N", DEFAULTS.tokens)
    registry.profile.check_audit(len(log.requests), tokens)
    limited = ScanSettings(context_limit=registry.profile.max_context_tokens)
    measured = measure_rewrite(registry.get(spec), log, changed, settings=limited, tokens=tokens, progress=progress)
    rows = [row.as_dict() for row in measured.requests]
    return rewrite_markdown(measured.verdict(), rows), {"rewrite": rows, "verdict": measured.verdict()}


def _kept_audit(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    lm: LoadedModel | LoadedTokenizer,
    report: AuditReport,
    x: str,
    y: str,
    traffic: dict | None = None,
    phases: AuditPhases = AuditPhases(None),
) -> AuditView:
    """Keep the audit and its Notes scenario (the model's own answers: two more prefills) for this session; their view.
    ``traffic``: the log's token pass (``TrafficReport.as_dict()``) when ``report`` holds its measured turns."""
    phases.report("notes", "Open in Notes: reading the model's own answers (two prefills)")
    try:
        if isinstance(lm, LoadedTokenizer):
            raise RequestLogError("the token pass (--sample 0) measured no turn: audit with K ≥ 1 to open a change in Notes")
        notes = notes_choices(lm, report)
    except KVScopeError as error:  # no field to edit: the tab says why, Open in Notes refuses with the same words
        notes = str(error)
    notes = notes or "no measured turn changes a field inside shared content, so there is no field to edit"
    model = registry.resolve(spec)
    sessions.put(session, "audit", report, model)
    sessions.put(session, "audit_notes", notes, model)
    sessions.put(session, "audit_traffic", traffic, model)
    phases.report("figures", "drawing the figures")
    view = audit_view(report, x, y, notes, traffic)
    phases.report("figures", "done", 1, 1)
    return view


def _turn_marks(report: AuditReport, index: int) -> list[audit_figures.Mark]:
    """The changed fields, where an exact prefix cache stops, and the appended turns, in request ``index``'s text."""
    turn, rendered = report.turns[index], report.rendered[index]
    diff = turn.diff
    marks = [
        audit_figures.Mark(*change.char_span, "field", f"{change.name}: {change.old!r} → {change.new!r}", change.name)
        for change in turn.fields
    ]
    cut = prefix_cache_stop(diff, rendered)
    marks.append(
        audit_figures.Mark(cut, cut, "cut", f"an exact prefix cache reuses the {diff.common_prefix_tokens:,} tokens before this point")
    )
    appended = appended_chars(diff, rendered)
    if appended is not None:
        words = f"{len(rendered) - diff.growth_start:,} tokens appended since the previous request"
        marks.append(audit_figures.Mark(*appended, "growth", words))
    return marks


def audit_view(
    report: AuditReport,
    x: str = "computed",
    y: str = "kl",
    notes: Sequence[NotesChoice] | str | None = None,
    traffic: dict | None = None,
) -> AuditView:
    """The tab's panels of an audit: recommendations, the timeline, fidelity against cost, the marked prompts and what
    Open in Notes would study (``notes``: every changed field pre-checked, or why there is none); with ``traffic`` (the log's token pass,
    whose measured turns ``report`` holds), its sessions, engines, causes, groups and timeline per session, and the
    summary is the traffic's JSON."""
    # why no turn is measured (cancelled, still running, the token pass only, or one request): the panels say which
    why = ("cancelled", "pending", "sample", "requests")
    data = report.as_dict() | {key: value for key, value in (traffic or {}).items() if key in why}
    turns = [(turn.request, report.rendered[i].text, _turn_marks(report, i)) for i, turn in enumerate(report.turns) if turn.diff]
    shown = report.last_with_fields() or report.turns[-1]
    choices = [] if isinstance(notes, str) or notes is None else list(notes)
    pick = preferred_choice(choices)
    view = AuditView(
        recommendation_markdown=audit_figures.recommendations_markdown(data),
        timeline_figure=audit_figures.reuse_timeline_figure(data),
        fidelity_figure=audit_figures.fidelity_cost_figure(data, *_axes(x, y)),
        prompt_html=audit_figures.turns_html(turns, shown.request, audit_figures.no_turns(data, "no prompt is marked")),
        summary=data,
        notes_markdown=panels.notes_choice_markdown(choices, pick.key) if pick else panels.open_in_notes_markdown(notes),
        notes_menu=[(choice.label(), choice.key) for choice in choices],
        notes_pick=pick.key if pick else None,
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
        fleet_markdown=fleet_figures.fleet_markdown(traffic),
        fleet_figure=fleet_figures.fleet_figure(traffic) if traffic.get("fleet") else None,
    )


def fleets(replicas: str | None) -> list[tuple[int, str]]:
    """The fleets to simulate from the tab's replica counts (empty: none), every router at each (a bad count is
    refused by name, as the CLI refuses it)."""
    return fleet_grid(replicas, None) if (replicas or "").strip() else []


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


def audit_fidelity_view(sessions: SessionStore, *, session: str, x: str | None, y: str | None) -> go.Figure:
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


def _notes_choices(sessions: SessionStore, session: str) -> Sequence[NotesChoice]:
    """The session's pre-checked fields (Open in Notes refuses with the audit's reason where there is none)."""
    _audit_report(sessions, session)
    kept = sessions.get(session, "audit_notes")
    if isinstance(kept, str) or not kept:
        raise AppError(kept or "audit a log first")
    return kept


def _chosen(choices: Sequence[NotesChoice], key: str | None) -> NotesChoice:
    """The field picked in the menu (``request:field``; empty: the preferred one)."""
    if not (key or "").strip():
        return preferred_choice(choices)
    found = next((choice for choice in choices if choice.key == key), None)
    if found is None:
        raise AppError(f"no changed field {key!r} in this audit; it found {', '.join(choice.key for choice in choices)}")
    return found


@guarded
def audit_notes_choice(sessions: SessionStore, *, session: str, field: str | None = None) -> str:
    """What the picked field's pre-check says, before anything runs: whether its change moves the model's answer, and
    where it does not, which fields do."""
    choices = _notes_choices(sessions, session)
    return panels.notes_choice_markdown(choices, _chosen(choices, field).key)


@guarded
def audit_notes_scenario(
    sessions: SessionStore, *, session: str, labels: str | None = None, field: str | None = None
) -> tuple[str, ScenarioChoices]:
    """The scenario TOML of changed field ``field`` (``request:field`` from the menu; empty: the latest change that moves
    the model's answer) of the session's last audit, its answers the model's own unless ``labels`` names two, and the
    Notes tab's field and value choices."""
    report, named = _audit_report(sessions, session), answer_labels(labels)
    choice = _chosen(_notes_choices(sessions, session), field)
    if choice.scenario is None:
        raise AppError(choice.refusal)
    text = scenario_toml(report, named, request=choice.request, field=choice.field) if named else choice.scenario.toml
    return text, scenario_choices(text)


@guarded
def export_audit(folder: ExportFolder, sessions: SessionStore, *, session: str, x: str = "computed", y: str = "kl") -> list[str]:
    """The audit JSON, its figures and marked prompts (HTML), the auto-built scenario TOML and the repaired prompt
    template (each where the audit allows one); returns the files' paths."""
    report = _audit_report(sessions, session)
    view = audit_view(report, x, y, traffic=sessions.get(session, "audit_traffic"))
    chat = report.rendered[-1].request.messages is not None
    kept = sessions.get(session, "audit_notes")
    pick = None if isinstance(kept, str) or not kept else preferred_choice(kept)
    extra = {}
    for name, build in (
        (f"{AUDIT_STEM}-scenario.toml", (lambda _: pick.scenario.toml) if pick and pick.scenario else scenario_toml),
        (f"{AUDIT_STEM}-template.{'json' if chat else 'txt'}", repaired_template),
    ):
        try:
            extra[name] = build(report)
        except RequestLogError:
            pass  # no field changed, or (the scenario) one in the last message, which a scenario reads as its question
    figures = [view.sessions_figure, view.engines_figure, view.timeline_figure, view.fidelity_figure]
    paths = folder.write(view.summary, [figure for figure in figures if figure is not None], AUDIT_STEM, [view.prompt_html], extra)
    return [str(path) for path in paths]
