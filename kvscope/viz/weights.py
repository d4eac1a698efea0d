"""Weight editing beside the erratum: the three methods side by side, and the trade-off in words."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.engine.edit.weight_edit import MethodOutcome, WeightEditReport
from kvscope.viz.common import LEGEND_BELOW, PALETTE, safe_label, set_title

# The paper's figures (Llama-3.1-8B), shown beside ours.
PAPER = (
    "Paper (Llama-3.1-8B): ROME 5.6 s/edit (+11.6 s covariance once), LoRA 3.1 s, both contamination 1.0 and "
    "collateral 0.5; field+erratum 114 ms, contamination 0."
)


def _efficacy(outcome: MethodOutcome) -> float:
    return outcome.efficacy if outcome.efficacy is not None else 0.0


def weight_edit_figure(report: WeightEditReport) -> go.Figure:
    """Left: efficacy, contamination and collateral per method; right: edit time (one-time setup stacked)."""
    methods = list(report.methods)
    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.12,
        subplot_titles=("what the edit does", "what it costs (ms, log)"),
    )
    measures = (
        ("efficacy (recovery)", _efficacy),
        ("contamination (other customers flipped)", lambda o: o.contamination),
        ("collateral (unrelated decisions moved)", lambda o: o.collateral),
    )
    for index, (name, value) in enumerate(measures):
        values = [value(report.methods[m]) for m in methods]
        figure.add_bar(
            name=name,
            x=methods,
            y=values,
            marker_color=PALETTE[index],
            text=[f"{v:.2f}" for v in values],
            textposition="outside",
            legendgroup="effect",
            row=1,
            col=1,
        )
    edit = [max(report.methods[m].edit_ms, 0.1) for m in methods]
    setup = [report.methods[m].setup_ms for m in methods]
    figure.add_bar(
        name="edit",
        x=methods,
        y=edit,
        marker_color=PALETTE[3],
        text=[f"{v:,.0f}" for v in edit],
        textposition="inside",
        offsetgroup="cost",
        row=1,
        col=2,
    )
    figure.add_trace(
        go.Bar(name="one-time setup (stacked)", x=methods, y=setup, base=edit, marker_color=PALETTE[4], offsetgroup="cost"), row=1, col=2
    )
    figure.update_layout(barmode="group", legend=LEGEND_BELOW, height=480, margin={"b": 110}, uniformtext={"minsize": 9, "mode": "hide"})
    set_title(
        figure,
        safe_label(f"Weight editing vs the erratum: {report.field} {report.old} → {report.new}", 120),
        safe_label(f"{report.scenario} on {report.model}", 120),
        subplot_titles=1,
    )
    highest = max([1.0, *(value(report.methods[m]) for _, value in measures for m in methods)])
    figure.update_yaxes(title_text="fraction (efficacy: recovery, 1 = clean prefill)", range=[0, highest * 1.15], row=1, col=1)
    figure.update_yaxes(type="log", title_text="ms", row=1, col=2)
    return figure


def _line(method: str, outcome: MethodOutcome, variants: int, others: int) -> str:
    efficacy = "undefined" if outcome.efficacy is None else f"{outcome.efficacy:.2f}"
    setup = f" (+{outcome.setup_ms / 1000:.1f} s once)" if outcome.setup_ms else ""
    return (
        f"- **{method}**: recovery {efficacy} (decision {outcome.decision}); "
        f"{round(outcome.contamination * variants)}/{variants} other customers now get the new decision; "
        f"{round(outcome.collateral * others)}/{others} unrelated decisions changed (mean |Δmargin| "
        f"{outcome.collateral_mean_abs_delta:.2f}); "
        f"{outcome.edit_ms / 1000:.2f} s per edit{setup}; {outcome.memory_bytes / 2**20:.2f} MiB"
    )


def trade_off_markdown(report: WeightEditReport) -> str:
    """The trade-off stated from the numbers, with the paper's beside it (Markdown; labels escaped)."""
    variants, others = len(report.probes["variants"]), len(report.probes["others"])
    lines = [
        f"Stale decision **{safe_label(report.stale['decision'])}** ({report.stale['margin']:+.2f}), "
        f"clean prefill with the new value **{safe_label(report.oracle['decision'])}** ({report.oracle['margin']:+.2f}).",
        *[_line(safe_label(method), outcome, variants, others) for method, outcome in report.methods.items()],
    ]
    weight_methods = [m for m in report.methods if m != "field_erratum"]
    if "field_erratum" in report.methods and weight_methods:
        erratum = report.methods["field_erratum"]
        leaks = [m for m in weight_methods if report.methods[m].contamination > 0 or report.methods[m].collateral > 0]
        lines.append(
            f"\nThe erratum lives in this request's cache only (contamination {erratum.contamination:.0%}, collateral "
            f"{erratum.collateral:.0%}); "
            + (
                f"the weights edited by {', '.join(leaks)} also changed other requests' decisions: deployed, a weight "
                "edit reaches every request."
                if leaks
                else "on this edit the weight methods did not change other requests' decisions either."
            )
        )
    lines.append(f"\n{PAPER}")
    return "\n".join(lines)
