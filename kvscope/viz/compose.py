"""Figures of composition: spliced vs recomputed next-token probabilities and K/V deviation, agent episodes; and the
line that sets a splice's measured speed-up beside the remedy menu's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvscope.engine.cache.decision import Decision
from kvscope.engine.compose.agent import AgentReport
from kvscope.engine.compose.calibration import ModelRemedies
from kvscope.engine.compose.fidelity import SpliceFidelity
from kvscope.engine.compose.keystone import KeystoneReport
from kvscope.viz.common import (
    LEGEND_BELOW,
    NARROWEST_PLOT_PX,
    PALETTE,
    layer_token_map,
    markdown_literal,
    place_labels,
    safe_label,
    set_title,
)


def logit_bars_figure(
    spliced: Decision, recomputed: Decision, agreement: Mapping[str, float], tokenizer_decode: Callable[[int], str], k: int = 10
) -> go.Figure:
    """Next-token probabilities of the union of both top-k sets, spliced vs recomputed side by side, ordered
    by the recomputed probability; the comparison's stored ``agreement`` (cosine and KL of the logits) in the subtitle."""
    if k < 1:
        raise ValueError(f"k must be ≥ 1, got {k}")
    a, b = spliced.next_token_logits.float().cpu(), recomputed.next_token_logits.float().cpu()
    if a.shape != b.shape:
        raise ValueError(f"logits of different vocabularies: {tuple(a.shape)} vs {tuple(b.shape)}")
    p, q = torch.softmax(a, -1), torch.softmax(b, -1)
    ids = sorted(set(p.topk(min(k, len(p))).indices.tolist()) | set(q.topk(min(k, len(q))).indices.tolist()), key=lambda i: -float(q[i]))
    texts = [safe_label(tokenizer_decode(i), 16) for i in ids]
    labels = [text if texts.count(text) == 1 else f"{text} #{i}" for text, i in zip(texts, ids)]  # categories must be unique
    figure = go.Figure()
    for name, probs, colour in (("spliced", p, PALETTE[1]), ("recomputed", q, PALETTE[0])):
        figure.add_bar(
            x=labels,
            y=probs[ids].numpy().astype(np.float32),
            name=name,
            marker_color=colour,
            customdata=ids,
            hovertemplate=f"{name}<br>%{{x}} (id %{{customdata}})<br>P %{{y:.4f}}<extra></extra>",
        )
    figure.update_layout(
        barmode="group",
        xaxis={"title": "next token", "type": "category", "tickangle": -45},
        yaxis_title="probability",
        height=420,
        legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        margin={"l": 60, "r": 20, "b": 80},
    )
    set_title(
        figure,
        f"Next-token probabilities, union of top-{k}",
        f"logit cosine {agreement['cosine']:.6f}, KL(spliced‖recomputed) {agreement['kl']:.2e}",
        subplot_titles=1,  # room for the legend's row
    )
    return figure


def deviation_figure(fidelity: SpliceFidelity, texts: Sequence[str] | None = None) -> go.Figure:
    """Layer × token relative K/V deviation of the spliced cache from the recomputed one
    ((‖ΔK‖ + ‖ΔV‖) / (‖K‖ + ‖V‖), mean over heads), token ``texts`` on the x axis when given."""
    deviation = fidelity.deviation.float().numpy()  # (layers, context tokens)
    if texts is not None and len(texts) != deviation.shape[1]:
        raise ValueError(f"got {len(texts)} token texts for {deviation.shape[1]} context tokens")
    figure, _, _ = layer_token_map(
        deviation,
        "context token",
        texts,
        zmin=0.0,
        colorscale="Viridis",
        colorbar={"title": "relative Δ", "exponentformat": "e"},
        hovertemplate="layer %{y}<br>%{x}<br>relative deviation %{z:.3g}<extra></extra>",
    )
    repair = f"remedy {safe_label(fidelity.remedy.name)}"
    set_title(
        figure,
        "K/V deviation, spliced vs recomputed",
        f"{repair}: max {float(deviation.max()):.3g}",
        f"{safe_label(fidelity.scenario)}: {fidelity.skill_tokens} of {fidelity.context_tokens} context tokens spliced",
    )
    return figure


