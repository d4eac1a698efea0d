"""Figures and the table of a model comparison (``ModelComparison.as_dict()``): notes share against parameter count,
with the paper's 7–9B values beside the compared models, and each model's numbers side by side."""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Mapping

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.engine.cache.decision import noise_words
from kvscope.viz.common import GREY, LEGEND_BELOW, PALETTE, markdown_literal, message_figure, parameter_count, safe_label, set_title

PAPER_COLOUR = "#264653"
PAPER_SYMBOLS = ("diamond", "square", "triangle-up", "cross")


def _short(model: str) -> str:
    return model.split(":", 1)[-1]


TICK_CHARS = 11  # a tick line under a bar of one of four panels at 1,000 px (three models: ~80 px a bar)


def _tick_name(model: str, width: int = TICK_CHARS, lines: int = 3) -> str:
    """A model's name as an upright tick label of short lines, broken after - _ / . or a space (never inside a run of
    letters unless a run is longer than a line), at most ``lines`` lines: a rotated label would run into the next panel."""
    parts = re.findall(r"[^-_/. ]*[-_/. ]?", html.unescape(safe_label(_short(model), 60)))  # escaped again per line
    rows: list[str] = []
    for part in (p for p in parts if p):
        for piece in (part[i : i + width] for i in range(0, len(part), width)):
            if rows and len(rows[-1]) + len(piece) <= width:
                rows[-1] += piece
            else:
                rows.append(piece)
    if len(rows) > lines:
        rows = rows[: lines - 1] + [rows[lines - 1][: width - 1] + "…"]
    return "<br>".join(html.escape(row, quote=False) for row in rows)


def notes_share_figure(comparison: Mapping) -> go.Figure:
    """Notes share (1 − field-only recovery) against parameter count (log axis): the compared models as circles,
    each of the paper's 7–9B models as its own dark symbol, named in the legend (labels beside markers this close
    would overlap); a model whose notes share is undefined is listed in the subtitle."""
    models = comparison.get("models") or []
    if not models:
        return message_figure("No model compared yet")
    shown = [row for row in models if row.get("notes_share") is not None]
    figure = go.Figure()
    for index, row in enumerate(shown):
        recovery = row["recoveries"].get("field_only")
        figure.add_scatter(
            x=[row["parameters"]],
            y=[row["notes_share"]],
            mode="markers",
            marker={"size": 14, "color": PALETTE[index % len(PALETTE)]},
            name=safe_label(_short(row["model"]), 40),
            hovertext=[
                f"{safe_label(row['model'], 60)}<br>{parameter_count(row['parameters'])} parameters<br>notes share {row['notes_share']:.3f}"
                + ("" if recovery is None else f" (field-only recovery {recovery:.3f})")
            ],
            hoverinfo="text",
            cliponaxis=False,
        )
    for point, symbol in zip(comparison.get("paper") or [], PAPER_SYMBOLS * 3):
        figure.add_scatter(
            x=[point["parameters"]],
            y=[point["notes_share"]],
            mode="markers",
            marker={"size": 12, "symbol": symbol, "color": PAPER_COLOUR},
            name=f"{safe_label(point['model'])} (paper)",
            hovertext=[
                f"{safe_label(point['model'])} (paper, arXiv 2606.17107)<br>field-only recovery {point['field_only_recovery']:+.3f}<br>"
                f"notes share {point['notes_share']:.3f}"
            ],
            hoverinfo="text",
            cliponaxis=False,
        )
    figure.add_hline(y=1.0, line={"color": GREY, "dash": "dot"}, annotation_text="notes carry everything", annotation_position="top left")
    figure.add_hline(
        y=0.0, line={"color": GREY, "dash": "dot"}, annotation_text="the field alone decides", annotation_position="bottom left"
    )
    undefined = [_short(row["model"]) for row in models if row.get("notes_share") is None]
    note = f" · undefined for {', '.join(safe_label(name, 40) for name in undefined)}" if undefined else ""
    figure.update_xaxes(type="log", title="parameters")
    shares = [row["notes_share"] for row in shown] + [point["notes_share"] for point in comparison.get("paper") or []]
    figure.update_yaxes(title="notes share (1 − field-only recovery)", range=[min(-0.2, *shares) - 0.05, max(1.25, *shares) + 0.1])
    figure.update_layout(height=460, legend=LEGEND_BELOW, margin={"b": 110})
    set_title(
        figure,
        "Notes share against model size",
        f"{safe_label(comparison.get('scenario', ''), 60)}: {safe_label(comparison.get('field', ''), 40)} → "
        f"{safe_label(comparison.get('new', ''), 40)}{note}",
    )
    return figure


