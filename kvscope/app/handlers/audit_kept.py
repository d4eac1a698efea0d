"""What a session keeps of its last audit (the report, its Notes choices, its token pass), and what reads it back: the
fidelity figure on other axes, Open in Notes (each changed field pre-checked, its scenario) and the exports."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from kvscope.app.handlers.audit_progress import AuditPhases
from kvscope.app.handlers.audit_view import AuditView, audit_view, axes
from kvscope.app.handlers.common import AppError, ScenarioChoices, guarded, scenario_choices
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.engine import (
    AuditReport,
    KVScopeError,
    LoadedModel,
    LoadedTokenizer,
    NotesChoice,
    RequestLogError,
    hook_config,
    notes_choices,
    policy_from_report,
    preferred_choice,
    repaired_template,
    scenario_toml,
)
from kvscope.viz import audit as audit_figures
from kvscope.viz import text as panels
from kvscope.viz.common import message_figure

AUDIT_STEM = "kvscope-audit"
POLICY_STEM = "kvscope-policy"


def keep_audit(
    registry: ModelRegistry,
    sessions: SessionStore,
    session: str,
    spec: str | None,
    lm: LoadedModel | LoadedTokenizer,
    report: AuditReport,
    shown: tuple[str, str],
    traffic: dict | None = None,
    phases: AuditPhases = AuditPhases(None),
) -> AuditView:
    """Keep the audit and its Notes scenario (the model's own answers: two more prefills) for this session; their view on
    the ``shown`` axes. ``traffic``: the log's token pass (``TrafficReport.as_dict()``) when ``report`` holds its
    measured turns."""
    phases.notes()
    try:
        if isinstance(lm, LoadedTokenizer):
            raise RequestLogError("the token pass (--sample 0) measured no turn: audit with K ≥ 1 to open a change in Notes")
        notes = notes_choices(lm, report, progress=phases.notes_steps())
    except KVScopeError as error:  # no field to edit: the tab says why, Open in Notes refuses with the same words
        notes = str(error)
    notes = notes or "no measured turn changes a field inside shared content, so there is no field to edit"
    model = registry.resolve(spec)
    sessions.put(session, "audit", report, model)
    sessions.put(session, "audit_notes", notes, model)
    sessions.put(session, "audit_traffic", traffic, model)
    phases.report("figures", "drawing the figures")
    view = audit_view(report, *shown, notes, traffic)
    phases.report("figures", "done", 1, 1)
    return view


def kept_report(sessions: SessionStore, session: str) -> AuditReport:
    """The session's last audit (refused where there is none)."""
    report = sessions.get(session, "audit")
    if report is None:
        raise AppError("run an audit first: paste a log (or one prompt and a new value) and press Audit")
    return report


def audit_fidelity_view(sessions: SessionStore, *, session: str, x: str | None, y: str | None) -> go.Figure:
    """The session's last audit drawn on other axes (no model call)."""
    report = sessions.get(session, "audit")
    if report is None:
        return message_figure("run an audit first: the figure draws its repairs")
    return audit_figures.fidelity_cost_figure(report.as_dict(), *axes(x, y))


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
    kept_report(sessions, session)
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
    report, named = kept_report(sessions, session), answer_labels(labels)
    choice = _chosen(_notes_choices(sessions, session), field)
    if choice.scenario is None:
        raise AppError(choice.refusal)
    text = scenario_toml(report, named, request=choice.request, field=choice.field) if named else choice.scenario.toml
    return text, scenario_choices(text)


@guarded
def export_audit(folder: ExportFolder, sessions: SessionStore, *, session: str, x: str = "computed", y: str = "kl") -> list[str]:
    """The audit JSON, its figures and marked prompts (HTML), the auto-built scenario TOML and the repaired prompt
    template (each where the audit allows one); returns the files' paths."""
    report = kept_report(sessions, session)
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


@guarded
def download_policy(folder: ExportFolder, sessions: SessionStore, *, session: str) -> tuple[list[str], str]:
    """The kept audit's policy (its repairs measured within the bars, for the gateway) and the LiteLLM proxy's config,
    as files, and the policy in words."""
    policy = policy_from_report(kept_report(sessions, session), "the audit in the app")
    paths = folder.write(policy.as_dict(), [], POLICY_STEM, extra={"config.yaml": hook_config()})
    return [str(path) for path in paths if path.suffix != ".html"], panels.policy_markdown(policy)