def agent_figure(report: AgentReport) -> go.Figure:
    """Per turn the decision margin of the cached path beside the clean-state prefill (correctness) and the
    identical-token re-prefill (cache mechanics), the state as tick labels, compactions marked; below, the
    cumulative time to first token of each path."""
    turns = report.turns
    x = [t.turn for t in turns]
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.08)
    paths = (
        ("cached (errata)", "cached", PALETTE[0], "solid"),
        ("clean-state prefill", "clean", "black", "dash"),
        ("identical-token re-prefill", "identical", PALETTE[2], "dot"),
    )
    for name, attribute, colour, dash in paths:
        decisions = [getattr(t, attribute) for t in turns]
        figure.add_scatter(
            x=x,
            y=[d.margin for d in decisions],
            name=name,
            mode="lines+markers",
            line={"color": colour, "dash": dash},
            marker={"size": 9 if attribute == "cached" else 6},
            hovertext=[f"turn {t.turn}: {safe_label(d.label)} ({d.margin:+.3f})" for t, d in zip(turns, decisions)],
            hoverinfo="text",
            row=1,
            col=1,
        )
    wrong = [t for t in turns if t.cached.label != t.clean.label]
    figure.add_scatter(
        x=[t.turn for t in wrong],
        y=[t.cached.margin for t in wrong],
        mode="markers",
        name="cached ≠ clean state",
        marker={"color": "#d62828", "size": 14, "symbol": "x"},
        row=1,
        col=1,
    )
    for t in turns:
        if t.compacted:
            figure.add_vline(x=t.turn, line={"color": PALETTE[3], "dash": "dot"}, row=1, col=1)
    figure.add_hline(y=0, line={"color": "#999", "width": 1}, row=1, col=1)
    for name, attribute, colour, dash in paths:
        figure.add_scatter(
            x=x,
            y=np.cumsum([getattr(t, f"{attribute}_ms") for t in turns]),
            name=f"{name}: cumulative TTFT",
            mode="lines",
            line={"color": colour, "dash": dash},
            showlegend=False,
            row=2,
            col=1,
        )
    ticks = [f"{t.turn}<br>{safe_label(t.values[t.changed] if t.changed else ' / '.join(t.values.values()), 14)}" for t in turns]
    figure.update_xaxes(tickvals=x, ticktext=ticks, row=2, col=1, title_text="turn and the new value (dotted lines: compaction)")
    figure.update_yaxes(title_text="decision margin", row=1, col=1)
    figure.update_yaxes(title_text="cumulative TTFT (ms)", row=2, col=1)
    data = report.as_dict()
    figure.update_layout(height=600, legend=LEGEND_BELOW, margin={"l": 60, "r": 30, "b": 130})
    set_title(
        figure,
        f"Agent episode on {safe_label(report.scenario)}: errata on a cached context, compaction {safe_label(report.policy)}",
        f"agrees with the clean state on {data['clean_state_agreement']:.0%} of turns "
        f"(identical tokens {data['identical_tokens_agreement']:.0%}); {data['compactions']} compactions; "
        f"cumulative TTFT ×{data['cumulative_speedup_vs_clean_state']} vs clean prefills"
        + ("" if report.state_sensitive else "; the clean decision never changes: agreement says little"),
    )
    return figure


