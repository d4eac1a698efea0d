"""Figures of a decision read: answer log-probs per label and surface string, with the margin."""
from __future__ import annotations

import plotly.graph_objects as go

from engine.decision import Decision


def decision_figure(decision: Decision, title: str = "Decision") -> go.Figure:
    """Bars of each label's log-prob (and its surface strings), the chosen label highlighted."""
    labels = list(decision.scores)
    figure = go.Figure()
    figure.add_bar(
        x=labels,
        y=[decision.scores[label] for label in labels],
        name="label (log Σ P)",
        marker_color=["#2a9d8f" if label == decision.label else "#b0bec5" for label in labels],
        text=[f"{decision.scores[label]:.2f}" for label in labels],
        textposition="outside",
    )
    for label in labels:
        strings = decision.string_logprobs[label]
        figure.add_scatter(
            x=[label] * len(strings),
            y=list(strings.values()),
            mode="markers+text",
            text=list(strings),
            textposition="middle right",
            marker={"color": "#264653", "size": 8},
            name=f"{label} strings",
            showlegend=False,
        )
    figure.update_layout(
        title=f"{title}: {decision.label} (margin {decision.margin:+.2f})",
        yaxis_title="log-prob of the answer",
        height=340,
        margin={"l": 50, "r": 20, "t": 50, "b": 40},
        showlegend=False,
    )
    return figure
