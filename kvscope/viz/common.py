"""Shared pieces of the figures: safe labels for user and model text, token axes, pooling of big maps.

Every user or model string that reaches a figure goes through :func:`safe_label`: plotly renders a subset
of HTML (``<br>``, ``<b>``, entities) in hover, ticks and cell text, so ``<``, ``>`` and ``&`` are escaped
(plotly shows the escaped text as written), control and format characters are replaced, and newlines and
edge spaces are made visible.
"""

from __future__ import annotations

import html
import math
import re
import textwrap
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import plotly.offline

MAX_COLUMNS = 512  # heatmap columns sent to the browser (a 512-wide map draws in under a second)
MAX_TICKS = 28  # token labels on an axis (tilted, they stay apart on a 600 px figure); more are thinned
DIVERGING = "RdBu_r"  # negative blue, positive red, centred at 0
PALETTE = ("#2a9d8f", "#e76f51", "#264653", "#e9c46a", "#8e7dbe", "#f4a261", "#457b9d")
GREY = "#b0bec5"
APART_SYMBOLS = ("circle", "square", "diamond", "cross")
FIELD_COLOUR = "#e040fb"  # outlines a field's columns; visible on Viridis and RdBu alike
TEMPLATE = "plotly_white"
# The theme is plotly's default rather than a per-figure argument: naming a template on a figure
# validates the whole template again (~25 ms per figure, most of an edit's figure time).
pio.templates.default = TEMPLATE

_VISIBLE = {"\n": "⏎", "\r": "␍", "\t": "⇥"}
_HIDDEN = {"Cc", "Cf", "Cs", "Zl", "Zp"}  # control, format (bidi overrides, zero width), surrogates, separators


def apart_marker(index: int) -> dict:
    """The marker of the ``index``-th of lines that may coincide (equal hit rates, both accuracies 1.0): a symbol of its
    own and a size that shrinks with the index, so a line drawn later sits inside the earlier one's marker."""
    return {"symbol": APART_SYMBOLS[index % len(APART_SYMBOLS)], "size": 12 - 2 * (index % len(APART_SYMBOLS))}


def safe_label(text: str, limit: int | None = None) -> str:
    """Text made visible and inert: ⏎ ␍ ⇥ for line breaks and tabs, � for other control or format characters,
    · for spaces at the edges, ∅ for the empty string, cut to ``limit`` characters with …, then HTML-escaped."""
    shown = "".join(_VISIBLE.get(c) or ("�" if unicodedata.category(c) in _HIDDEN else c) for c in text)
    core = shown.strip(" ")
    if not core:
        shown = "·" * len(shown) or "∅"
    else:
        lead = len(shown) - len(shown.lstrip(" "))
        shown = "·" * lead + core + "·" * (len(shown) - lead - len(core))
    if limit is not None and len(shown) > limit:
        shown = shown[: max(limit - 1, 0)] + "…"
    return html.escape(shown, quote=False)


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_{}\[\]()#+\-.!|~>])")


def markdown_literal(text: str) -> str:
    """User text shown as itself inside Markdown: HTML-escaped, and every Markdown character backslash-escaped
    (no links, images, emphasis or headings can be injected)."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", html.escape(str(text), quote=False))


def safe_lines(text: str, width: int = 60) -> str:
    """Longer text (a reason, a note) wrapped for hover: safe lines joined by ``<br>``."""
    return "<br>".join(safe_label(line) for line in textwrap.wrap(text, width)) or "∅"


def pool_columns(z: np.ndarray, cap: int = MAX_COLUMNS) -> tuple[np.ndarray, list[range]]:
    """At most ``cap`` columns: equal runs of columns merged, each keeping its value of largest magnitude
    (peaks and signs survive). Returns the pooled (rows, runs) float32 map and each run's source columns."""
    z = np.asarray(z, dtype=np.float32)
    count = z.shape[1]
    step = max(1, math.ceil(count / cap))
    runs = [range(start, min(start + step, count)) for start in range(0, count, step)]
    if step == 1:
        return z, runs
    blocks = np.pad(z, ((0, 0), (0, len(runs) * step - count)), constant_values=np.nan).reshape(len(z), len(runs), step)
    strongest = np.nan_to_num(np.abs(blocks), nan=-1.0).argmax(-1)  # (rows, runs)
    return np.take_along_axis(blocks, strongest[..., None], -1)[..., 0], runs