def keystone_figure(report: KeystoneReport, band: float = 0.15) -> go.Figure:
    """The paper's diagonal: each applicable strategy's recovery on the composed (spliced) cache against the same
    strategy on the recomputed cache; points on the diagonal mean composing changes nothing, the band is ±``band``.
    Each point's name sits where it covers no other name or point, inside the plot area at the app's narrowest width."""
    gaps = report.recovery_gaps()
    names = [name for name, gap in gaps.items() if gap is not None]
    x = [report.recomputed.strategies[name].recovery.value for name in names]
    y = [report.composed.strategies[name].recovery.value for name in names]
    low, high = min([0.0, *x, *y]) - 0.1, max([1.0, *x, *y]) + 0.1
    skipped = [name for name in gaps if name not in names]
    stale = report.composed.stale.decision.margin, report.recomputed.stale.decision.margin
    figure = go.Figure()
    margin = {"l": 60, "r": 20, "b": 110}
    figure.update_layout(height=500, margin=margin, legend=LEGEND_BELOW)
    set_title(
        figure,
        f"Keystone: editing {safe_label(report.field)} inside a spliced skill (remedy {safe_label(report.remedy.name)})",
        f"oracle − stale margin {report.delta_margin:+.2f}; stale margin composed {stale[0]:+.2f} vs recomputed {stale[1]:+.2f}"
        + (f"; no recovery for: {', '.join(safe_label(n) for n in skipped)}" if skipped else ""),
    )
    texts = [safe_label(name) for name in names]
    # the plot area at the narrowest width (plotly's automargin takes a few px more below for the legend)
    plot_px = NARROWEST_PLOT_PX - margin["l"] - margin["r"], figure.layout.height - figure.layout.margin.t - margin["b"] - 8
    labels = place_labels(x, y, texts, (low, high), (low, high), plot_px, marker_px=12)
    # the band and the diagonal span both axes' ranges (grown to hold the labels)
    start, end = min(labels.x_range[0], labels.y_range[0]), max(labels.x_range[1], labels.y_range[1])
    figure.add_scatter(
        x=[start, end, end, start],
        y=[start + band, end + band, end - band, start - band],
        fill="toself",
        mode="lines",
        line={"width": 0},
        fillcolor="rgba(120,120,120,0.15)",
        name=f"within ±{band}",
        hoverinfo="skip",
    )
    figure.add_scatter(x=[start, end], y=[start, end], mode="lines", line={"dash": "dash", "color": "grey"}, name="composed = recomputed")
    figure.add_scatter(
        x=x,
        y=y,
        mode="markers+text",
        text=texts,
        textposition=labels.positions,
        name="strategies",
        marker={"size": 12, "color": [PALETTE[0] if abs(gaps[name]) <= band else "#d62828" for name in names]},
        hovertext=[f"{safe_label(name)}: recomputed {a:.3f}, composed {b:.3f} (gap {b - a:+.3f})" for name, a, b in zip(names, x, y)],
        hoverinfo="text",
    )
    figure.update_layout(
        xaxis={"title": "recovery on the recomputed cache", "range": list(labels.x_range)},
        yaxis={"title": "recovery on the composed cache", "range": list(labels.y_range)},
    )
    return figure


def study_figure(study: dict) -> go.Figure:
    """From a composition study's JSON: left, each remedy's decision agreement on decisive cases against the
    fraction of skill tokens it recomputes (hollow markers rank against the full recompute: diagnostics); right,
    its mean |margin error| by number of skills."""
    summary = study["summary"]
    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.12,
        subplot_titles=("agreement on decisive cases vs recompute", "mean |margin error| by skills"),
    )
    colours = _remedy_colours(len(summary))
    for index, (name, row) in enumerate(summary.items()):
        colour = colours[index % len(colours)]
        speed = row["speedup"]["median"] if row["speedup"] else float("nan")
        figure.add_scatter(
            x=[100 * row["recomputed_fraction"]],
            y=[row["agreement"]],
            mode="markers",
            name=safe_label(name),
            legendgroup=name,
            marker={
                "size": 13,
                "color": colour,
                "symbol": "circle-open" if row["needs_reference"] else "circle",
                "line": {"width": 2, "color": colour},
            },
            hovertext=[
                f"{safe_label(name)}: {row['agree_decisive']}/{row['decisive']} decisive cases agree, {row['ties']} ties; "
                f"median cosine {row['cosine']['median']:.4f}; TTFT ×{speed:.2f} (median)"
            ],
            hoverinfo="text",
            row=1,
            col=1,
        )
        sizes = sorted(row["by_n"], key=int)
        figure.add_scatter(
            x=[int(n) for n in sizes],
            y=[row["by_n"][n]["mean_abs_margin_error"] for n in sizes],
            mode="lines+markers",
            name=safe_label(name),
            legendgroup=name,
            showlegend=False,
            line={"color": colour},
            row=1,
            col=2,
        )
    best = study.get("best")
    figure.update_xaxes(title_text="skill tokens recomputed (%, mean)", row=1, col=1)
    agreements = [row["agreement"] for row in summary.values() if row["agreement"] is not None]
    figure.update_yaxes(title_text="decisive agreement", range=[max(0.0, min(agreements, default=0.0) - 0.1), 1.02], row=1, col=1)
    figure.update_xaxes(title_text="skills in the context (N)", dtick=1, row=1, col=2)
    figure.update_yaxes(title_text="|spliced − recomputed margin|", rangemode="tozero", row=1, col=2)
    cases = len(study["cases"])
    figure.update_layout(height=500, legend=LEGEND_BELOW, margin={"l": 60, "r": 20, "b": 120})
    set_title(
        figure,
        "Many skills at once: which repair keeps the decision",
        f"{cases} composed prompts; hollow markers rank tokens against the full recompute (not deployable); "
        + (f"best deployable: {safe_label(best)}" if best else "no deployable remedy agrees on every decisive case"),
        subplot_titles=1,
    )
    return figure


