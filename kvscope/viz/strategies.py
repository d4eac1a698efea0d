"""Figure of an edit report: each strategy's decision margin against the stale and oracle references."""

from __future__ import annotations

import plotly.graph_objects as go

from kvscope.engine.cache.decision import RECOVERY_WORDS
from kvscope.engine.edit.report import EditReport
from kvscope.engine.edit.strategies import StrategyResult
from kvscope.viz.common import GREY, LEGEND_BELOW, label_colours, safe_label, safe_lines, set_title


def _recovery_text(result: StrategyResult, prefix: str = "R") -> str:
    value = None if result.recovery is None else result.recovery.value
    return f"{prefix} n/a" if value is None else f"{prefix} {value:.2f}"


def _hover(result: StrategyResult) -> str:
    lines = [
        f"<b>{safe_label(result.name)}</b>",
        f"margin {result.decision.margin:+.3f} → {safe_label(result.decision.label)}",
        _recovery_text(result, "recovery"),
        safe_lines(RECOVERY_WORDS),
        f"{result.tokens_recomputed} tokens recomputed, {result.ms:.1f} ms"
        + (" (share of one fused forward)" if result.ms_is_share else ""),
    ]
    if result.recovery is not None and result.recovery.reason:
        lines.append(safe_lines(result.recovery.reason))
    if "chosen" in result.detail:
        lines.append(f"auto chose {safe_label(str(result.detail['chosen']))}")
    return "<br>".join(lines)


def strategy_figure(report: EditReport) -> go.Figure:
    """Margin per strategy (bars coloured by decision label, recovery on top), stale and oracle as lines;
    not-applicable strategies are grey hatched bars spanning the stale–oracle range, the reason in hover."""
    stale, oracle = report.stale.decision, report.oracle.decision
    colours = label_colours(list(stale.scores))
    names = list(report.strategies)
    figure = go.Figure()
    for label, colour in colours.items():
        chosen = [r for r in report.strategies.values() if r.applicable and r.decision.label == label]
        if chosen:
            figure.add_bar(
                x=[r.name for r in chosen],
                y=[r.decision.margin for r in chosen],
                name=f"decision: {safe_label(label)}",
                marker_color=colour,
                text=[_recovery_text(r) for r in chosen],
                textposition="outside",
                cliponaxis=False,  # a label above the tallest bar stays whole
                hovertext=[_hover(r) for r in chosen],
                hoverinfo="text",
            )
    missing = [r for r in report.strategies.values() if not r.applicable]
    if missing:
        low, high = min(stale.margin, oracle.margin, 0.0), max(stale.margin, oracle.margin, 0.0)
        height = (high - low) or 1.0
        figure.add_bar(
            x=[r.name for r in missing],
            y=[height] * len(missing),
            base=[low] * len(missing),
            name="not applicable",
            marker={"color": GREY, "opacity": 0.4, "pattern": {"shape": "/"}},
            text=["n/a"] * len(missing),
            textposition="inside",
            hovertext=[f"<b>{safe_label(r.name)}</b>: not applicable<br>{safe_lines(r.reason or '')}" for r in missing],
            hoverinfo="text",
        )
    higher = "oracle" if oracle.margin >= stale.margin else "stale"
    for name, decision, dash in (("stale", stale, "dot"), ("oracle", oracle, "dash")):
        figure.add_hline(
            y=decision.margin,
            line={"dash": dash, "color": colours.get(decision.label, GREY)},
            annotation_text=f"{name} {decision.margin:+.2f}<br>{safe_label(decision.label, 14)}",
            annotation_position="top right" if name == higher else "bottom right",  # apart when the margins are close
            annotation_xanchor="left",  # right of the plot, clear of the bar labels
            annotation_x=1.01,
            annotation_align="left",
        )
    first = safe_label(list(stale.scores)[0])
    figure.update_layout(
        barmode="overlay",
        xaxis={"title": "strategy", "categoryorder": "array", "categoryarray": names},
        yaxis_title=f"margin ({first} − best other)",  # log-probs; short enough for the plot's height
        height=440,
        legend=LEGEND_BELOW,
        margin={"l": 60, "r": 100, "b": 80},
    )
    set_title(
        figure,
        f"Edit strategies: {safe_label(report.field)} {safe_label(report.old)} → {safe_label(report.new)}",
        f"{safe_label(report.scenario)}; bar labels R: recovery (hover a bar)",
    )
    return figure