def token_columns(
    runs: Sequence[range],
    texts: Sequence[str] | None = None,
    positions: Sequence[int] | None = None,
    segments: Sequence[str] | None = None,
) -> tuple[list[str], dict]:
    """Category names of heatmap columns (unique: position, token, segment; shown in hover) and x-axis
    settings labelling at most MAX_TICKS of them with their token text."""
    positions = list(range(runs[-1].stop)) if positions is None else list(positions)
    names, ticks = [], []
    for run in runs:
        first, last = run[0], run[-1]
        token = safe_label(texts[first], 16) if texts is not None else str(positions[first])
        where = f"#{positions[first]}" if len(run) == 1 else f"#{positions[first]}–{positions[last]} ({len(run)} tokens, strongest shown)"
        segment = f" [{safe_label(segments[first], 32)}]" if segments is not None else ""
        names.append(f"{where} {token}{segment}")
        ticks.append(token if len(run) == 1 else f"#{positions[first]} {token}…")
    stride = max(1, math.ceil(len(names) / MAX_TICKS))
    axis = {
        "type": "category",
        "tickmode": "array",
        "tickvals": names[::stride],
        "ticktext": ticks[::stride],
        "tickangle": -60,
    }
    return names, axis


def mark_fields(figure: go.Figure, runs: Sequence[range], segments: Sequence[str] | None) -> None:
    """Outline the heatmap columns holding each field's tokens (segments ``field:NAME``), labelled with the
    field's name, so that a field stays findable among thousands of pooled tokens."""
    columns: dict[str, list[int]] = {}
    for column, run in enumerate(runs if segments is not None else ()):
        for segment in dict.fromkeys(segments[i] for i in run if segments[i].startswith("field:")):
            columns.setdefault(segment, []).append(column)
    for segment, held in columns.items():
        figure.add_vrect(
            x0=held[0] - 0.5,
            x1=held[-1] + 0.5,
            line={"color": FIELD_COLOUR, "width": 2},
            fillcolor="rgba(0,0,0,0)",
            annotation={"text": safe_label(segment.removeprefix("field:"), 24), "font": {"color": FIELD_COLOUR, "size": 11}},
            annotation_position="outside top",
        )


def column_of(runs: Sequence[range], index: int) -> int:
    """The pooled column holding source column ``index``."""
    return index // len(runs[0])


def layer_token_map(
    z: np.ndarray,
    axis: str,
    texts: Sequence[str] | None = None,
    positions: Sequence[int] | None = None,
    segments: Sequence[str] | None = None,
    **heatmap,
) -> tuple[go.Figure, list[str], list[range]]:
    """A layer × token heatmap of ``z`` (layers, tokens), pooled to MAX_COLUMNS, its token axis titled ``axis`` and each
    field outlined; ``heatmap``: the trace's colours and hover. Returns the figure, its column names and their runs."""
    pooled, runs = pool_columns(z)
    names, xaxis = token_columns(runs, texts, positions, segments)
    figure = go.Figure(go.Heatmap(z=pooled, x=names, y=np.arange(len(pooled)), **heatmap))
    figure.update_layout(
        xaxis={**xaxis, "title": axis}, yaxis_title="layer", height=map_height(len(pooled)), margin={"l": 60, "r": 20, "b": 100}
    )
    mark_fields(figure, runs, segments)
    return figure, names, runs


def robust_limit(values: np.ndarray, quantile: float = 0.98) -> float:
    """A symmetric colour limit ±r that a few extreme cells cannot wash out: the ``quantile`` of |values|
    (the largest |value| when that is 0; 1 for an all-zero map)."""
    magnitudes = np.abs(np.asarray(values, dtype=np.float64))
    magnitudes = magnitudes[np.isfinite(magnitudes)]
    if magnitudes.size == 0 or magnitudes.max() == 0:
        return 1.0
    limit = float(np.quantile(magnitudes, quantile))
    return limit if limit > 0 else float(magnitudes.max())


def diverging_colour(value: float, limit: float) -> str:
    """An rgba background for ``value`` on a ±``limit`` scale: red above 0, blue below, transparent at 0."""
    strength = min(abs(value) / limit, 1.0) if limit > 0 and math.isfinite(value) else 0.0
    red, green, blue = (214, 39, 40) if value > 0 else (31, 119, 180)
    return f"rgba({red},{green},{blue},{0.85 * strength:.3f})"


def whiskers(stats: Sequence[dict | None]) -> dict:
    """An ``error_y`` from each stat's median down to its ``min`` and up to its ``max`` (none for an empty stat)."""
    return {
        "type": "data",
        "symmetric": False,
        "array": [stat["max"] - stat["median"] if stat else None for stat in stats],
        "arrayminus": [stat["median"] - stat["min"] if stat else None for stat in stats],
    }


def parameter_count(count: float) -> str:
    """A parameter count as 135 M or 1.78 B."""
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.0f} M"