def _remedy_colours(count: int) -> Sequence[str]:
    """A colour per remedy: the palette, or plotly's 24 where there are more remedies than it holds."""
    return PALETTE if count <= len(PALETTE) else plotly.colors.qualitative.Dark24


def _goal_corner(figure: go.Figure, choice: dict, speeds: Sequence[float], column: int) -> None:
    """Shade the study's goal (≥ its agreement at ≥ its share of splice's speedup) in panel ``column``, out past ``speeds``."""
    goal, splice_speed = choice.get("goal", {}), choice.get("splice_speedup")
    if goal and splice_speed:
        figure.add_shape(
            type="rect",
            x0=goal["speed_share_of_splice"] * splice_speed,
            x1=max([*speeds, splice_speed]) * 1.08,
            y0=goal["agreement"],
            y1=1.02,
            fillcolor="rgba(44,160,44,0.12)",
            line={"width": 0},
            row=1,
            col=column,
        )


def remedy_choice_figure(study: dict) -> go.Figure:
    """From a stored composition study with its ``choice``: left, each remedy's decisive agreement against its median
    TTFT speedup, the goal's corner shaded (≥ 97% agreement, ≥ 70% of splice's speedup) and the default starred; right,
    the median speedup by total skill tokens (a long study) or the agreement by number of skills (a short one)."""
    summary, choice = study["summary"], study.get("choice") or {}
    long_study = any("by_length" in row for row in summary.values())
    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.55, 0.45],
        horizontal_spacing=0.12,
        subplot_titles=(
            "decisive agreement vs TTFT speedup",
            "median TTFT speedup by skill tokens" if long_study else "decisive agreement by skills",
        ),
    )
    goal = choice.get("goal", {})
    _goal_corner(figure, choice, [row["speedup"]["median"] for row in summary.values() if row["speedup"]], 1)
    colours = _remedy_colours(len(summary))
    default = study.get("default")
    for index, (name, row) in enumerate(summary.items()):
        if not row["speedup"]:
            continue
        colour = colours[index % len(colours)]
        label = safe_label(name) + (" (default)" if name == default else "")
        figure.add_scatter(
            x=[row["speedup"]["median"]],
            y=[row["agreement"]],
            mode="markers",
            name=label,
            legendgroup=name,
            marker={
                "size": 18 if name == default else 12,
                "color": colour,
                "symbol": "star" if name == default else ("circle-open" if row["needs_reference"] else "circle"),
                "line": {"width": 2, "color": colour},
            },
            hovertext=[
                f"{label}: {row['agree_decisive']}/{row['decisive']} decisive agree, {row['ties']} ties; TTFT ×"
                f"{row['speedup']['min']:.2f}/{row['speedup']['median']:.2f}/{row['speedup']['max']:.2f} (min/median/max); "
                f"{row['recomputed_fraction']:.0%} of skill tokens recomputed"
            ],
            hoverinfo="text",
            row=1,
            col=1,
        )
        groups = row["by_length"] if long_study else row["by_n"]
        keys = sorted(groups, key=int)
        values = [(groups[key]["speedup"] or {}).get("median") if long_study else groups[key]["agreement"] for key in keys]
        figure.add_scatter(
            x=[int(key) for key in keys],
            y=values,
            mode="lines+markers",
            name=label,
            legendgroup=name,
            showlegend=False,
            line={"color": colour, "width": 3 if name == default else 1.5},
            row=1,
            col=2,
        )
    agreements = [row["agreement"] for row in summary.values() if row["agreement"] is not None]
    floor = max(0.0, min(agreements + [goal.get("agreement", 1.0)], default=0.0) - 0.05)
    figure.update_xaxes(title_text="TTFT speedup over a full recompute (median)", row=1, col=1)
    figure.update_yaxes(title_text="decisive agreement", range=[floor, 1.02], row=1, col=1)
    if long_study:
        ticks = sorted(int(length) for row in summary.values() for length in row.get("by_length", {}))
        figure.update_xaxes(
            title_text="skill tokens in the context", type="log", tickvals=ticks, ticktext=[f"{tick:,}" for tick in ticks], row=1, col=2
        )
        figure.update_yaxes(title_text="TTFT speedup (median)", rangemode="tozero", row=1, col=2)
    else:
        figure.update_xaxes(title_text="skills in the context (N)", dtick=1, row=1, col=2)
        per_n = [group["agreement"] for row in summary.values() for group in row["by_n"].values() if group["agreement"] is not None]
        figure.update_yaxes(title_text="decisive agreement", range=[max(0.0, min(per_n + [floor]) - 0.05), 1.02], row=1, col=2)
    verdict = (
        ("goal met" if choice.get("goal_met") else "goal not reached: best measured trade-off") + f"; default {safe_label(default)}"
        if default
        else "no default chosen in this file"
    )
    lengths = study.get("lengths") or []
    kind = f"long compositions ({min(lengths)}–{max(lengths)} skill tokens)" if long_study and lengths else "the short N-skill study"
    figure.update_layout(height=500, legend=LEGEND_BELOW, margin={"l": 60, "r": 20, "b": 120})
    measured = ", ".join(safe_label(str(study[key])) for key in ("model", "dtype") if study.get(key))
    set_title(
        figure,
        f"Default remedy on {safe_label(str(study.get('model', '?')).split(':')[0])}: {kind}, {len(summary)} remedies",
        f"measured on {measured}" if measured else "",
        f"{len(study['cases'])} composed prompts; shaded: ≥ 97% decisive agreement at ≥ 70% of splice's speedup; {verdict}",
        subplot_titles=1,
    )
    return figure


