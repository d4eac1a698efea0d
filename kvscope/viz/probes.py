"""Figures of the causal and decoding probes: knockout and suffix dose-response, read heads, linear probe,
context attribution.

Recovery needs a stale–oracle gap of at least ``min_gap``; when the gap is smaller (e.g. a control edit or
a tiny random model) the figures plot the raw decision margin instead and say so in the subtitle.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.engine.probes import Gap, HeadsResult, KnockoutResult, RandomControl, SuffixResult
from kvscope.engine.probes.attribution import AttributionResult
from kvscope.engine.probes.linear import GROUPS, LinearProbeResult
from kvscope.engine.words import counted
from kvscope.viz.common import GREY, LEGEND_BELOW, PALETTE, safe_label, safe_lines, set_title
from kvscope.viz.notes import attention_figure, frontier_figure, notes_map_figure


def _scale(gap: Gap) -> tuple[Callable[[float], float], str]:
    """Margin → plotted value: recovery on the gap, or the margin itself when the gap is too small."""
    if gap.note is None:
        return gap.recovery, f"recovery (0 = {gap.names[0]}, 1 = {gap.names[1]})"
    return float, "decision margin"


def _title(figure: go.Figure, text: str, gap: Gap, subplot_titles: int = 0) -> None:
    """Title ``figure`` with the gap (and why recovery is undefined, if it is) as its note."""
    first, second = gap.names
    note = f"{first} {gap.stale:+.2f} ({safe_label(gap.stale_label)}) → {second} {gap.oracle:+.2f} ({safe_label(gap.oracle_label)})"
    if gap.note:
        note += f"; margins shown: {safe_label(gap.note)}"
    set_title(figure, text, note, subplot_titles=subplot_titles)


def _references(figure: go.Figure, gap: Gap, scale: Callable[[float], float]) -> None:
    """Horizontal lines at the two reference states."""
    for name, margin, dash in ((gap.names[0], gap.stale, "dot"), (gap.names[1], gap.oracle, "dash")):
        figure.add_hline(y=scale(margin), line={"dash": dash, "color": GREY}, annotation_text=name, annotation_position="right")


def _draws(figure: go.Figure, x: list[int], controls: list[RandomControl], scale: Callable[[float], float]) -> None:
    """The random control's mean as a line and its draws as faint points."""
    figure.add_scatter(
        x=x,
        y=[scale(c.margin) for c in controls],
        name="random positions (mean)",
        mode="lines+markers",
        line={"color": GREY, "dash": "dot"},
    )
    figure.add_scatter(
        x=[k for k, c in zip(x, controls) for _ in c.margins],
        y=[scale(m) for c in controls for m in c.margins],
        name="random draws",
        mode="markers",
        marker={"color": GREY, "size": 5, "opacity": 0.6},
    )


def dose_response_figure(result: KnockoutResult) -> go.Figure:
    """Oracle decision with the top-K notes hidden, vs K, against K random downstream positions hidden."""
    gap, points = result.gap, result.points
    scale, axis = _scale(gap)
    figure = go.Figure()
    figure.add_scatter(
        x=[p.k for p in points],
        y=[scale(p.top.margin) for p in points],
        name="top-K notes hidden",
        mode="lines+markers",
        line={"color": PALETTE[1], "width": 3},
    )
    controlled = [p for p in points if p.random is not None]
    _draws(figure, [p.k for p in controlled], [p.random for p in controlled], scale)
    _references(figure, gap, scale)
    figure.update_layout(
        xaxis_title="K (notes hidden)", yaxis_title=axis, height=420, legend=LEGEND_BELOW, margin={"l": 60, "r": 60, "b": 90}
    )
    _title(figure, "Knockout dose-response: hiding the top-K notes from the oracle's decision", gap)
    return figure


def suffix_figure(result: SuffixResult) -> go.Figure:
    """Stale decision with the top-K notes patched from the oracle, vs K: all layers, each layer band, random K."""
    gap, points = result.gap, result.points
    scale, axis = _scale(gap)
    ks = [p.k for p in points]
    figure = go.Figure()
    figure.add_scatter(
        x=ks,
        y=[scale(p.all_layers.margin) for p in points],
        name="top-K, all layers",
        mode="lines+markers",
        line={"color": PALETTE[0], "width": 3},
    )
    for index, (band, layers) in enumerate(result.bands.items()):
        span = "no layers" if not layers else f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}–{layers[-1]}"
        figure.add_scatter(
            x=ks,
            y=[scale(p.bands[band].margin) for p in points],
            name=f"top-K, {band} ({span})",
            mode="lines+markers",
            line={"color": PALETTE[2 + index], "dash": "dash"},
        )
    _draws(figure, ks, [p.random for p in points], scale)
    _references(figure, gap, scale)
    figure.update_layout(
        xaxis={"title": "K (notes patched, log scale)", "type": "log", "tickvals": ks},
        yaxis_title=axis,
        height=460,
        legend=LEGEND_BELOW,
        margin={"l": 60, "r": 60, "b": 110},
    )
    _title(figure, "Suffix concentration: patching the top-K notes into the stale cache", gap)
    return figure