def map_height(layers: int) -> int:
    """A layer × token map's height: about 16 px per layer below its title and above its tilted token labels, within
    440–900."""
    return min(900, max(440, 260 + 16 * layers))


def label_colours(labels: Sequence[str]) -> dict[str, str]:
    """A fixed colour per decision label, in the given order."""
    return {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(labels)}


# The narrowest plot the app shows is 600 px wide (a plot in a row of two at a 1,400 px window; below that, rows wrap and
# each plot gets the whole 704 px of a 1,000 px window): titles and notes are wrapped to fit it.
TITLE_CHARS = 64  # a title line (17 px type) that fits a 600 px figure
NOTE_CHARS = 100  # a note line under it (12 px type)
LEGEND_BELOW = {"orientation": "h", "yanchor": "top", "y": -0.28}  # below the x axis title, clear of it
GRADIO_LABEL_PX = 30  # Gradio draws a plot's label over its top-left corner: this high, padding included


def set_title(figure: go.Figure, text: str, *notes: str, subplot_titles: int = 0) -> None:
    """Title ``figure`` (its height already set) so that it fits a 600 px plot: ``text`` wrapped at :data:`TITLE_CHARS`,
    each note wrapped in small type below it, all above ``subplot_titles`` lines of subplot titles and below the label
    Gradio draws over a figure's top-left corner; the top margin is sized to hold it. Text and notes are markup-free or
    :func:`safe_label`-ed."""
    heads = textwrap.wrap(text, TITLE_CHARS) or [""]
    lines = [line for note in notes if note for line in textwrap.wrap(note, NOTE_CHARS)]
    below = 12 + 24 * subplot_titles  # px between the title's last line and the plot area
    first = GRADIO_LABEL_PX + 28  # px from the top to the first title line's foot (plotly lays later lines below it)
    notes_px = 16 + 22 * (len(lines) - 1) if lines else 0  # plotly spaces every line after the first 22 px, a note's first 16
    top = first + 22 * (len(heads) - 1) + notes_px + below + 8  # the top margin
    figure.update_layout(
        title={
            "text": "<br>".join(heads) + "".join(f"<br><sup>{line}</sup>" for line in lines),
            "x": 0.03,
            "xref": "container",
            "xanchor": "left",
            "y": 1 - first / (figure.layout.height or 450),
            "yref": "container",
            "yanchor": "bottom",
        },
        margin={"t": top},
    )


NARROWEST_PLOT_PX = 600  # the narrowest plot the app shows (see above): label placement is planned at this width
LABEL_CHAR_PX, LABEL_LINE_PX = 6.8, 16  # a 12 px label's width per character (generous) and its line's height
# Where plotly puts a point's text for each ``textposition``: the label box's (left, right, bottom, top) in px from the
# point, for a label ``w`` px wide beside a marker of radius ``r`` (plus a gap); in the order they are tried.
_LABEL_PLACES = {
    "top center": lambda w, r: (-w / 2, w / 2, r, r + LABEL_LINE_PX),
    "bottom center": lambda w, r: (-w / 2, w / 2, -r - LABEL_LINE_PX, -r),
    "middle right": lambda w, r: (r, r + w, -LABEL_LINE_PX / 2, LABEL_LINE_PX / 2),
    "middle left": lambda w, r: (-r - w, -r, -LABEL_LINE_PX / 2, LABEL_LINE_PX / 2),
    "top right": lambda w, r: (r * 0.6, r * 0.6 + w, r * 0.6, r * 0.6 + LABEL_LINE_PX),
    "top left": lambda w, r: (-r * 0.6 - w, -r * 0.6, r * 0.6, r * 0.6 + LABEL_LINE_PX),
    "bottom right": lambda w, r: (r * 0.6, r * 0.6 + w, -r * 0.6 - LABEL_LINE_PX, -r * 0.6),
    "bottom left": lambda w, r: (-r * 0.6 - w, -r * 0.6, -r * 0.6 - LABEL_LINE_PX, -r * 0.6),
}


@dataclass(frozen=True)
class PlacedLabels:
    """Point labels placed apart: each point's ``textposition``, the axis ranges that hold every label inside the plot
    area, and each label's box in px from the plot area's bottom left at the width planned for."""

    positions: list[str]
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    boxes: list[tuple[float, float, float, float]]  # (left, right, bottom, top)


def label_box(x_px: float, y_px: float, text: str, position: str, marker_px: float) -> tuple[float, float, float, float]:
    """The box (left, right, bottom, top, px) plotly's ``position`` gives ``text`` beside a point at (``x_px``, ``y_px``)."""
    width = LABEL_CHAR_PX * len(html.unescape(text)) + 4
    left, right, bottom, top = _LABEL_PLACES[position](width, marker_px / 2 + 3)
    return x_px + left, x_px + right, y_px + bottom, y_px + top


