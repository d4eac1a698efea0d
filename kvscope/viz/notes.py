"""Figures of where the notes are: a context as a coloured token strip, attention and patch-effect maps."""

from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go

from kvscope.engine.cache.patching import EffectMap
from kvscope.engine.probes import AttentionMap, NotesMapResult
from kvscope.engine.probes.frontier import FrontierResult
from kvscope.viz.common import (
    DIVERGING,
    GREY,
    LEGEND_BELOW,
    PALETTE,
    column_of,
    diverging_colour,
    layer_token_map,
    robust_limit,
    safe_label,
    set_title,
)

MAX_TEXT_TOKENS = 1024  # tokens drawn in a text view (one <span> each); a longer context shows windows
TEXT_WINDOW = 16  # neighbours shown either side of the field and of each strongest token in a long context


def shown_tokens(values: np.ndarray, outlined: np.ndarray, cap: int = MAX_TEXT_TOKENS) -> np.ndarray:
    """Which tokens a text view draws (bool per token): all of them up to ``cap``; beyond, the ``outlined``
    tokens (the field) first, then the tokens of largest |value|, each with up to TEXT_WINDOW neighbours
    either side (nearest first), until ``cap`` are chosen."""
    count = len(values)
    if count <= cap:
        return np.ones(count, dtype=bool)
    strongest = np.argsort(-np.abs(np.nan_to_num(values)), kind="stable")
    shown, left = np.zeros(count, dtype=bool), cap
    for centre in np.concatenate([np.flatnonzero(outlined), strongest]):
        window = np.arange(max(centre - TEXT_WINDOW, 0), min(centre + TEXT_WINDOW + 1, count))
        new = window[~shown[window]]
        new = new[np.argsort(np.abs(new - centre), kind="stable")][:left]
        shown[new] = True
        left -= len(new)
        if left == 0:
            break
    return shown


def _stretches(flags: np.ndarray) -> list[range]:
    """Runs of consecutive positions with the same flag."""
    edges = [0, *(np.flatnonzero(flags[1:] != flags[:-1]) + 1).tolist(), len(flags)]
    return [range(start, stop) for start, stop in zip(edges, edges[1:])]


def _gap_html(hidden: range, values: np.ndarray, value_name: str) -> str:
    """The inline marker standing for hidden tokens: how many and where; their largest |value| on hover."""
    first, last, peak = hidden.start, hidden.stop - 1, float(np.nanmax(np.abs(values[hidden.start : hidden.stop])))
    tip = html.escape(f"#{first}–#{last} not shown; largest |{value_name}| there {peak:.3g}", quote=True)
    return f'<span class="kv-gap" title="{tip}" data-hidden="{len(hidden)}"> ⋯ {len(hidden):,} tokens (#{first}–#{last}) ⋯ </span>'


def _token_html(position: int, text: str, value: float, segment: str, value_name: str, limit: float, outlined: bool) -> str:
    """One token as a coloured span, its position, segment and value in the hover title."""
    tip = html.escape(f"#{position} {text!r} [{segment}] {value_name} {value:+.4g}", quote=True)
    return (
        f'<span class="kv-tok{" kv-field" if outlined else ""}" title="{tip}" data-value="{value:.4g}" '
        f'style="background:{diverging_colour(value, limit)}">{html.escape(text)}</span>'
    )