def heads_figure(result: HeadsResult) -> go.Figure:
    """Layer × head attention mass of the last decision token on the top notes (top heads marked), and the
    drop when the top heads, as many random heads, or all heads lose access to the notes."""
    gap = result.gap
    scale, _ = _scale(gap)
    dropped = "recovery" if gap.note is None else "margin"
    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.72, 0.28],
        horizontal_spacing=0.2,
        subplot_titles=("attention mass of the last decision token on the notes", f"drop in {dropped}<br>with notes hidden"),
    )
    mass = np.asarray(result.mass_last, dtype=np.float32)  # (layers, heads)
    figure.add_heatmap(
        z=mass,
        x=np.arange(mass.shape[1]),
        y=np.arange(mass.shape[0]),
        zmin=0.0,
        colorscale="Viridis",
        colorbar={"title": "mass", "x": 0.59, "thickness": 12},
        hovertemplate="layer %{y}, head %{x}<br>mass %{z:.4f}<extra></extra>",
        row=1,
        col=1,
    )
    figure.add_scatter(
        x=[h for _, h in result.top_heads],
        y=[layer for layer, _ in result.top_heads],
        mode="markers+text",
        text=[str(rank + 1) for rank in range(len(result.top_heads))],
        textfont={"color": "white", "size": 9},
        marker={"symbol": "square-open", "size": 14, "color": "white", "line": {"width": 2}},
        name="top heads (rank)",
        row=1,
        col=1,
    )

    def drop(margin: float) -> float:
        return scale(gap.oracle) - scale(margin)

    names = ["top heads", "random heads", "all heads"]
    figure.add_bar(
        x=names,
        y=[drop(result.top.margin), drop(result.random.margin), drop(result.all_heads.margin)],
        marker_color=[PALETTE[1], GREY, PALETTE[2]],
        name="drop",
        showlegend=False,
        row=1,
        col=2,
    )
    figure.add_scatter(
        x=["random heads"] * len(result.random.margins),
        y=[drop(m) for m in result.random.margins],
        mode="markers",
        marker={"color": "black", "size": 5},
        name="random draws",
        row=1,
        col=2,
    )
    figure.update_xaxes(title_text="head", dtick=max(1, round(mass.shape[1] / 16)), row=1, col=1)
    figure.update_yaxes(title_text="layer", dtick=max(1, round(mass.shape[0] / 16)), row=1, col=1)
    figure.update_layout(height=max(420, 200 + 14 * mass.shape[0]), legend=LEGEND_BELOW, margin={"l": 60, "r": 20, "b": 90})
    _title(
        figure,
        f"Read heads: {counted(len(result.top_heads), 'head')} with most attention on {counted(len(result.notes), 'note')}",
        gap,
        subplot_titles=2,
    )
    return figure


def linear_probe_figure(result: LinearProbeResult | dict) -> go.Figure:
    """Cross-validated accuracy per hidden state (index 0 = embeddings) and position group, decoding the conclusion (left)
    and the value (right), with chance, the write layer and the commit layer; from the result or its ``as_dict()``."""
    data = result if isinstance(result, dict) else result.as_dict()
    targets = ("conclusion", "value")
    figure = make_subplots(
        rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.06, subplot_titles=("decoding the conclusion", "decoding the value")
    )
    chance = {"conclusion": data["chance"], "value": max(data["value_counts"].values()) / data["n_samples"]}
    for col, target in enumerate(targets, start=1):
        for index, group in enumerate(GROUPS):
            row = data["accuracy"][target].get(group)
            if row is not None:
                figure.add_scatter(
                    x=list(range(len(row))),
                    y=row,
                    name=group,
                    legendgroup=group,
                    showlegend=col == 1,
                    mode="lines+markers",
                    line={"color": PALETTE[index]},
                    row=1,
                    col=col,
                )
        figure.add_hline(y=chance[target], line={"dash": "dot", "color": GREY}, annotation_text="chance", row=1, col=col)
        lines = (("write", data["write_layer"], PALETTE[0], "left"), ("commit", data["commit_layer"], PALETTE[4], "right"))
        for name, layer, colour, side in lines:  # write labelled left of its line, commit right: apart on adjacent layers
            if layer is not None:
                figure.add_vline(
                    x=layer,
                    line={"dash": "dash", "color": colour},
                    annotation={"text": f"{name} {layer}", "font": {"color": colour}},
                    annotation_position=f"bottom {side}",
                    row=1,
                    col=col,
                )
    if not data["conclusion_decodable"]:
        figure.add_annotation(  # in the middle of the empty left panel
            text=safe_lines(data["reason"] or "not decodable", 40),
            xref="paper",
            yref="paper",
            x=sum(figure.layout.xaxis.domain) / 2,
            y=0.5,
            showarrow=False,
        )
    figure.update_xaxes(
        title_text=f"hidden state (0 = embeddings, {data['num_layers']} = last layer)", range=[-0.5, data["num_layers"] + 0.5]
    )
    figure.update_yaxes(title_text="cross-validated accuracy", range=[0, 1.05], row=1, col=1)
    figure.update_layout(height=460, legend=LEGEND_BELOW, margin={"l": 60, "r": 20, "b": 110})
    set_title(
        figure,
        "Linear probe: where the conclusion is written vs where the decision commits",
        f"{safe_label(data['scenario'])}, field {safe_label(data['field'])}, {data['n_samples']} samples",
        subplot_titles=1,
    )
    return figure


