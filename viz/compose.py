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
    """Per turn the logit cosine of the cached path vs re-prefilling (markers: decisions, red where they
    differ), and the cumulative time to first token of both paths on a second axis."""
    turns = report.turns
    x = [t.turn for t in turns]
    agree = [t.cached.label == t.full.label for t in turns]
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_scatter(
        x=x, y=[t.agreement["cosine"] for t in turns], name="logit cosine", mode="lines+markers+text",
        text=[safe_label(t.cached.label, 12) for t in turns], textposition="top center",
        marker={"size": 10, "color": [PALETTE[0] if ok else "#d62828" for ok in agree]}, line={"color": PALETTE[2]},
        hovertext=[
            f"turn {t.turn}: {safe_label(report.field)} = {safe_label(t.value, 40)}<br>cached {safe_label(t.cached.label)} "
            f"({t.cached.margin:+.3f}), full {safe_label(t.full.label)} ({t.full.margin:+.3f})"
            + (f"<br>expected {safe_label(t.expected)}" if t.expected else "")
            for t in turns
        ],
        hoverinfo="text",
    )
    for name, times, colour in (("cached", [t.cached_ms for t in turns], PALETTE[0]), ("full re-prefill", [t.full_ms for t in turns], PALETTE[1])):
        figure.add_scatter(x=x, y=np.cumsum(times), name=f"cumulative TTFT, {name}", mode="lines",
                           line={"color": colour, "dash": "dash"}, secondary_y=True)
    figure.update_xaxes(title_text="turn (0 = composed context)", dtick=1)
    figure.update_yaxes(title_text="logit cosine (cached vs full)", secondary_y=False)
    figure.update_yaxes(title_text="cumulative TTFT (ms)", secondary_y=True)
    figure.update_layout(
        title={"text": f"Agent episode: errata on a cached context vs re-prefilling ({safe_label(report.scenario)})",
               "subtitle": {"text": f"field {safe_label(report.field)}, seam {report.seam}; "
                                    f"decisions agree on {sum(agree)}/{len(turns)} turns"}},
        height=420, legend={"orientation": "h", "y": -0.2}, margin={"l": 60, "r": 60, "t": 90, "b": 60},
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
