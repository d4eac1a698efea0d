"""The Your prompt tab's panels of an audit (:class:`AuditView`): recommendations, the timeline, fidelity against cost,
the marked prompts, what Open in Notes would study and, for a log audited as traffic, its sessions, engines, causes,
groups and fleets."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from kvscope.app.handlers.common import AppError
from kvscope.engine import AuditReport, NotesChoice, appended_chars, preferred_choice, prefix_cache_stop
from kvscope.viz import audit as audit_figures
from kvscope.viz import fleet as fleet_figures
from kvscope.viz import text as panels

# why no turn is measured (cancelled, still running, the token pass only, or one request): the panels say which; and the
# simulated engines' settings, whose block size the block-aligned prefixes were counted in
FROM_TRAFFIC = ("cancelled", "pending", "sample", "requests", "engines")


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


def axes(x: str | None, y: str | None) -> tuple[str, str]:
    """The fidelity figure's axes (empty: computed tokens against KL), checked."""
    x, y = x or "computed", y or "kl"
    if x not in audit_figures.X_AXES or y not in audit_figures.Y_AXES:
        raise AppError(f"axes are x in {', '.join(audit_figures.X_AXES)} and y in {', '.join(audit_figures.Y_AXES)}")
    return x, y


def audit_view(
    report: AuditReport,
    x: str = "computed",
    y: str = "kl",
    notes: Sequence[NotesChoice] | str | None = None,
    traffic: dict | None = None,
) -> AuditView:
    """The tab's panels of an audit: recommendations, the timeline, fidelity against cost, the marked prompts and what Open
    in Notes would study (``notes``); with ``traffic`` (the log's token pass, whose measured turns ``report`` holds), its
    sessions, engines, causes and groups too, and the summary is the traffic's JSON."""
    data = report.as_dict() | {key: value for key, value in (traffic or {}).items() if key in FROM_TRAFFIC}
    turns = [(turn.request, report.rendered[i].text, _turn_marks(report, i)) for i, turn in enumerate(report.turns) if turn.diff]
    shown = report.last_with_fields() or report.turns[-1]
    choices = [] if isinstance(notes, str) or notes is None else list(notes)
    pick = preferred_choice(choices)
    view = AuditView(
        recommendation_markdown=audit_figures.recommendations_markdown(data),
        timeline_figure=audit_figures.reuse_timeline_figure(data),
        fidelity_figure=audit_figures.fidelity_cost_figure(data, *axes(x, y)),
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