def attribution_figure(result: AttributionResult, top: int = 40) -> go.Figure:
    """Horizontal bars of each context feature's attribution in reading order (the ``top`` strongest when
    there are more), field features outlined; Σ scores vs the all-ablated effect in the subtitle."""
    features = result.features
    if len(features) > top:
        strongest = set(sorted(range(len(features)), key=lambda i: -abs(features[i].score))[:top])
        features = [f for i, f in enumerate(features) if i in strongest]
    labels = [f"#{f.start} {safe_label(f.text, 40)}" for f in features]
    is_field = [f.kind.startswith("field:") for f in features]
    figure = go.Figure(
        go.Bar(
            x=[f.score for f in features],
            y=labels,
            orientation="h",
            marker={
                "color": [PALETTE[0] if f.score >= 0 else PALETTE[1] for f in features],
                "line": {"color": "black", "width": [2 if field else 0 for field in is_field]},
            },
            hovertext=[
                f"tokens {f.start}–{f.end - 1} ({safe_label(f.kind)})<br>{safe_lines(f.text)}<br>score {f.score:+.4f}" for f in features
            ],
            hoverinfo="text",
        )
    )
    shown = (
        f"top {len(features)} of {len(result.features)} features" if len(features) < len(result.features) else f"{len(features)} features"
    )
    figure.update_layout(
        xaxis_title="attribution (target units)",
        yaxis={"autorange": "reversed", "type": "category"},
        height=min(1400, 180 + 22 * len(features)),
        margin={"l": 260, "r": 20, "b": 50},
    )
    set_title(
        figure,
        f"Attribution of {safe_label(result.target)} ({result.run} run, {result.method}, {result.granularity})",
        f"Σ scores {result.total:+.3f} vs full − baseline {result.full_score - result.baseline_score:+.3f}; {shown}",
    )
    return figure


def readings_figure(name: str, data: dict) -> go.Figure:
    """Bars of every decision reading in a probe's ``as_dict()`` (entries holding a ``margin``)."""
    readings = {key: value for key, value in data.items() if isinstance(value, dict) and isinstance(value.get("margin"), (int, float))}
    figure = go.Figure(
        go.Bar(
            x=list(readings),
            y=[value["margin"] for value in readings.values()],
            text=[safe_label(str(value.get("label", ""))) for value in readings.values()],
        )
    )
    for key, dash in (("stale_margin", "dot"), ("oracle_margin", "dash")):
        if isinstance(data.get(key), (int, float)):
            figure.add_hline(
                y=data[key], line={"dash": dash, "color": GREY}, annotation_text=key.split("_")[0], annotation_position="right"
            )
    figure.update_layout(yaxis_title="decision margin", height=380, margin={"r": 60})
    set_title(figure, f"Probe {safe_label(name)}: decision margins")
    return figure


def probe_figure(name: str, result) -> go.Figure:
    """The figure for any probe result by probe name."""
    builders = {
        "suffix": suffix_figure,
        "knockout": dose_response_figure,
        "heads": heads_figure,
        "linear": linear_probe_figure,
        "attribution": attribution_figure,
        "notes_map": notes_map_figure,
        "attention": lambda r: attention_figure(r.oracle),
        "frontier": frontier_figure,
    }
    return builders[name](result) if name in builders else readings_figure(name, result.as_dict())
