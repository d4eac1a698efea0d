"""Figures of a decision read: answer log-probs per label and surface string, with the margin."""

from __future__ import annotations

import plotly.graph_objects as go

from kvscope.engine.cache.decision import Decision
from kvscope.viz.common import safe_label, set_title


def decision_figure(decision: Decision, title: str = "Decision") -> go.Figure:
    """Bars of each label's log-prob (the value under the bar, beside its label) and its surface strings, the chosen label
    highlighted; every label, string and the title are escaped (plotly renders HTML in text)."""
    labels = list(decision.scores)
    shown = [f"{safe_label(label, 40)} ({decision.scores[label]:.2f})" for label in labels]  # the score under its bar
    figure = go.Figure()
    figure.add_bar(
        x=shown,
        y=[decision.scores[label] for label in labels],
        name="label (log Σ P)",
        marker_color=["#2a9d8f" if label == decision.label else "#b0bec5" for label in labels],
    )
    for label, name in zip(labels, shown):
        strings = decision.string_logprobs[label]
        figure.add_scatter(
            x=[name] * len(strings),
            y=list(strings.values()),
            mode="markers+text",
            text=[safe_label(string, 40) for string in strings],
            textposition="middle right",
            marker={"color": "#264653", "size": 8},
            name=f"{name} strings",
            showlegend=False,
        )
    figure.update_layout(
        yaxis_title="log-prob of the answer",
        height=340,
        margin={"l": 50, "r": 20, "b": 40},
        showlegend=False,
    )
    set_title(figure, f"{safe_label(title, 80)}: {safe_label(decision.label, 40)} (margin {decision.margin:+.2f})")
    return figure
