"""Figures of benchmark results (the JSON rows the scripts under benchmarks/ write)."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def ttft_figure(rows: list[dict], title: str = "Time to first token") -> go.Figure:
    """Full-prefill vs splice TTFT by skill length (log axes) with the speedup on a second axis."""
    lengths = [row["skill_tokens"] for row in rows]
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_scatter(x=lengths, y=[row["full_ms"] for row in rows], name="full prefill", mode="lines+markers")
    figure.add_scatter(x=lengths, y=[row["splice_ms"] for row in rows], name="splice + seam", mode="lines+markers")
    figure.add_bar(x=lengths, y=[row["speedup"] for row in rows], name="speedup ×", opacity=0.3, secondary_y=True)
    figure.update_xaxes(type="log", title="skill tokens")
    figure.update_yaxes(type="log", title="TTFT (ms)", secondary_y=False)
    figure.update_yaxes(title="speedup (full / splice)", secondary_y=True)
    figure.update_layout(title=title, template="plotly_white", height=380, legend={"orientation": "h", "y": -0.2})
    return figure
