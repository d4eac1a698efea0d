"""Figures of composition: spliced vs recomputed next-token probabilities and K/V deviation, agent episodes."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from engine.agent import AgentReport
from engine.compose import Fidelity
from engine.keystone import KeystoneReport
from engine.decision import Decision, logit_agreement
from viz.common import PALETTE, map_height, pool_columns, safe_label, token_columns


def logit_bars_figure(
    spliced: Decision, recomputed: Decision, tokenizer_decode: Callable[[int], str], k: int = 10
) -> go.Figure:
    """Next-token probabilities of the union of both top-k sets, spliced vs recomputed side by side, ordered
    by the recomputed probability; cosine and KL of the logits in the subtitle."""
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
        figure.add_bar(x=labels, y=probs[ids].numpy().astype(np.float32), name=name, marker_color=colour, customdata=ids,
                       hovertemplate=f"{name}<br>%{{x}} (id %{{customdata}})<br>P %{{y:.4f}}<extra></extra>")
    agreement = logit_agreement(a, b)
    figure.update_layout(
        title={"text": f"Next-token probabilities: spliced vs recomputed (union of top-{k})",
               "subtitle": {"text": f"logit cosine {agreement['cosine']:.6f}, KL(spliced‖recomputed) {agreement['kl']:.2e}"}},
        barmode="group", xaxis={"title": "next token", "type": "category", "tickangle": -45},
        yaxis_title="probability", height=400, legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"},
        margin={"l": 60, "r": 20, "t": 90, "b": 80},
    )
    return figure


def deviation_figure(fidelity: Fidelity, texts: Sequence[str] | None = None) -> go.Figure:
    """Layer × token relative K/V deviation of the spliced cache from the recomputed one
    ((‖ΔK‖ + ‖ΔV‖) / (‖K‖ + ‖V‖), mean over heads), token ``texts`` on the x axis when given."""
    deviation = fidelity.deviation.float().numpy()  # (layers, context tokens)
    if texts is not None and len(texts) != deviation.shape[1]:
        raise ValueError(f"got {len(texts)} token texts for {deviation.shape[1]} context tokens")
    z, runs = pool_columns(deviation)
    names, xaxis = token_columns(runs, texts)
    figure = go.Figure(
        go.Heatmap(z=z, x=names, y=np.arange(len(z)), zmin=0.0, colorscale="Viridis", colorbar={"title": "relative Δ", "exponentformat": "e"},
                   hovertemplate="layer %{y}<br>%{x}<br>relative deviation %{z:.3g}<extra></extra>")
    )
    repair = f"seam {fidelity.seam}" + (f", blend {fidelity.blend:.0%}" if fidelity.blend else "")
    figure.update_layout(
        title={"text": f"K/V deviation, spliced vs recomputed ({repair}): max {float(deviation.max()):.3g}",
               "subtitle": {"text": f"{safe_label(fidelity.scenario)}: {fidelity.skill_tokens} of {fidelity.context_tokens} context tokens spliced"}},
        xaxis={**xaxis, "title": "context token"}, yaxis_title="layer", height=map_height(len(z)),
        margin={"l": 60, "r": 20, "t": 90, "b": 100},
    )
    return figure


def agent_figure(report: AgentReport) -> go.Figure:
    """Per turn the decision margin of the cached path beside the clean-state prefill (correctness) and the
    identical-token re-prefill (cache mechanics), the state as tick labels, compactions marked; below, the
    cumulative time to first token of each path."""
    turns = report.turns
    x = [t.turn for t in turns]
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.08)
    paths = (("cached (errata)", "cached", PALETTE[0], "solid"), ("clean-state prefill", "clean", "black", "dash"),
             ("identical-token re-prefill", "identical", PALETTE[2], "dot"))
    for name, attribute, colour, dash in paths:
        decisions = [getattr(t, attribute) for t in turns]
        figure.add_scatter(
            x=x, y=[d.margin for d in decisions], name=name, mode="lines+markers", line={"color": colour, "dash": dash},
            marker={"size": 9 if attribute == "cached" else 6},
            hovertext=[f"turn {t.turn}: {safe_label(d.label)} ({d.margin:+.3f})" for t, d in zip(turns, decisions)], hoverinfo="text",
            row=1, col=1,
        )
    wrong = [t for t in turns if t.cached.label != t.clean.label]
    figure.add_scatter(x=[t.turn for t in wrong], y=[t.cached.margin for t in wrong], mode="markers", name="cached ≠ clean state",
                       marker={"color": "#d62828", "size": 14, "symbol": "x"}, row=1, col=1)
    for t in turns:
        if t.compacted:
            figure.add_vline(x=t.turn, line={"color": PALETTE[3], "dash": "dot"}, row=1, col=1)
    figure.add_hline(y=0, line={"color": "#999", "width": 1}, row=1, col=1)
    for (name, attribute, colour, dash) in paths:
        figure.add_scatter(x=x, y=np.cumsum([getattr(t, f"{attribute}_ms") for t in turns]), name=f"{name}: cumulative TTFT",
                           mode="lines", line={"color": colour, "dash": dash}, showlegend=False, row=2, col=1)
    ticks = [f"{t.turn}<br>{safe_label(t.values[t.changed] if t.changed else ' / '.join(t.values.values()), 14)}" for t in turns]
    figure.update_xaxes(tickvals=x, ticktext=ticks, row=2, col=1, title_text="turn and the new value (dotted lines: compaction)")
    figure.update_yaxes(title_text="decision margin", row=1, col=1)
    figure.update_yaxes(title_text="cumulative TTFT (ms)", row=2, col=1)
    data = report.as_dict()
    figure.update_layout(
        title={"text": f"Agent episode on {safe_label(report.scenario)}: errata on a cached context, compaction {safe_label(report.policy)}",
               "subtitle": {"text": f"agrees with the clean state on {data['clean_state_agreement']:.0%} of turns "
                                    f"(identical tokens {data['identical_tokens_agreement']:.0%}); {data['compactions']} compactions; "
                                    f"cumulative TTFT ×{data['cumulative_speedup_vs_clean_state']} vs clean prefills"
                                    + ("" if report.state_sensitive else "; the clean decision never changes: agreement says little")}},
        height=560, legend={"orientation": "h", "y": -0.18}, margin={"l": 60, "r": 30, "t": 90, "b": 90},
    )
    return figure


def keystone_figure(report: KeystoneReport) -> go.Figure:
    """Per strategy the margin on the composed (spliced) cache beside the recomputed one, with stale and oracle."""
    names = [name for name, result in report.composed.strategies.items() if result.applicable]
    figure = go.Figure()
    for label, edit in (("composed (spliced)", report.composed), ("recomputed", report.recomputed)):
        figure.add_bar(x=names, y=[edit.strategies[name].decision.margin for name in names], name=label,
                       hovertext=[safe_label(edit.strategies[name].decision.label) for name in names])
    for name, margin, dash in (("stale", report.recomputed.stale.decision.margin, "dot"), ("oracle", report.recomputed.oracle.decision.margin, "dash")):
        figure.add_hline(y=margin, line={"dash": dash, "color": "grey"}, annotation_text=name, annotation_position="right")
    skipped = [name for name in report.composed.strategies if name not in names]
    figure.update_layout(
        title=f"Keystone: editing {safe_label(report.field)} inside a spliced skill (seam {report.seam})"
        + (f"; not applicable: {', '.join(skipped)}" if skipped else ""),
        yaxis_title="decision margin", barmode="group", height=380,
    )
    return figure
