"""Figures of where the notes are: a context as a coloured token strip, attention and patch-effect maps."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from engine.patching import EffectMap
from engine.probes import AttentionMap, NotesMapResult
from viz.common import column_of, heat_colours, map_height, pool_columns, safe_label, token_columns


def token_strip_figure(
    texts: Sequence[str],
    values: Sequence[float],
    segments: Sequence[str],
    title: str = "Context",
    per_row: int = 24,
    value_name: str = "value",
) -> go.Figure:
    """The context as rows of ``per_row`` token cells coloured by a value (diverging at 0 when it has both
    signs), token text in the cells, position, segment and value in hover."""
    if not len(texts) == len(values) == len(segments):
        raise ValueError(f"got {len(texts)} texts, {len(values)} values and {len(segments)} segments; they must match")
    if not texts:
        raise ValueError("no tokens to draw")
    count, rows = len(texts), math.ceil(len(texts) / per_row)
    z = np.full(rows * per_row, np.nan, dtype=np.float32)
    z[:count] = values
    cells = [safe_label(text, 12) for text in texts] + [""] * (rows * per_row - count)
    hover = [
        f"#{i} {safe_label(texts[i], 40)}<br>{safe_label(segments[i], 40)}<br>{safe_label(value_name)} {values[i]:+.4g}"
        for i in range(count)
    ] + [""] * (rows * per_row - count)
    figure = go.Figure(
        go.Heatmap(
            z=z.reshape(rows, per_row),
            text=np.array(cells, dtype=object).reshape(rows, per_row),
            texttemplate="%{text}",
            textfont={"size": 10},
            hovertext=np.array(hover, dtype=object).reshape(rows, per_row),
            hoverinfo="text",
            xgap=1,
            ygap=1,
            colorbar={"title": safe_label(value_name)},
            **heat_colours(z),
        )
    )
    figure.update_layout(
        title=safe_label(title),
        xaxis={"visible": False},
        yaxis={
            "autorange": "reversed",
            "tickmode": "array",
            "tickvals": list(range(rows)),
            "ticktext": [f"#{row * per_row}" for row in range(rows)],
            "title": "first token of the row",
        },
        height=min(1200, 120 + 26 * rows),
        margin={"l": 70, "r": 20, "t": 50, "b": 20},
    )
    return figure


def attention_figure(
    attention: np.ndarray | AttentionMap,
    texts: Sequence[str] | None = None,
    head: int | None = None,
    title: str | None = None,
) -> go.Figure:
    """Layer × token attention from the decision token: mean over heads, or one ``head``. Takes an array
    (layers, heads, tokens) or a probe's :class:`AttentionMap` (its texts, positions and segments)."""
    positions = segments = None
    heading = safe_label(title) if title else "Attention of the decision token"
    if isinstance(attention, AttentionMap):
        texts = attention.token_texts if texts is None else texts
        positions, segments = attention.positions, attention.segments
        heading += f" (decision {safe_label(attention.label)})"
        attention = attention.attention
    array = np.asarray(attention, dtype=np.float32)
    if array.ndim != 3:
        raise ValueError(f"attention must be (layers, heads, tokens), got shape {array.shape}")
    layers, heads, tokens = array.shape
    if texts is not None and len(texts) != tokens:
        raise ValueError(f"got {len(texts)} token texts for {tokens} attended tokens")
    if head is not None and not 0 <= head < heads:
        raise ValueError(f"head {head} is outside 0..{heads - 1}")
    z, runs = pool_columns(array.mean(1) if head is None else array[:, head])  # (layers, columns)
    names, xaxis = token_columns(runs, texts, positions, segments)
    which = "mean over heads" if head is None else f"head {head}"
    figure = go.Figure(
        go.Heatmap(
            z=z, x=names, y=np.arange(layers), zmin=0.0, colorscale="Viridis", colorbar={"title": "attention"},
            hovertemplate="layer %{y}<br>%{x}<br>attention %{z:.4f}<extra></extra>",
        )
    )
    figure.update_layout(
        title=f"{heading}: {which}",
        xaxis={**xaxis, "title": "context token"},
        yaxis_title="layer",
        height=map_height(layers),
        margin={"l": 60, "r": 20, "t": 50, "b": 100},
    )
    return figure


def _effect_heatmap(effects: np.ndarray, positions: Sequence[int], texts: Sequence[str], segments: Sequence[str]) -> tuple[go.Figure, list[str], list[range]]:
    """A diverging layer × position heatmap of Δmargin, pooled when wide; returns the figure, columns and runs."""
    z, runs = pool_columns(np.asarray(effects, dtype=np.float32))  # (layers, columns)
    names, xaxis = token_columns(runs, texts, positions, segments)
    figure = go.Figure(
        go.Heatmap(
            z=z, x=names, y=np.arange(len(z)), colorbar={"title": "Δ margin"},
            hovertemplate="layer %{y}<br>%{x}<br>attributed Δ margin %{z:+.4f}<extra></extra>",
            **heat_colours(z, diverging=True),
        )
    )
    figure.update_layout(
        xaxis={**xaxis, "title": "field and downstream token"}, yaxis_title="layer",
        height=map_height(len(z)), margin={"l": 60, "r": 20, "t": 70, "b": 100},
    )
    return figure, names, runs


def effect_map_figure(effects: EffectMap, texts: Sequence[str], segments: Sequence[str]) -> go.Figure:
    """Attribution notes map from an :class:`EffectMap`; ``texts``/``segments`` are per context position."""
    figure, _, _ = _effect_heatmap(
        effects.effects.numpy(), effects.positions, [texts[p] for p in effects.positions], [segments[p] for p in effects.positions]
    )
    figure.update_layout(title=f"Notes map ({effects.method}): Δ margin from patching the new run's K/V per (layer, token)")
    return figure


def effect_strip_figure(effects: EffectMap, texts: Sequence[str], segments: Sequence[str]) -> go.Figure:
    """The whole context coloured by each position's summed patch effect (0 before the field)."""
    values = np.zeros(len(texts), dtype=np.float32)
    values[list(effects.positions)] = effects.per_position().numpy()
    return token_strip_figure(texts, values.tolist(), segments, title="Context coloured by notes effect (Δ margin, all layers)", value_name="Δ margin")


def notes_map_figure(result: NotesMapResult) -> go.Figure:
    """Layer × position Δmargin of patching the oracle's K/V into the stale cache (attribution, diverging at 0),
    the exactly verified (layer, position) entries marked with their exact Δmargin in hover."""
    figure, names, runs = _effect_heatmap(result.effects, result.positions, result.token_texts, result.segments)
    checks = result.entry_checks
    figure.add_scatter(
        x=[names[column_of(runs, result.positions.index(check.position))] for check in checks],
        y=[check.layer for check in checks],
        mode="markers",
        marker={"symbol": "square-open", "size": 12, "color": "black", "line": {"width": 2}},
        name="verified by exact patch",
        hovertext=[f"layer {c.layer}, #{c.position}<br>exact Δ {c.exact:+.4f}<br>attributed Δ {c.attribution:+.4f}" for c in checks],
        hoverinfo="text",
    )
    gap = result.gap
    figure.update_layout(
        title=f"Notes map: Δ margin from patching oracle K/V per (layer, token); stale {gap.stale:+.2f} → oracle {gap.oracle:+.2f}",
        legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
    )
    return figure