def token_text_html(
    texts: Sequence[str],
    values: Sequence[float],
    segments: Sequence[str],
    value_name: str = "value",
    title: str = "Context",
    highlight: str | None = "field:",
) -> str:
    """The context as readable text, line breaks where the context has them, each token's background coloured
    by its value on a robust symmetric scale (red above 0, blue below); position, segment and value show on
    hover. Tokens whose segment starts with ``highlight`` are outlined. Every string is HTML-escaped. Beyond
    MAX_TEXT_TOKENS tokens only windows around the field and the strongest values are drawn (see
    :func:`shown_tokens`), each hidden stretch replaced by a marker with its length and largest |value|."""
    if not len(texts) == len(values) == len(segments):
        raise ValueError(f"got {len(texts)} texts, {len(values)} values and {len(segments)} segments; they must match")
    if not texts:
        raise ValueError("no tokens to draw")
    array = np.asarray(values, dtype=np.float64)
    limit = robust_limit(array)
    outlined = np.array([bool(highlight) and segment.startswith(highlight) for segment in segments])
    shown = shown_tokens(array, outlined)
    pieces = []
    for stretch in _stretches(shown):
        if not shown[stretch.start]:
            pieces.append(_gap_html(stretch, array, value_name))
            continue
        pieces += [_token_html(p, texts[p], float(array[p]), segments[p], value_name, limit, bool(outlined[p])) for p in stretch]
    count = int(shown.sum())
    window = (
        ""
        if count == len(texts)
        else (f"; showing {count:,} of {len(texts):,} tokens: the field and the strongest values with up to {TEXT_WINDOW} neighbours each")
    )
    legend = (
        f'<div class="kv-legend">{html.escape(title)} · colour scale ±{limit:.3g} {html.escape(value_name)} '
        '(<span style="background:rgba(214,39,40,.85)">&nbsp;+&nbsp;</span> towards the new decision, '
        '<span style="background:rgba(31,119,180,.85)">&nbsp;−&nbsp;</span> away; outlined: the field; hover a token for its value'
        f"{window})</div>"
    )
    return (
        TEXT_CSS + f'<div class="kv-text" data-tokens="{len(texts)}" data-shown="{count}" data-limit="{limit:.4g}">{legend}'
        f'<div class="kv-body">{"".join(pieces)}</div></div>'
    )


TEXT_CSS = """<style>
.kv-text{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px;line-height:1.7}
.kv-text .kv-body{white-space:pre-wrap;word-break:break-word;max-height:520px;overflow:auto;border:1px solid #d0d7de;border-radius:6px;padding:8px}
.kv-text .kv-tok{border-radius:3px}
.kv-text .kv-field{outline:2px solid #6a4c93}
.kv-text .kv-gap{color:#777;font-style:italic;font-family:sans-serif;font-size:12px}
.kv-text .kv-legend{font-family:sans-serif;font-size:12px;color:#555;margin-bottom:4px}
</style>"""


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
    figure, _, _ = layer_token_map(
        array.mean(1) if head is None else array[:, head],  # (layers, tokens)
        "context token",
        texts,
        positions,
        segments,
        zmin=0.0,
        colorscale="Viridis",
        colorbar={"title": "attention", "thickness": 14},
        hovertemplate="layer %{y}<br>%{x}<br>attention %{z:.4f}<extra></extra>",
    )
    which = "mean over heads" if head is None else f"head {head}"
    set_title(figure, f"{heading}: {which}", subplot_titles=_field_labels(segments))
    return figure


def _field_labels(segments: Sequence[str] | None) -> int:
    """Rows of field names :func:`mark_fields` writes above the plot (room set_title leaves for them): 1 with a field."""
    return int(any(segment.startswith("field:") for segment in segments or ()))


def _effect_heatmap(
    effects: np.ndarray, positions: Sequence[int], texts: Sequence[str], segments: Sequence[str], axis: str = "field and downstream token"
) -> tuple[go.Figure, list[str], list[range]]:
    """A diverging layer × position heatmap of Δmargin, pooled when wide, its x axis titled ``axis``; returns the figure,
    columns and runs."""
    figure, names, runs = layer_token_map(
        np.asarray(effects, dtype=np.float32),
        axis,
        texts,
        positions,
        segments,
        hovertemplate="layer %{y}<br>%{x}<br>attributed Δ margin %{z:+.4f}<extra></extra>",
        colorscale=DIVERGING,
    )
    limit = robust_limit(figure.data[0].z)  # the scale's end: 98th percentile of |Δ| in the pooled map
    figure.update_traces(colorbar={"title": f"Δ margin<br>±{limit:.2g}", "thickness": 14}, zmin=-limit, zmax=limit)
    return figure, names, runs