def model_metrics_figure(comparison: Mapping) -> go.Figure:
    """Each compared model's recoveries (field_only, erratum, field_erratum), notes depth (as a share of its layers),
    read heads and splice cosine, side by side (one panel each)."""
    models = comparison.get("models") or []
    if not models:
        return message_figure("No model compared yet")
    names = [_tick_name(row["model"]) for row in models]
    # Two by two: each panel half the figure's width, so three models' upright names stay under their own bars.
    titles = ("recovery", "notes depth", "read heads", "splice cosine")
    figure = make_subplots(rows=2, cols=2, subplot_titles=titles, vertical_spacing=0.3, horizontal_spacing=0.12)
    strategies = comparison.get("strategies") or list(models[0]["recoveries"])
    for index, strategy in enumerate(strategies):
        figure.add_bar(
            x=names,
            y=[row["recoveries"].get(strategy) for row in models],
            name=safe_label(strategy),
            marker_color=PALETTE[index % len(PALETTE)],
            row=1,
            col=1,
        )
    for (row, col), key in (((1, 2), "notes_depth"), ((2, 1), "read_heads"), ((2, 2), "splice_cosine")):
        figure.add_bar(x=names, y=[model.get(key) for model in models], marker_color=GREY, showlegend=False, row=row, col=col)
    figure.update_yaxes(range=[0, 1], tickformat=".0%", row=1, col=2)  # the share of the model's layers
    figure.update_xaxes(tickangle=0)  # upright, wrapped names stay inside their own panel
    figure.update_layout(height=720, barmode="group", legend={**LEGEND_BELOW, "y": -0.16}, margin={"b": 120})
    set_title(figure, "The compared models side by side", subplot_titles=1)
    return figure


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _quantities(strategies: list[str]) -> dict[str, Callable[[Mapping], str]]:
    """The table's rows: each quantity's name and how a model's row shows it (Markdown-safe)."""
    return {
        "parameters": lambda row: parameter_count(row["parameters"]),
        "dtype": lambda row: markdown_literal(row["details"]["dtype"]),
        "decision": lambda row: markdown_literal(f"{row['details']['stale_decision']} → {row['details']['oracle_decision']}"),
        "notes share": lambda row: _cell(row["notes_share"]),
        **{name: (lambda row, name=name: _cell(row["recoveries"].get(name))) for name in strategies},
        "notes depth": lambda row: _cell(row["notes_depth"], 2),
        "read heads": lambda row: f"{_cell(row['read_heads'])} of {row['details']['heads']}",
        "splice cosine": lambda row: _cell(row["splice_cosine"], 4),
    }


def comparison_markdown(comparison: Mapping) -> str:
    """The comparison as a Markdown table, every model string escaped, with why a number is missing."""
    models = comparison.get("models") or []
    if not models:
        return "No model compared yet."
    strategies = comparison.get("strategies") or []
    head = (
        f"**{markdown_literal(comparison['scenario'])}**: {markdown_literal(comparison['field'])} "
        f"{markdown_literal(comparison['old'])} → {markdown_literal(comparison['new'])}; splice: skill "
        f"{markdown_literal(comparison['splice_skill'])} with {markdown_literal(comparison['remedy'])}"
    )
    # One column per model (at most three), one row per quantity: the table stays readable in a narrow window.
    lines = [head, "", "| model | " + " | ".join(markdown_literal(row["model"]) for row in models) + " |", "|" + "---|" * (len(models) + 1)]
    lines += [
        f"| {markdown_literal(name)} | " + " | ".join(cell(row) for row in models) + " |" for name, cell in _quantities(strategies).items()
    ]
    paper = comparison.get("paper") or []
    if paper:
        shares = ", ".join(f"{markdown_literal(p['model'])} {p['notes_share']:.3f}" for p in paper)
        lines += ["", f"The paper's notes shares at 7–9B (1 − field-only recovery): {shares}."]
    for row in models:
        words = noise_words(row["details"]["dtype"], row["details"].get("delta_margin"))
        if words:
            lines.append(f"- {markdown_literal(_short(row['model']))}: {markdown_literal(words)}")
        for number, reason in row["details"].get("missing", {}).items():
            lines.append(f"- {markdown_literal(_short(row['model']))}: {markdown_literal(number)} is missing: {markdown_literal(reason)}")
    return "\n".join(lines)


def dropped_markdown(messages: list[str]) -> str:
    """What the server's model registry dropped to make room (its own messages), as Markdown lines; empty when nothing."""
    if not messages:
        return ""
    return "\n\n" + "\n".join(f"- **Dropped to make room**: {markdown_literal(message)}" for message in messages)


def model_memory_markdown(model_bytes: Mapping[str, int], budget_bytes: int) -> str:
    """The parameter bytes of the models in memory against the registry's model budget, as one Markdown line."""
    held = ", ".join(f"{markdown_literal(spec)} {count / 1e9:.1f} GB" for spec, count in model_bytes.items()) or "none"
    return (
        f"\n\n**Model weights** {sum(model_bytes.values()) / 1e9:.1f} GB of {budget_bytes / 1e9:.1f} GB ({held}; least recently "
        "used dropped first)"
    )
