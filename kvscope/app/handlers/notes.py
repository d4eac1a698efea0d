"""The Notes tab's handlers: prepare the scenario, edit a field (the strategy cards, context text, attention and notes
map), the frontier, the knockout, the session's whole result (the edit with the frontier and knockout run on it) and
the recipe an export reruns."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from kvscope.app.handlers.common import AppError, guarded, number, parse_scenario
from kvscope.app.state import ModelRegistry, SessionStore
from kvscope.engine import (
    DEFAULT_STRATEGIES,
    STRATEGIES,
    EditExperiment,
    EditSettings,
    Recipe,
    StepProgress,
    analyse_edit,
    dtype_name,
    probe_frontier,
    read_scenario,
    recipe_settings,
)
from kvscope.viz import notes as notes_figures
from kvscope.viz import text as panels
from kvscope.viz.cards import strategy_cards_html
from kvscope.viz.common import message_figure
from kvscope.viz.decision import decision_figure
from kvscope.viz.strategies import strategy_figure

SAME_LENGTH_NOTE = "The notes map patches position by position: it needs old and new values of the same token length"
OFFERED_STRATEGIES = [name for name in STRATEGIES if name not in ("stale", "oracle")]  # stale and oracle always run


@dataclass(frozen=True)
class EditInputs:
    """The Notes tab's edit as the page holds it (and a link carries it): the scenario text, the field and its new
    value (None: the scenario's own), the strategies and the settings."""

    text: str | None
    field: str | None = None
    new: str | None = None
    strategies: Sequence[str] = ()
    top_k: int | None = 8  # field_topk's K and the knockout's top-K
    head: int | None = -1  # the attention head shown (-1 or None: the mean over heads)
    separately: bool = False  # time each strategy on its own instead of reading all in one forward
    all_positions: bool = False  # the notes map over every context position (default: the field and after)

    @property
    def head_index(self) -> int | None:
        """The head shown, None for the mean over heads."""
        head = number(self.head, "attention head", -1)
        return None if head < 0 else head


@dataclass(frozen=True)
class SessionResult:
    """What the Notes tab computed on the session's edit: the edit's summary, then the frontier and the knockout run on
    it (None until run). Its JSON is what the tab shows and exports, and what the export's script reproduces."""

    edit: dict
    frontier: dict | None = None
    knockout: dict | None = None

    def as_dict(self) -> dict:
        later = {"frontier": self.frontier, "knockout": self.knockout}
        return self.edit | {key: value for key, value in later.items() if value is not None}


def session_result(sessions: SessionStore, *, session: str) -> dict | None:
    """The session's whole Notes result as JSON (None before its first edit)."""
    kept: SessionResult | None = sessions.get(session, "result")
    return None if kept is None else kept.as_dict()


def _add_to_result(sessions: SessionStore, session: str, **parts: dict) -> None:
    kept: SessionResult | None = sessions.get(session, "result")
    if kept is not None:
        sessions.put(session, "result", dataclasses.replace(kept, **parts), sessions.model_of(session, "result"))


@dataclass
class NotesView:
    """Everything the Notes tab shows after an edit."""

    cards_html: str
    strategy_figure: go.Figure
    text_html: str
    attention_figure: go.Figure
    notes_figure: go.Figure
    summary: dict


def experiment(registry: ModelRegistry, spec: str | None, text: str, field: str | None, new: str | None, top_k=8) -> EditExperiment:
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
    edit: EditInputs,
    *,
    session: str,
    spec: str | None = None,
    progress: StepProgress = None,
) -> NotesView:
    """Change a field, run the chosen strategies (read together in one forward unless ``edit.separately``, which
    times each on its own), and build every Notes panel."""
    chosen, head = registry.profile.checked_strategies(edit.strategies or []), edit.head_index
    edited = experiment(registry, spec, edit.text, edit.field, edit.new, edit.top_k)
    analysis = analyse_edit(edited, chosen, fused=not edit.separately, progress=progress)
    notebook, effects = edited.stale.notebook, analysis.effects
    model = registry.resolve(spec)
    sessions.put(session, "edit", edited, model)
    sessions.put(session, "effects", effects, model)
    sessions.put(session, "result", SessionResult(analysis.as_dict()), model)
    return NotesView(
        cards_html=strategy_cards_html(analysis.report, dtype_name(edited.lm.dtype)),
        strategy_figure=strategy_figure(analysis.report),
        text_html=notes_figures.effect_text_html(effects, notebook.token_texts(), notebook.visible_segments())
        if effects
        else f"<p>{html.escape(SAME_LENGTH_NOTE)}</p>",
        attention_figure=notes_figures.attention_figure(analysis.attention.oracle, head=head),
        notes_figure=_notes_map(edited, effects, bool(edit.all_positions)),
        summary=analysis.as_dict(),
    )