def effect_map_figure(effects: EffectMap, texts: Sequence[str], segments: Sequence[str], all_positions: bool = False) -> go.Figure:
    """Attribution notes map from an :class:`EffectMap` over the field and downstream tokens, or over every
    context position (``all_positions``: positions before the field hold the same K/V in both runs, so 0);
    ``texts``/``segments`` are per context position."""
    positions = list(range(len(texts))) if all_positions else list(effects.positions)
    z = np.zeros((effects.effects.shape[0], len(positions)), dtype=np.float32)
    column = {position: i for i, position in enumerate(positions)}
    z[:, [column[p] for p in effects.positions]] = effects.effects.numpy()
    axis = "context token" if all_positions else "field and downstream token"
    figure, _, _ = _effect_heatmap(z, positions, [texts[p] for p in positions], [segments[p] for p in positions], axis)
    shown = "every context position" if all_positions else "the field and the tokens after it"
    set_title(
        figure,
        f"Notes map ({effects.method})",
        f"Δ margin from patching the new run's K/V per (layer, token), {shown}; colours end at the 98th percentile of |Δ|",
        subplot_titles=_field_labels(segments),
    )
    return figure


def effect_text_html(effects: EffectMap, texts: Sequence[str], segments: Sequence[str]) -> str:
    """The whole context as text coloured by each position's summed patch effect (0 before the field)."""
    values = np.zeros(len(texts), dtype=np.float32)
    values[list(effects.positions)] = effects.per_position().numpy()
    return token_text_html(texts, values.tolist(), segments, value_name="Δ margin", title="Context coloured by notes effect (all layers)")


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
        showlegend=True,
        hovertext=[f"layer {c.layer}, #{c.position}<br>exact Δ {c.exact:+.4f}<br>attributed Δ {c.attribution:+.4f}" for c in checks],
        hoverinfo="text",
    )
    gap = result.gap
    figure.update_layout(legend={**LEGEND_BELOW, "y": -0.45}, margin={"b": 150})  # below the tilted token labels
    set_title(
        figure,
        "Notes map: Δ margin from patching oracle K/V",
        f"per (layer, token); stale {gap.stale:+.2f} → oracle {gap.oracle:+.2f}; colours end at the 98th percentile of |Δ|",
        subplot_titles=_field_labels(result.segments),
    )
    return figure


_PAPER_FRONTIER = "Paper (Qwen3-8B): CacheBlend-style selection P(correct) 0.13 at 14.5% recomputed; field+erratum 1.00 at 12.6%"


def frontier_figure(result: FrontierResult) -> go.Figure:
    """Recovery against the share of context tokens computed: field_topk over K as lines (causal and deviation
    ranking), the other strategies as points; filled markers reach the oracle's decision, open ones do not."""
    figure = go.Figure()
    colours = dict(zip(result.methods(), PALETTE * 3))
    for method in result.methods():
        points = [p for p in result.points if p.method == method]
        ladder = points[0].k is not None
        figure.add_scatter(
            x=[100 * p.fraction for p in points],
            y=[p.recovery for p in points],
            mode="lines+markers" if ladder else "markers",
            name=safe_label(method),
            line={"color": colours[method], "dash": "dot" if "deviation" in method else "solid"},
            marker={
                "size": 9 if ladder else 13,
                "color": colours[method],
                "line": {"color": colours[method], "width": 2},
                "symbol": ["circle" if p.correct else "circle-open" for p in points],
            },
            hovertext=[
                f"<b>{safe_label(method)}</b>{'' if p.k is None else f', K={p.k}'}<br>{p.tokens_computed} of {result.context_tokens} "
                f"tokens computed ({100 * p.fraction:.1f}%)<br>margin {p.margin:+.3f} → {safe_label(p.label)}<br>"
                f"recovery {'n/a' if p.recovery is None else f'{p.recovery:.2f}'}"
                for p in points
            ],
            hoverinfo="text",
        )
    for level, name in ((0.0, "stale"), (1.0, "oracle")):
        figure.add_hline(y=level, line={"color": GREY, "dash": "dash"}, annotation_text=name, annotation_position="right")
    gap = result.gap
    figure.update_layout(
        xaxis={"title": "context tokens computed (%, log scale)", "type": "log", "dtick": 1, "ticksuffix": "%"},
        yaxis={"title": "decision recovery (0 = stale, 1 = oracle)"},
        height=560,
        margin={"l": 60, "r": 60, "b": 130},
        legend={**LEGEND_BELOW, "y": -0.2},
    )
    set_title(
        figure,
        "Cost–quality frontier of this edit",
        safe_label(result.notes.headline()),
        f"stale {gap.stale:+.2f} → oracle {gap.oracle:+.2f} ({safe_label(gap.oracle_label)}); filled markers reach the oracle's decision",
        _PAPER_FRONTIER,
    )
    return figure