def _overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    return min(a[1], b[1]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[2], b[2])


def place_labels(
    x: Sequence[float],
    y: Sequence[float],
    texts: Sequence[str],
    x_range: Sequence[float],
    y_range: Sequence[float],
    plot_px: tuple[float, float],
    marker_px: float = 12,
) -> PlacedLabels:
    """Labels of scatter points that neither overlap each other nor cover another point, each nearer its own point than
    any other, and inside the plot area: each label takes the first place (above, below, right, left, then the corners)
    that is clear, preferring one inside the axis ranges; the ranges then grow to hold any label past their edge.
    ``plot_px``: the plot area's (width, height) at the narrowest width the figure is shown at; a wider figure spreads
    the points further apart."""
    width, height = plot_px
    x_range, y_range = (float(x_range[0]), float(x_range[1])), (float(y_range[0]), float(y_range[1]))
    positions: list[str] = []
    boxes: list[tuple[float, float, float, float]] = []
    for _ in range(8 if len(texts) else 0):  # a wider range moves the points closer in px: place again until every label fits
        sx, sy = width / (x_range[1] - x_range[0]), height / (y_range[1] - y_range[0])
        points = [((a - x_range[0]) * sx, (b - y_range[0]) * sy) for a, b in zip(x, y)]
        half = marker_px / 2 + 1
        markers = [(a - half, a + half, b - half, b + half) for a, b in points]
        positions, boxes = [], []
        for index, ((a, b), text) in enumerate(zip(points, texts)):

            def cost(position: str) -> tuple[int, float]:
                box = label_box(a, b, text, position, marker_px)
                others = [*boxes, *(marker for other, marker in enumerate(markers) if other != index)]
                outside = max(0.0, -box[0], box[1] - width, -box[2], box[3] - height)
                # a label whose middle is nearer another point than its own reads as that point's
                middle = (box[0] + box[1]) / 2, (box[2] + box[3]) / 2
                own = math.dist(middle, (a, b))
                misread = sum(math.dist(middle, point) < own for other, point in enumerate(points) if other != index)
                return sum(_overlap(box, other) for other in others) + misread, outside

            position = min(_LABEL_PLACES, key=lambda place: (*cost(place), list(_LABEL_PLACES).index(place)))
            positions.append(position)
            boxes.append(label_box(a, b, text, position, marker_px))
        past = (
            max(0.0, -min(box[0] for box in boxes)),
            max(0.0, max(box[1] for box in boxes) - width),
            max(0.0, -min(box[2] for box in boxes)),
            max(0.0, max(box[3] for box in boxes) - height),
        )
        if not any(past):
            return PlacedLabels(positions, x_range, y_range, boxes)
        pad = 4  # px, so that a label ends clear of the edge
        x_range = (x_range[0] - (past[0] and past[0] + pad) / sx, x_range[1] + (past[1] and past[1] + pad) / sx)
        y_range = (y_range[0] - (past[2] and past[2] + pad) / sy, y_range[1] + (past[3] and past[3] + pad) / sy)
    return PlacedLabels(positions, x_range, y_range, boxes)


def figure_label(figure: go.Figure) -> str:
    """A figure's title as plain text for a label above it: its heading lines, without notes or markup ("Figure" when
    untitled)."""
    heads = (figure.layout.title.text or "").split("<br><sup>")[0].split("<br>")
    return html.unescape(" ".join(re.sub(r"<[^>]+>", "", line) for line in heads)).strip() or "Figure"


def plotly_js() -> str:
    """plotly.js's source as bundled with the installed plotly (4.6 MB), for pages that must draw offline."""
    return plotly.offline.get_plotlyjs()


def figures_html(figures: Sequence[go.Figure], html_parts: Sequence[str] = ()) -> str:
    """Figures and HTML views in one page that draws offline (no CDN: in a classroom without internet, in a notebook
    saved for later): plotly.js embedded once in its head when there is a figure, then each figure and each part."""
    library = f'<script type="text/javascript">{plotly_js()}</script>' if figures else ""
    parts = [figure.to_html(full_html=False, include_plotlyjs=False) for figure in figures]
    return f'<html><head><meta charset="utf-8">{library}</head><body>' + "\n".join([*parts, *html_parts]) + "</body></html>"


def message_figure(text: str) -> go.Figure:
    """An empty figure that says why there is nothing to draw."""
    figure = go.Figure()
    figure.add_annotation(text=safe_label(text), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 14})
    figure.update_layout(height=220, xaxis={"visible": False}, yaxis={"visible": False})
    return figure