def frontiers_figure(studies: Sequence[dict]) -> go.Figure:
    """From stored N-skill studies with their ``choice`` (one per model), side by side: each deployable remedy's decisive
    agreement against its median TTFT speedup, the frontier (no other remedy both faster and more faithful) joined, the
    goal's corner shaded (≥ 97% agreement at ≥ 70% of that model's splice speedup) and the default starred. A remedy keeps
    its colour in every panel."""
    if not studies:
        raise ValueError("frontiers_figure needs at least one stored study")
    titles = [
        f"{safe_label(str(study.get('model', '?')).split(':')[-1])} ({safe_label(str(study.get('dtype', '?')))})" for study in studies
    ]
    figure = make_subplots(rows=1, cols=len(studies), subplot_titles=titles, horizontal_spacing=0.08)
    names = list(dict.fromkeys(name for study in studies for name, row in study["summary"].items() if not row["needs_reference"]))
    colours = _remedy_colours(len(names))
    colour_of = {name: colours[index % len(colours)] for index, name in enumerate(names)}
    for column, study in enumerate(studies, 1):
        choice, default = study.get("choice") or {}, study.get("default")
        points = {
            name: (row["speedup"]["median"], row["agreement"])
            for name, row in study["summary"].items()
            if not row["needs_reference"] and row["speedup"] and row["agreement"] is not None
        }
        _goal_corner(figure, choice, [speed for speed, _ in points.values()], column)
        frontier = sorted((point for name, point in points.items() if name in set(choice.get("frontier", []))), key=lambda point: point[0])
        if frontier:
            figure.add_scatter(
                x=[speed for speed, _ in frontier],
                y=[agreement for _, agreement in frontier],
                mode="lines",
                line={"color": "#888", "dash": "dot"},
                showlegend=False,
                hoverinfo="skip",
                row=1,
                col=column,
            )
        bar = choice.get("goal", {}).get("keystone_max_gap")
        gaps = {point["name"]: point.get("keystone_gap") for point in choice.get("points", [])}
        for name, (speed, agreement) in points.items():
            row = study["summary"][name]
            outside = bar is not None and gaps.get(name) is not None and gaps[name] > bar  # fails the keystone: drawn open
            symbol = ("star" if name == default else "circle") + ("-open" if outside else "")
            gap = f"; keystone gap {gaps[name]:.2f}" if gaps.get(name) is not None else ""
            figure.add_scatter(
                x=[speed],
                y=[agreement],
                mode="markers",
                name=safe_label(name),
                legendgroup=name,
                showlegend=False,
                marker={"size": 18 if name == default else 11, "color": colour_of[name], "symbol": symbol, "line": {"width": 2}},
                hovertext=[
                    f"{safe_label(name)}{' (default)' if name == default else ''}: {row['agree_decisive']}/{row['decisive']} decisive "
                    f"agree, {row['ties']} ties; TTFT ×{speed:.2f} (median); {row['recomputed_fraction']:.0%} of skill tokens "
                    f"recomputed{gap}"
                ],
                hoverinfo="text",
                row=1,
                col=column,
            )
        figure.update_xaxes(title_text="TTFT speedup over a full recompute (median)", row=1, col=column)
    for name in names:  # the legend: each remedy as a plain dot (the panels star the default and open a keystone failure)
        figure.add_scatter(
            x=[None], y=[None], mode="markers", name=safe_label(name), legendgroup=name, marker={"size": 11, "color": colour_of[name]}
        )
    agreements = [row["agreement"] for study in studies for row in study["summary"].values() if row["agreement"] is not None]
    figure.update_yaxes(range=[max(0.0, min(agreements + [0.97]) - 0.05), 1.02])
    figure.update_yaxes(title_text="decisive agreement", row=1, col=1)
    verdicts = []
    for title, study in zip(titles, studies):
        met = "goal met" if (study.get("choice") or {}).get("goal_met") else "goal not reached"
        verdicts.append(f"{title}: {met}, default {safe_label(str(study.get('default')))}")
    figure.update_layout(height=600, legend=LEGEND_BELOW, margin={"l": 60, "r": 20, "b": 160})
    set_title(
        figure,
        "Composition remedies per model: agreement vs speed",
        "short N-skill study; star: the default the rule picks; dotted: the frontier; "
        "shaded: ≥ 97% decisive agreement at ≥ 70% of splice's speedup; open: fails the keystone bar (an edit inside a spliced "
        "skill recovers unlike in a recompute)",
        "; ".join(verdicts),
        subplot_titles=1,
    )
    return figure