def _notes_map(edited: EditExperiment, effects, all_positions: bool) -> go.Figure:
    if effects is None:
        return message_figure(SAME_LENGTH_NOTE)
    notebook = edited.stale.notebook
    return notes_figures.effect_map_figure(effects, notebook.token_texts(), notebook.visible_segments(), all_positions=all_positions)


def notes_map_view(sessions: SessionStore, *, session: str, all_positions: bool) -> go.Figure:
    """The last edit's notes map over the field and downstream tokens, or every position (no model call)."""
    edited: EditExperiment | None = sessions.get(session, "edit")
    if edited is None:
        return message_figure("run an edit first: the notes map belongs to an edit")
    return _notes_map(edited, sessions.get(session, "effects"), bool(all_positions))


@guarded
def run_frontier(sessions: SessionStore, *, session: str, progress: StepProgress = None) -> tuple[go.Figure, dict]:
    """The cost–quality frontier of the session's last edit (field_topk over K, both rankings, and the strategies)."""
    edited: EditExperiment | None = sessions.get(session, "edit")
    if edited is None:
        raise AppError("run an edit first: the frontier measures that edit")
    result = probe_frontier(edited, progress=progress)
    _add_to_result(sessions, session, frontier=result.as_dict())
    return notes_figures.frontier_figure(result), result.as_dict()


@guarded
def run_knockout(sessions: SessionStore, *, session: str, positions: str | None, top_k) -> tuple[str, go.Figure, dict]:
    """Hide chosen positions (or the top-K notes) from the decision in the new-value cache and re-read it."""
    edited: EditExperiment | None = sessions.get(session, "edit")
    effects = sessions.get(session, "effects")
    if edited is None:
        raise AppError("run an edit first: the knockout acts on its new-value cache")
    if (positions or "").strip():
        try:
            chosen = sorted({int(p) for p in positions.replace(",", " ").split()})
        except ValueError as error:
            raise AppError(f"positions must be integers separated by commas or spaces, got {positions!r}") from error
    elif effects is not None:
        chosen = edited.top_notes(effects, number(top_k, "K", 8))
    else:
        raise AppError("give positions to knock out (the top-K ranking needs same-length values)")
    oracle = edited.oracle
    knocked = edited.knocked_out(chosen)
    verdict = panels.knockout_markdown(chosen, oracle.notebook.token_texts(), knocked, oracle.decision, edited.stale.decision)
    data = {"positions": chosen, **knocked.as_dict()}
    _add_to_result(sessions, session, knockout=data)
    return verdict, decision_figure(knocked, title="after knockout"), data


def edit_recipe(
    registry: ModelRegistry, sessions: SessionStore, edit: EditInputs, *, session: str, spec: str | None = None
) -> Recipe | None:
    """The recipe of the session's last edit, just run by :func:`run_edit` with ``edit`` (None once it is gone): the
    model it ran on, the scenario text, the field and value it resolved, the strategies and every setting."""
    edited: EditExperiment | None = sessions.get(session, "edit")
    if edited is None:
        return None
    chosen = registry.profile.checked_strategies(edit.strategies or [])
    return Recipe(
        kind="edit",
        model=registry.resolve(spec),
        dtype=dtype_name(edited.lm.dtype),
        device=str(edited.lm.device),
        scenario_toml=edit.text,
        field=edited.field,
        new=edited.new,
        settings=recipe_settings(edited.settings),
        strategies=tuple(chosen or DEFAULT_STRATEGIES),
        fused=not edit.separately,
        head=edit.head_index,
        all_positions=bool(edit.all_positions),
        scenario_name=edited.scenario.name,
    )


def knockout_recipe(recipe: Recipe | None, positions: Sequence[int]) -> Recipe | None:
    """An edit's recipe followed by a knockout of ``positions`` (what the Notes tab's JSON then shows beside the edit)."""
    return None if recipe is None else dataclasses.replace(recipe, kind="knockout", knockout=tuple(int(p) for p in positions))


def frontier_recipe(recipe: Recipe | None) -> Recipe | None:
    """An edit's recipe with its frontier run too (the Notes tab runs it after every edit)."""
    return None if recipe is None else dataclasses.replace(recipe, frontier=True)
