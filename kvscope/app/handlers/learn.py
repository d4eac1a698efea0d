"""The Learn tab's handler: one classroom step on the notes demo, what the loaded model did beside the paper's figures."""

from __future__ import annotations

import plotly.graph_objects as go

from kvscope.app.handlers.common import NOTES_SCENARIO, bundled_scenario_text, guarded
from kvscope.app.handlers.composer import Composition, run_compose
from kvscope.app.handlers.notes import experiment
from kvscope.app.state import ModelRegistry, SessionStore
from kvscope.engine import EditExperiment, dtype_name
from kvscope.viz import learn
from kvscope.viz.cards import strategy_cards_html
from kvscope.viz.decision import decision_figure
from kvscope.viz.strategies import strategy_figure

LEARN_STRATEGIES = {1: ("field_only", "full_downstream"), 2: ("erratum", "field_erratum")}
SPLICED_SKILL = "refund_policy"  # step 4 splices it before the notes demo, as the Composer does with its default remedy


@guarded
def _learn_experiment(registry: ModelRegistry, sessions: SessionStore, session: str, spec: str | None) -> EditExperiment:
    """The notes demo's edit, one per session and model: every Learn step reads the same computed strategies, so a
    number (the notes share, a margin) is the same on every step that shows it."""
    lm = registry.get(spec)
    kept = sessions.get(session, "learn")
    if kept is not None and kept.lm is lm:
        return kept
    edited = experiment(registry, spec, bundled_scenario_text(NOTES_SCENARIO), None, None)
    sessions.put(session, "learn", edited, registry.resolve(spec))
    return edited


def learn_step(
    registry: ModelRegistry, sessions: SessionStore, index: int, *, session: str, spec: str | None = None
) -> tuple[str, go.Figure]:
    """Run one classroom step on the notes demo: decisions, field-only vs downstream, erratum, splicing; the text
    says what the loaded model did, beside the paper's figures."""
    lm = registry.get(spec)
    if index == 0:
        edited = _learn_experiment(registry, sessions, session, spec)
        new = edited.oracle.decision  # the clean prefill at the new value (a forward on first use)
        return (
            learn.decisions_html(lm.fingerprint.name, edited.old, edited.new, edited.stale.decision, new),
            decision_figure(new, title=f"{edited.field} = {edited.new}"),
        )
    if index in LEARN_STRATEGIES:
        edited = _learn_experiment(registry, sessions, session, spec)
        report = edited.report(LEARN_STRATEGIES[index], fused=True)  # as the Notes tab's default edit reads them
        cards = strategy_cards_html(report, dtype_name(lm.dtype))
        return learn.strategies_html(report, index) + cards, strategy_figure(report)
    view = run_compose(registry, Composition([SPLICED_SKILL], after=NOTES_SCENARIO), spec=spec)  # the default remedy
    return learn.splice_html(view.summary), view.logits_figure
