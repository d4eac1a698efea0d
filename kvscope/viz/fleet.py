"""A fleet's hit rate by router and replica count: what routing keeps of one server's cache (``kvscope.engine.audit.simulate.fleet``).

Reads the audit's JSON: ``fleet`` (a list of ``{replicas, routing, reused_tokens, hit_rate}``) and ``engines`` (one
server's totals, drawn as the ceiling a router can approach)."""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.viz.audit import ENGINE_LABELS
from kvscope.viz.common import LEGEND_BELOW, PALETTE, apart_marker, set_title

ROUTING_LABELS = {"round_robin": "round robin", "session": "session affinity", "prefix": "prefix-aware", "least_loaded": "least loaded"}


def fleet_figure(data: Mapping) -> go.Figure:
    """Per engine (a panel each), the fleet's hit rate against its replica count, one line per routing policy; one
    server's hit rate as a dotted grey line drawn over them (first in the legend)."""
    fleet = data.get("fleet") or []
    figure = make_subplots(rows=1, cols=len(ENGINE_LABELS), shared_yaxes=True, subplot_titles=list(ENGINE_LABELS.values()))
    if not fleet:
        figure.add_annotation(text="no fleet simulated: give replicas (e.g. 2,4,8)", showarrow=False, xref="paper", yref="paper")
        return figure
    counts = sorted({entry["replicas"] for entry in fleet})
    routings = [name for name in ROUTING_LABELS if any(entry["routing"] == name for entry in fleet)]
    for column, engine in enumerate(ENGINE_LABELS, 1):
        one = data["engines"]["hit_rate"][engine]
        for index, routing in enumerate(routings):
            entries = sorted((e for e in fleet if e["routing"] == routing), key=lambda e: e["replicas"])
            figure.add_scatter(
                x=[str(e["replicas"]) for e in entries],
                y=[e["hit_rate"][engine] for e in entries],
                mode="lines+markers",
                name=ROUTING_LABELS[routing],
                legendgroup=routing,
                showlegend=column == 1,
                line={"color": PALETTE[index % len(PALETTE)], "width": 2},
                marker=apart_marker(index),  # routers that keep the same share (often) stay told apart
                hovertext=[
                    f"{ROUTING_LABELS[routing]}, {e['replicas']} replicas: {ENGINE_LABELS[engine]} reuses "
                    f"{e['reused_tokens'][engine]:,} tokens ({e['hit_rate'][engine]:.1%})"
                    for e in entries
                ],
                hoverinfo="text",
                row=1,
                col=column,
            )
        figure.add_scatter(  # last, so that it shows over a router that equals it
            x=[str(c) for c in counts],
            y=[one] * len(counts),
            mode="lines",
            name="one server",
            line={"color": "#555555", "dash": "dot", "width": 2},
            showlegend=column == 1,
            legendgroup="one",
            legendrank=1,
            hovertext=f"one server: {one:.1%}",
            hoverinfo="text",
            row=1,
            col=column,
        )
        figure.update_xaxes(title_text="replicas", type="category", row=1, col=column)
    figure.update_yaxes(title_text="hit rate (tokens reused)", tickformat=".0%", rangemode="tozero", row=1, col=1)
    figure.update_layout(height=460, legend=LEGEND_BELOW, margin={"b": 120})
    set_title(
        figure,
        "What each router keeps of the cache, by replica count",
        "each replica holds its own cache; the dotted line is one server holding them all",
        subplot_titles=1,
    )
    return figure


def fleet_markdown(data: Mapping) -> str:
    """The fleet table: per replica count and router, each engine's hit rate (and one server's, first)."""
    fleet = data.get("fleet") or []
    if not fleet:
        return ""
    engines = list(ENGINE_LABELS)
    head = "| replicas | routing | " + " | ".join(f"{ENGINE_LABELS[e]} hit rate" for e in engines) + " |"
    lines = [head, "|---:|---|" + "---:|" * len(engines)]
    one = data["engines"]["hit_rate"]
    lines.append("| 1 | (one server) | " + " | ".join(f"{one[e]:.1%}" for e in engines) + " |")
    for entry in sorted(fleet, key=lambda e: (e["replicas"], list(ROUTING_LABELS).index(e["routing"]))):
        rates = " | ".join(f"{entry['hit_rate'][e]:.1%}" for e in engines)
        lines.append(f"| {entry['replicas']} | {ROUTING_LABELS[entry['routing']]} | {rates} |")
    return "**Fleets: the hit rate behind each router**\n\n" + "\n".join(lines)