def speed_markdown(menu: ModelRemedies, fidelity: SpliceFidelity) -> str:
    """A splice's measured speed-up beside the remedy menu's (Markdown): the context lengths the menu's number was
    measured on, what the stored study's points predict at this context's length (:meth:`ModelRemedies.predicted`), and
    what this run measured."""
    name, tokens = fidelity.remedy.name, fidelity.context_tokens
    measured = f"this run measured ×{fidelity.speedup:.2f} on {tokens:,} context tokens"
    where, predicted = menu.measured_at(name), menu.predicted(name, tokens)
    if where is None or predicted is None:
        return f"**Speed-up of {markdown_literal(name)}:** {measured}; no stored study of {markdown_literal(menu.model)} measured it."
    return (
        f"**Speed-up of {markdown_literal(name)}:** the menu's number was measured on {where} ({markdown_literal(menu.source or '')}); "
        f"{markdown_literal(predicted)}; {measured}."
    )


def selection_markdown(selection: Mapping) -> str:
    """The selection a result was computed for (the handler's ``selection``), as the line above its numbers (Markdown)."""
    skills = ", ".join(selection["skills"]) or "none dragged in"
    scenario = selection["scenario"] or "none (a generic yes/no question)"
    return (
        f"**Computed for** skills {markdown_literal(skills)} · scenario {markdown_literal(scenario)} · "
        f"remedy {markdown_literal(selection['remedy'] or 'the default')} · model {markdown_literal(selection['model'])}"
    )
