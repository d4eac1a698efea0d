"""Figures of benchmark results (the JSON rows the scripts under benchmarks/ write)."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvscope.engine.words import counted
from kvscope.viz.audit import KL_FLOOR, repair_colours, reused_fraction, within_symbols
from kvscope.viz.common import LEGEND_BELOW, PALETTE, apart_marker, parameter_count, safe_label, set_title, whiskers


def ttft_figure(data: dict) -> go.Figure:
    """Full-prefill vs splice TTFT by skill length (log axes) with the speedup on a second axis; from ``ttft-*.json``
    (``rows`` of ``skill_tokens``, ``full_ms``, ``splice_ms``, ``speedup``; the ``scenario`` after the skill, where named)."""
    rows = data["rows"]
    lengths = [row["skill_tokens"] for row in rows]
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_scatter(x=lengths, y=[row["full_ms"] for row in rows], name="full prefill", mode="lines+markers")
    figure.add_scatter(x=lengths, y=[row["splice_ms"] for row in rows], name="splice + seam", mode="lines+markers")
    figure.add_bar(x=lengths, y=[row["speedup"] for row in rows], name="speedup ×", opacity=0.3, secondary_y=True)
    figure.update_xaxes(type="log", title="skill tokens")
    figure.update_yaxes(type="log", title="TTFT (ms)", secondary_y=False)
    figure.update_yaxes(title="speedup (full / splice)", secondary_y=True)
    scenario = str(data.get("scenario") or "")
    before = "" if not scenario else " before a question alone" if scenario.startswith("skills:") else f" before {safe_label(scenario)}"
    figure.update_layout(height=400, legend=LEGEND_BELOW)
    set_title(figure, f"Time to first token: a skill spliced vs a full prefill{before}", _measured_on(data))
    return figure


def _measured_on(data: dict) -> str:
    """The title note "measured on model, device" from a result file's environment keys ("" when absent)."""
    parts = [safe_label(str(data[key])) for key in ("model", "device") if data.get(key)]
    return f"measured on {', '.join(parts)}" if parts else ""


def edit_latency_figure(data: dict) -> go.Figure:
    """Each edit strategy's latency vs context length (log axes), the full recompute (oracle) dashed; from
    ``edit-*.json``: ``rows`` of ``context_tokens`` and ``ms`` {strategy: ms or None when not applicable}."""
    rows = sorted(data["rows"], key=lambda row: row["context_tokens"])
    lengths = [row["context_tokens"] for row in rows]
    names = list(dict.fromkeys(name for row in rows for name in row["ms"]))
    figure = go.Figure()
    for index, name in enumerate(names):
        full = name == "oracle"
        figure.add_scatter(
            x=lengths,
            y=[row["ms"].get(name) for row in rows],
            mode="lines+markers",
            name="full recompute (oracle)" if full else safe_label(name),
            line={"color": "black", "dash": "dash"} if full else {"color": PALETTE[index % len(PALETTE)]},
        )
    figure.update_xaxes(type="log", title="context tokens")
    figure.update_yaxes(type="log", title="latency (ms)")
    figure.update_layout(height=420, legend=LEGEND_BELOW)
    set_title(figure, "Edit strategies: latency vs context length", _measured_on(data))
    return figure


def prefill_figure(data: dict) -> go.Figure:
    """Prefill time and decision-read time on the cached context vs context length (log axes), their ratio
    on a second axis; from ``prefill-*.json``: ``rows`` of ``tokens``, ``prefill_ms``, ``read_ms``."""
    rows = sorted(data["rows"], key=lambda row: row["tokens"])
    tokens = [row["tokens"] for row in rows]
    figure = make_subplots(specs=[[{"secondary_y": True}]])
    figure.add_scatter(x=tokens, y=[row["prefill_ms"] for row in rows], name="prefill", mode="lines+markers")
    figure.add_scatter(x=tokens, y=[row["read_ms"] for row in rows], name="decision read (cached)", mode="lines+markers")
    figure.add_bar(x=tokens, y=[row["prefill_ms"] / row["read_ms"] for row in rows], name="prefill / read ×", opacity=0.3, secondary_y=True)
    figure.update_xaxes(type="log", title="context tokens")
    figure.update_yaxes(type="log", title="time (ms)", secondary_y=False)
    figure.update_yaxes(title="prefill / read", secondary_y=True)
    figure.update_layout(height=400, legend=LEGEND_BELOW)
    set_title(figure, "Prefill vs reading a decision from the cache", _measured_on(data))
    return figure


def serving_figure(data: dict) -> go.Figure:
    """A serving benchmark (``serving-<engine>.json``) per variant vs offered load: TTFT p50 and p90, throughput,
    prefix-cache hit rate and accuracy against the clean-prefill answer (empty for older results without it)."""
    figure = make_subplots(
        rows=1,
        cols=4,
        horizontal_spacing=0.1,
        subplot_titles=("time to first token", "throughput", "prefix-cache hits", "accuracy"),
    )
    variants = list(dict.fromkeys(run["variant"] for run in data["runs"]))
    for index, variant in enumerate(variants):
        runs = sorted((run for run in data["runs"] if run["variant"] == variant), key=lambda run: run["offered_rps"])
        load, colour, name = [run["offered_rps"] for run in runs], PALETTE[index % len(PALETTE)], safe_label(variant)
        counts = [run.get("completed") for run in runs]
        hover = "%{x} req/s: %{y} (n=%{customdata})<extra>%{fullData.name}</extra>"
        for key, quantile, dash in (("ttft_p50_ms", "p50", "solid"), ("ttft_p90_ms", "p90", "dash")):
            figure.add_scatter(
                x=load,
                y=[run[key] for run in runs],
                name=f"{name} TTFT {quantile}",
                legendgroup=variant,
                customdata=counts,
                hovertemplate=hover,
                mode="lines+markers",
                line={"color": colour, "dash": dash},
                row=1,
                col=1,
            )
        for column, key, label in ((2, "throughput_rps", "throughput"), (3, "prefix_hit_rate", "hit rate"), (4, "accuracy", "accuracy")):
            figure.add_scatter(
                x=load,
                y=[run.get(key) for run in runs],
                name=f"{name} {label}",
                legendgroup=variant,
                customdata=counts,
                hovertemplate=hover,
                showlegend=False,
                mode="lines+markers",
                line={"color": colour, "dash": ("solid", "dot", "dash")[index % 3]},
                marker=apart_marker(index),
                row=1,
                col=column,
            )  # markers and dashes keep equal lines (e.g. both accuracies 1.0) apart
    loads = sorted({run["offered_rps"] for run in data["runs"]})
    figure.update_xaxes(title_text="offered load (req/s)", type="log", tickvals=loads, ticktext=[f"{load:g}" for load in loads])
    figure.update_yaxes(title_text="TTFT (ms)", type="log", row=1, col=1)
    figure.update_yaxes(title_text="completed requests/s", rangemode="tozero", row=1, col=2)
    figure.update_yaxes(title_text="hit rate", range=[0, 1.05], row=1, col=3)
    figure.update_yaxes(title_text="answers = clean prefill's", range=[0, 1.05], row=1, col=4)
    block = (data.get("engine_settings") or {}).get("block_size")
    settings = [f"block {block}"] if block else []
    settings += [f"{data['policy_tokens']:,} tokens"] if data.get("policy_tokens") else []  # the shared prefix: tells runs apart
    engine = f" on {safe_label(str(data['engine']))}" if data.get("engine") else ""
    engine += f" ({', '.join(settings)})" if settings else ""
    completed = sorted({run["completed"] for run in data["runs"] if run.get("completed") is not None})
    workload = [safe_label(str(data["scenario"]))] if data.get("scenario") else []
    if completed:
        low, high = completed[0], completed[-1]
        workload.append(
            f"{low}–{counted(high, 'completed request')} per point" if high != low else f"{counted(low, 'completed request')} per point"
        )
    compared = " vs ".join(safe_label(variant) for variant in variants)
    figure.update_layout(height=450, legend=LEGEND_BELOW)
    set_title(figure, f"Serving: {compared}{engine}", ", ".join(workload), subplot_titles=1)
    return figure


def serving_engines_figure(results: dict[str, dict]) -> go.Figure:
    """The edit workload's serving results side by side (``serving-<engine>[-<tag>].json``, one bar group each): the
    erratum's and the in-prefix edit's prefix-cache hit rates, and the in-prefix / erratum p90 TTFT ratio at each
    result's highest load, with the handbook's length in its name (a ratio grows with the prompt's length). The two
    panels are stacked, so each result's name reads level and each bar's label at full size at 1,000 px."""
    edits = {stem: data for stem, data in results.items() if "p90_ttft_ratio_in_prefix_over_erratum" in data.get("summary", {})}
    names = [_serving_name(stem, data) for stem, data in edits.items()]
    titles = ("prefix-cache hits", "p90 TTFT, in-prefix / erratum, at each result's highest load")
    figure = make_subplots(rows=2, cols=1, vertical_spacing=0.2, subplot_titles=titles)
    for index, variant in enumerate(("erratum", "in_prefix")):
        hits = [data["summary"].get(f"{variant}_prefix_hit_rate") for data in edits.values()]
        figure.add_bar(x=names, y=hits, name=safe_label(variant), marker_color=PALETTE[index], row=1, col=1)
    ratios = [data["summary"].get("p90_ttft_ratio_in_prefix_over_erratum") for data in edits.values()]
    loads = [data["summary"].get("offered_rps") for data in edits.values()]
    figure.add_bar(
        x=names,
        y=ratios,
        name="p90 ratio at the highest load",
        marker_color=PALETTE[2],
        text=[f"×{ratio:g} at {load:g} req/s" if ratio else "" for ratio, load in zip(ratios, loads, strict=True)],
        textposition="outside",
        textfont={"size": 12},
        constraintext="none",  # plotly shrinks a label to its bar's width (to 5 px tall at 1,000 px): kept at its size
        cliponaxis=False,
        row=2,
        col=1,
    )
    figure.update_xaxes(tickangle=0)  # the names wrap on <br>, level (rotated, they ran into each other)
    figure.update_yaxes(title_text="hit rate", range=[0, 1.05], row=1, col=1)
    top = max((ratio for ratio in ratios if ratio), default=1)
    figure.update_yaxes(title_text="×", range=[0, top * 1.15], row=2, col=1)  # bars from zero, room for their labels
    figure.update_layout(height=760, barmode="group", legend=LEGEND_BELOW | {"y": -0.12})
    set_title(
        figure,
        "Serving engines side by side: erratum vs in-prefix edit",
        "paper (vLLM, GPU): 98.5% vs 1.0% hits, p90 ×53–398",
        subplot_titles=1,
    )
    return figure


def _serving_name(stem: str, data: dict) -> str:
    """A serving result's bar label: its engine and tag, block size where stated, and handbook length."""
    block = (data.get("engine_settings") or {}).get("block_size")
    details = [f"block {block}"] if block else []
    details += [f"{data['policy_tokens']:,} tok"] if data.get("policy_tokens") else []
    return "<br>".join([safe_label(stem.removeprefix("serving-")), *([" · ".join(details)] if details else [])])


def soak_figure(data: dict) -> go.Figure:
    """A soak run (``soak-*.json``): server RSS over sessions served, and normal edit latency percentiles while
    the worst-case request ran and otherwise."""
    figure = make_subplots(
        rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=("Server RSS (MB) by sessions served", "Normal edit latency (s)")
    )
    samples = data.get("rss_mb", [])
    figure.add_scatter(x=[done for _, _, done in samples], y=[mb for _, mb, _ in samples], mode="lines", name="RSS (MB)", row=1, col=1)
    cases = (
        ("edit_seconds_alone", "alone"),
        ("edit_seconds_during_worst_case", "while the worst case runs"),
        ("edit_seconds_under_load", f"{counted(data.get('clients') or 0, 'visitor')} at once"),
    )
    for index, (key, name) in enumerate(cases):
        stats = data.get(key) or {}
        quantiles = [q for q in ("p50", "p90", "p99") if q in stats]
        figure.add_bar(
            x=quantiles,
            y=[stats[q] for q in quantiles],
            name=f"{name} (n={stats.get('n', 0)})",
            marker_color=PALETTE[index % len(PALETTE)],
            row=1,
            col=2,
        )
    figure.add_hline(y=5, line_dash="dash", line_color="black", annotation_text="target p90 5 s", row=1, col=2)
    figure.update_xaxes(title="sessions served", row=1, col=1)
    plateau = data.get("rss_plateau", {})
    growth = f"RSS growth over the last half {plateau.get('growth_mb')} MB" if plateau.get("growth_mb") is not None else "RSS"
    figure.update_layout(height=440, barmode="group", legend=LEGEND_BELOW)
    set_title(
        figure,
        f"Soak, {safe_label(str(data.get('profile')))} profile: "
        f"{counted(data.get('sessions') or 0, 'session')}, {counted(data.get('clients') or 0, 'client')}",
        f"{growth}; cross-talk {len(data.get('cross_talk', []))}",
        subplot_titles=1,
    )
    return figure


def agent_policy_figure(data: dict) -> go.Figure:
    """``agent-*.json``: per scenario and compaction policy, agreement with the clean-state prefill against the
    cumulative TTFT speedup over clean prefills; beside it, agreement per erratum wording."""
    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.65, 0.35],
        subplot_titles=("agreement vs TTFT speedup", "erratum wording (no compaction)"),
    )
    policies = list(dict.fromkeys(row["policy"] for row in data["rows"]))
    for index, policy in enumerate(policies):
        rows = [row for row in data["rows"] if row["policy"] == policy]
        figure.add_scatter(
            x=[row["cumulative_speedup_vs_clean_state"] for row in rows],
            y=[row["clean_state_agreement"] for row in rows],
            mode="markers",  # scenarios in hover: labels of points this close would overlap
            hovertext=[safe_label(row["scenario"]) for row in rows],
            hoverinfo="text+x+y",
            name=f"compaction {safe_label(policy)}",
            marker={"size": 11, "color": PALETTE[index % len(PALETTE)]},
            row=1,
            col=1,
        )
    figure.add_hline(y=0.95, line_dash="dash", line_color="black", annotation_text="95%", row=1, col=1)
    wordings = data.get("wordings", [])
    figure.add_bar(
        x=[safe_label(row["wording"]) for row in wordings],
        y=[row["clean_state_agreement"] for row in wordings],
        marker_color=PALETTE[4 % len(PALETTE)],
        name="wording",
        showlegend=False,
        row=1,
        col=2,
    )
    figure.update_xaxes(title_text="cumulative TTFT speedup vs clean prefills (×)", row=1, col=1)
    figure.update_yaxes(title_text="agreement with the clean-state prefill", range=[0, 1.15], row=1, col=1)  # room for labels
    figure.update_yaxes(range=[0, 1.05], row=1, col=2)
    figure.update_layout(height=460, legend=LEGEND_BELOW)
    set_title(figure, f"Agent loop, {data.get('turns')}-turn toggle", _measured_on(data), subplot_titles=1)
    return figure


def cache_reuse_figure(data: dict) -> go.Figure:
    """llama.cpp's shift-only reuse vs KVScope's arms (``cache_reuse-*.json``): per arm and case, KL from the
    engine's own clean prefill (log axis), |margin error| where the answers first differ and the share of the clean
    prefill's prompt tokens the engine evaluated; colour = engine, circles = moved cases, diamonds = edit cases."""
    figure = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.1,
        subplot_titles=(
            "KL(clean ‖ state)<br>(0 drawn at 1e-7)",
            "|margin error|<br>where answers differ",
            "prompt tokens<br>evaluated / clean",
        ),
    )
    engines = {"llama_cpp": ("llama.cpp", PALETTE[1]), "kvscope": ("KVScope", PALETTE[0])}
    arms = list(dict.fromkeys((engine, arm) for case in data["cases"] for engine in engines for arm in case[engine]))
    label = {(engine, arm): f"{engines[engine][0]}: {safe_label(arm)}" for engine, arm in arms}
    for engine, (name, colour) in engines.items():
        for kind, symbol in (("moved", "circle"), ("edit", "diamond")):
            rows = [(label[engine, arm], case, row) for case in data["cases"] if case["case"] == kind for arm, row in case[engine].items()]
            if not rows:
                continue
            hover = [safe_label(str(case["scenario"])) for _, case, _ in rows]
            values = (
                [max(row["kl"], 1e-7) for _, _, row in rows],
                [abs(row["margin_error"]) for _, _, row in rows],
                [row["evaluated_tokens"] / max(row["clean_evaluated_tokens"], 1) for _, _, row in rows],
            )
            for column, x in enumerate(values, start=1):
                figure.add_scatter(
                    x=x,
                    y=[arm for arm, _, _ in rows],
                    mode="markers",
                    text=hover,
                    name=f"{name}, {kind} cases",
                    marker={"symbol": symbol, "size": 9, "color": colour, "opacity": 0.8},
                    legendgroup=f"{engine}{kind}",
                    showlegend=column == 1,
                    hovertemplate="%{text}: %{x:.3g}<extra></extra>",
                    row=1,
                    col=column,
                )
    order = [label[arm] for arm in arms][::-1]
    figure.update_annotations(font_size=12)  # the two-line subplot titles of three narrow panels
    figure.update_xaxes(type="log", row=1, col=1)
    figure.update_yaxes(categoryorder="array", categoryarray=order, showticklabels=False)
    figure.update_yaxes(showticklabels=True, row=1, col=1)
    figure.update_layout(height=200 + 28 * len(arms), legend={**LEGEND_BELOW, "y": -0.12}, margin={"l": 260})
    set_title(figure, "Reusing moved or edited K/V: llama.cpp --cache-reuse vs KVScope", _measured_on(data), subplot_titles=2)
    return figure


def image_splice_figure(data: dict) -> go.Figure:
    """``image-splice-*.json``: a picture's K/V spliced behind text vs the recompute from pixels, per seam: logit cosine
    and the TTFT speedup (median, bars from min to max) against how far the block moved; the paper's numbers dashed."""
    figure = make_subplots(rows=1, cols=2, subplot_titles=("logit cosine vs full recompute", "TTFT speedup (recompute / splice)"))
    seams = sorted({row["seam"] for row in data["rows"]})
    for index, seam in enumerate(seams):
        rows = sorted((row for row in data["rows"] if row["seam"] == seam), key=lambda row: row["shift"])
        shifts, colour = [row["shift"] for row in rows], PALETTE[index % len(PALETTE)]
        name = f"seam {seam}" + (" (every picture token)" if rows and seam >= rows[0]["image_tokens"] else "")
        figure.add_scatter(
            x=shifts,
            y=[row["cosine"] for row in rows],
            mode="lines+markers",
            name=name,
            legendgroup=name,
            marker={"color": colour},
            row=1,
            col=1,
        )
        medians = [row["speedup"]["median"] for row in rows]
        figure.add_scatter(
            x=shifts,
            y=medians,
            mode="lines+markers",
            name=name,
            legendgroup=name,
            showlegend=False,
            marker={"color": colour},
            error_y=whiskers([row["speedup"] for row in rows]),
            row=1,
            col=2,
        )
    paper = data.get("paper", {})
    if "cosine_shift_161" in paper:
        figure.add_hline(
            y=paper["cosine_shift_161"], line_dash="dash", line_color="black", annotation_text="paper: 0.99 at 161", row=1, col=1
        )
    for bound in paper.get("ttft_speedup", []):
        figure.add_hline(y=bound, line_dash="dash", line_color="black", annotation_text=f"paper ×{bound}", row=1, col=2)
    figure.update_xaxes(title_text="positions moved (text tokens before it)")
    highest = max([row["speedup"]["max"] for row in data["rows"]] + list(paper.get("ttft_speedup", [])) + [1.0])
    figure.update_yaxes(title_text="×", range=[0, highest * 1.1], row=1, col=2)
    figure.update_layout(height=440, legend=LEGEND_BELOW)
    set_title(figure, f"A picture's K/V spliced behind text, {data.get('reps')} timed reps", _measured_on(data), subplot_titles=1)
    return figure


def compare_models_figure(data: dict) -> go.Figure:
    """Across models (``compare_models-*.json``): how many bundled scenarios flip under a clean prefill and how many are
    notes demos, and the N-skill study's median splice cosine per remedy, one group per model."""
    models = data["models"]
    short = [row.get("spec") or row["model"].split(":", 1)[-1] for row in models]
    names = [f"{safe_label(name, 24)} ({parameter_count(row['parameters'])})" for name, row in zip(short, models)]
    figure = make_subplots(rows=1, cols=2, subplot_titles=("bundled scenarios (calibration)", "splice cosine, median (N-skill study)"))
    figure.add_bar(x=names, y=[row["calibrate"]["flipping"] for row in models], name="flip under a clean prefill", row=1, col=1)
    figure.add_bar(x=names, y=[row["calibrate"]["notes_demos"] for row in models], name="notes demos", row=1, col=1)
    remedies = list(dict.fromkeys(name for row in models for name in row["study"]["summary"]))
    for index, remedy in enumerate(remedies):
        cosines = [((row["study"]["summary"].get(remedy) or {}).get("cosine") or {}).get("median") for row in models]
        figure.add_bar(x=names, y=cosines, name=safe_label(remedy), marker_color=PALETTE[(index + 2) % len(PALETTE)], row=1, col=2)
    totals = sorted({row["calibrate"]["total"] for row in models})
    figure.update_yaxes(title=f"of {', '.join(map(str, totals))} scenario fields", row=1, col=1)
    cpu = (data.get("cpu") or {}).get("model_name")
    measured = ", ".join(safe_label(str(part)) for part in (data.get("dtype"), cpu) if part)
    figure.update_layout(barmode="group", height=460, legend={**LEGEND_BELOW, "y": -0.4}, margin={"b": 140})  # below tilted names
    set_title(figure, "Across models", f"measured in {measured}" if measured else "", subplot_titles=1)
    return figure


def audit_benchmark_figure(data: dict) -> go.Figure:
    """One bundled request log audited (``audit-<log>-*.json``): per turn, each repair's reused fraction, its TTFT (the
    clean prefill dashed) and its next-token KL; filled markers stay within the audit's threshold."""
    turns = [turn for turn in data["turns"] if turn["repairs"]]
    requests = [turn["request"] for turn in turns]
    figure = make_subplots(
        rows=1, cols=3, horizontal_spacing=0.1, subplot_titles=("reused fraction", "time to first token", "KL vs clean prefill")
    )
    figure.add_scatter(
        x=requests,
        y=[turn["full_ttft_ms"] for turn in turns],
        name="clean prefill",
        mode="lines",
        line={"color": "black", "dash": "dash"},
        row=1,
        col=2,
    )
    colours = repair_colours(data["repairs"])
    for name in data["repairs"]:
        results = [turn["repairs"][name] for turn in turns]
        colour, symbols = colours[name], within_symbols(results, data)
        for column, values in (
            (1, [reused_fraction(result) for result in results]),
            (2, [result["ttft_ms"] if result["applicable"] else None for result in results]),
            (3, [max(result["kl"], KL_FLOOR) if result["applicable"] else None for result in results]),
        ):
            figure.add_scatter(
                x=requests,
                y=values,
                name=safe_label(name),
                legendgroup=name,
                showlegend=column == 1,
                mode="lines+markers",
                line={"color": colour},
                marker={"symbol": symbols, "size": 9, "line": {"width": 2, "color": colour}},
                row=1,
                col=column,
            )
    figure.update_xaxes(title_text="request", tickvals=requests)
    figure.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=1)
    figure.update_yaxes(type="log", title_text="ms", row=1, col=2)
    figure.update_yaxes(type="log", exponentformat="power", title_text=f"KL (0 drawn at {KL_FLOOR:g})", row=1, col=3)
    figure.add_hline(y=data["threshold"], line={"color": "#e76f51", "dash": "dot"}, row=1, col=3)
    summary = data.get("summary") or {}
    saved = (
        f"; recommended repairs compute {summary['recommended_computed_tokens']:,} tokens vs recompute's "
        f"{summary['recompute_computed_tokens']:,}"
        if summary
        else ""
    )
    figure.update_layout(height=460, legend=LEGEND_BELOW)
    set_title(
        figure,
        f"Audit of {safe_label(str(data.get('log', 'a log')))}: {data.get('generated_tokens')} greedy tokens, {data.get('reps')} rep(s)",
        _measured_on(data),
        f"filled: within KL ≤ {data['threshold']:g}, same top token, ≥ {data['min_agreement']:.0%} agreeing{saved}",
        subplot_titles=1,
    )
    return figure


def audit_cli_figure(data: dict) -> go.Figure:
    """The CLI audit timed as a user runs it (``audit_cli-*.json``): per bundled log, the default audit's seconds (this
    checkout, and the baseline checkout where one was timed) against the goal, and ``--rewritten`` and the rewrite alone
    as ratios to plain transformers doing the same prefills and generations; bars are medians, whiskers min to max."""
    logs = [safe_label(row["log"]) for row in data["logs"]]
    figure = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.14, subplot_titles=("default audit: seconds", "time over plain transformers")
    )
    baseline = "the baseline checkout"
    seconds = (("baseline_default_s", baseline), ("default_s", "default audit"))
    ratios = (("baseline_rewrite_ratio", baseline), ("rewrite_ratio", "--rewritten"), ("rewrite_only_ratio", "rewrite alone"))
    colours = {baseline: "#adb5bd", "default audit": PALETTE[0], "--rewritten": PALETTE[1], "rewrite alone": PALETTE[2]}
    shown = set()
    tops = {1: float(data["goal_audit_s"]), 2: float(data["goal_ratio"])}  # each axis shows its goal and every whisker
    for column, series in ((1, seconds), (2, ratios)):
        for key, name in series:
            if not any(key in row for row in data["logs"]):
                continue
            stats = [row.get(key) or {} for row in data["logs"]]
            tops[column] = max([tops[column], *(stat["max"] for stat in stats if stat)])
            medians = [stat.get("median") for stat in stats]
            figure.add_bar(
                x=logs,
                y=medians,
                name=name,
                legendgroup=name,
                showlegend=name not in shown,
                marker_color=colours[name],
                error_y=whiskers(stats),
                text=[("" if value is None else f"{value:.0f} s" if column == 1 else f"×{value:.2f}") for value in medians],
                textposition="outside",
                row=1,
                col=column,
            )
            shown.add(name)
    figure.add_hline(y=data["goal_audit_s"], line={"color": "#e76f51", "dash": "dot"}, row=1, col=1)
    figure.add_hline(y=data["goal_ratio"], line={"color": "#e76f51", "dash": "dot"}, row=1, col=2)
    figure.update_yaxes(title_text="seconds", range=[0, tops[1] * 1.15], row=1, col=1)
    figure.update_yaxes(title_text="× plain transformers", range=[0, tops[2] * 1.15], row=1, col=2)
    figure.update_layout(height=460, barmode="group", legend=LEGEND_BELOW)
    set_title(
        figure,
        f"The CLI audit's time: {data['dtype']}, {data['tokens']} greedy tokens, {data['reps']} rep(s)",
        _measured_on(data),
        f"dotted: the goals, {data['goal_audit_s']} s a log and ×{data['goal_ratio']:g} plain transformers",
        subplot_titles=1,
    )
    return figure


def greedy_lookup_figure(data: dict) -> go.Figure:
    """Greedy decoding with prompt lookup against a token a forward (``greedy_lookup-*.json``): per bundled log, the
    forwards each ran for the same tokens, and lookup's speedup (median bar, min-max whisker); a log whose tokens parted
    (at an exact tie) is marked."""
    logs = [safe_label(row["log"]) + ("" if row["same_tokens"] else " *") for row in data["logs"]]
    figure = make_subplots(rows=1, cols=2, horizontal_spacing=0.14, subplot_titles=("decode forwards", "speedup of lookup"))
    for key, name, colour in (("plain_forwards", "a token a forward", "#adb5bd"), ("lookup_forwards", "prompt lookup", PALETTE[0])):
        values = [row[key] for row in data["logs"]]
        figure.add_bar(x=logs, y=values, name=name, marker_color=colour, text=values, textposition="outside", row=1, col=1)
    speedups = [row["speedup"] for row in data["logs"]]
    figure.add_bar(
        x=logs,
        y=[stat["median"] for stat in speedups],
        name="speedup",
        showlegend=False,
        marker_color=PALETTE[2],
        error_y=whiskers(speedups),
        text=[f"×{stat['median']:.2f}" for stat in speedups],
        textposition="outside",
        row=1,
        col=2,
    )
    top = max([1.0, *(stat["max"] for stat in speedups)])
    figure.add_hline(y=1.0, line={"color": "#e76f51", "dash": "dot"}, row=1, col=2)
    figure.update_yaxes(title_text="forwards", rangemode="tozero", row=1, col=1)
    figure.update_yaxes(title_text="× a token a forward", range=[0, top * 1.2], row=1, col=2)
    figure.update_layout(height=440, barmode="group", legend=LEGEND_BELOW)
    set_title(
        figure,
        "Greedy decoding with prompt lookup",
        _measured_on(data),
        f"{data['tokens']} tokens a request, {data['reps']} rep(s), guesses of up to {data['lookup_tokens']} tokens; "
        "dotted: no gain; * the tokens parted at a tie",
        subplot_titles=1,
    )
    return figure


FORWARD_PATHS = {  # result key -> panel title, the replaced path, the fast one (benchmarks/studies/forward_paths.py)
    "output_rows": ("output projection, last row kept", "slice", "fresh_view"),
    "causal_prefill": ("prefill chunk after a cached head", "masked", "padded_causal"),
}


def forward_paths_figure(data: dict) -> go.Figure:
    """Two fast paths of a forward against the paths they replace (``forward_paths-*.json``): per path, a bar per dtype
    of the speedup (the replaced path's median ms over the fast one's, log axis; both medians in the hover text); a pair
    whose numbers differed is marked."""
    figure = go.Figure()
    titles = [title for title, *_ in FORWARD_PATHS.values()]
    for index, (dtype, rows) in enumerate(data["dtypes"].items()):
        pairs = [(rows[key], replaced, fast) for key, (_, replaced, fast) in FORWARD_PATHS.items()]
        figure.add_bar(
            x=titles,
            y=[row["speedup"] for row, *_ in pairs],
            name=safe_label(dtype),
            marker_color=PALETTE[index % len(PALETTE)],
            text=[f"×{row['speedup']:.2f}" + ("" if row["same"] else " (numbers differ)") for row, *_ in pairs],
            textposition="outside",
            hovertext=[
                f"{replaced}: {row[replaced]['median']:,.1f} ms, {fast}: {row[fast]['median']:,.1f} ms" for row, replaced, fast in pairs
            ],
        )
    top = max([2.0, *(row["speedup"] for rows in data["dtypes"].values() for row in rows.values())])
    figure.add_hline(y=1.0, line={"color": "#e76f51", "dash": "dot"})
    figure.update_yaxes(title_text="× the replaced path (median)", type="log", dtick=1, range=[-0.1, math.log10(top) + 0.35])
    figure.update_layout(height=440, barmode="group", legend=LEGEND_BELOW)
    same = all(row["same"] for rows in data["dtypes"].values() for row in rows.values())
    set_title(
        figure,
        "Fast paths of a forward, side by side",
        _measured_on(data),
        f"a {data['chunk']:,}-token forward after {data['stored']:,} cached tokens; dotted: no gain; "
        + ("every pair gave the same numbers, bit for bit" if same else "marked: a pair whose numbers differed"),
    )
    return figure


def audit_replay_figure(data: dict) -> go.Figure:
    """Request logs replayed on llama-server (``audit_replay-*.json``): per request, the server's prompt time against the
    audit's fidelity (greedy agreement, next-token KL), a colour per replay and a marker per log; beside them, the tokens
    the server kept against the simulated llama.cpp cache's."""
    labels = list(dict.fromkeys(label for log in data["logs"] for label in log["replays"]))
    symbols = ("circle", "square", "diamond", "triangle-up", "star", "hexagon")
    figure = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.09,
        subplot_titles=("time vs agreement", "time vs KL", "server vs simulated"),
    )
    highest = 1
    for index, label in enumerate(labels):
        colour = "black" if label == "original" else PALETTE[index % len(PALETTE)]
        for number, log in enumerate(data["logs"]):
            rows = log["replays"].get(label, {}).get("requests", [])
            if not rows:
                continue
            text = [
                f"{safe_label(log['log'])} #{row['request']}: {row['tokens']:,} tokens, {row['server_cached_tokens']:,} cached; "
                f"KL {row['kl']:.3g}, {row['generation_agreement']:.0%} agreeing, {'the same' if row['same_text'] else 'other'} text"
                for row in rows
            ]
            shape = symbols[number % len(symbols)]
            marker = {"color": colour, "size": 9, "symbol": [shape if row["top1_agree"] else f"{shape}-open" for row in rows]}
            shown = {"name": safe_label(label), "legendgroup": label, "mode": "markers", "marker": marker, "text": text}
            times = [row["prompt_ms"] for row in rows]
            for column, x in (
                (1, [row["generation_agreement"] for row in rows]),
                (2, [max(row["kl"], KL_FLOOR) for row in rows]),
                (3, [row["simulated_cached_tokens"] for row in rows]),
            ):
                y = [row["server_cached_tokens"] for row in rows] if column == 3 else times
                figure.add_scatter(x=x, y=y, showlegend=number == 0 and column == 1, **shown, row=1, col=column)
            highest = max([highest, *(row["server_cached_tokens"] for row in rows), *(row["simulated_cached_tokens"] for row in rows)])
    figure.add_scatter(
        x=[0, highest], y=[0, highest], mode="lines", line={"color": "#999", "dash": "dot"}, name="equal", showlegend=False, row=1, col=3
    )
    figure.update_xaxes(title_text="greedy tokens agreeing", range=[-0.05, 1.05], tickformat=".0%", row=1, col=1)
    figure.update_xaxes(type="log", exponentformat="power", title_text=f"KL (0 drawn at {KL_FLOOR:g})", row=1, col=2)
    figure.update_yaxes(type="log", title_text="prompt time (ms)", row=1, col=1)
    figure.update_yaxes(type="log", row=1, col=2)
    figure.update_xaxes(title_text="simulated llama.cpp cache (tokens)", row=1, col=3)
    figure.update_yaxes(title_text="server cache_n (tokens)", row=1, col=3)
    summary = data.get("summary") or {}
    equal = (
        f"{summary.get('equal')}/{counted(summary.get('requests') or 0, 'request')} cache what the simulation predicts; " if summary else ""
    )
    logs = ", ".join(f"{safe_label(log['log'])} ({symbols[n % len(symbols)]})" for n, log in enumerate(data["logs"]))
    figure.update_layout(height=480, legend=LEGEND_BELOW)
    set_title(
        figure,
        f"Request logs replayed on llama-server, each repair's template deployed: {data.get('reps')} rep(s)",
        _measured_on(data),
        f"{equal}open markers: the top token changes; logs: {logs}",
        subplot_titles=1,
    )
    return figure


CHAT_REPLAY_WAYS = {  # the ways a chat replay's log was audited (``chat_replay-*.json``), and their legend
    "token_ids": "replies from the server's token ids",
    "text_only": "replies from their text alone",
    "prompts_only": "prompts only (no reply cached)",
    "no_flags": "with no flags (engine and settings read from the log)",
}


def _chat_replay_part(result: dict, way: str) -> dict | None:
    """A server's comparison drawn as ``way``: prompts only and no flags read the token-id way where there is one."""
    if way in ("token_ids", "text_only"):
        return result.get(way)
    source = result if way == "prompts_only" else result.get("no_flags") or {}
    return source.get("token_ids") or source.get("text_only")


def chat_replay_figure(data: dict) -> go.Figure:
    """Chat sessions replayed on real servers with their replies fed back (``chat_replay-*.json``): per server and setting,
    the requests where the audit's simulated cache equals the server's own count, with the replies read from token ids,
    from text alone, with no reply cached (the simulation before replies were cached), and audited with no flags."""
    servers = data["servers"]
    figure = go.Figure()
    for index, (way, label) in enumerate(CHAT_REPLAY_WAYS.items()):
        names, equal, text = [], [], []
        for name, result in servers.items():
            part = _chat_replay_part(result, way)
            if part is None:
                continue
            count = part["equal_prompts_only"] if way == "prompts_only" else part["equal"]
            names.append(safe_label(name))
            equal.append(count)
            text.append(f"{count}/{part['requests']}")
        figure.add_bar(x=names, y=equal, name=label, text=text, textposition="outside", marker_color=PALETTE[index % len(PALETTE)])
    requests = max(
        (part["requests"] for result in servers.values() for part in (result.get("token_ids"), result.get("text_only")) if part), default=0
    )
    figure.update_layout(barmode="group", height=420, legend=LEGEND_BELOW)
    figure.update_yaxes(title_text="requests: simulation = server", range=[0, requests * 1.15 or 1], dtick=5)
    set_title(
        figure,
        f"The audit's simulated cache against real servers' own counts: {data.get('sessions')} chat sessions × {data.get('turns')} turns",
        "each reply fed back as the next turn's assistant message; replies of at most "
        + ", ".join(str(tokens) for tokens in data.get("max_tokens") or ())
        + " tokens",
    )
    return figure


DEPLOY_LABELS = {
    "none": "bottom center",
    "policy": "middle left",
    "erratum": "middle right",
    "hoist": "bottom center",
    "coarsen": "top center",
}
# where each variant's label sits beside its marker: repairs that reuse alike land on one spot


def deploy_figure(data: dict) -> go.Figure:
    """The audit's repairs applied by the LiteLLM proxy's hook in front of vLLM (``deploy-*.json``): per variant, vLLM's
    prefix-cache hit rate against the share of answers agreeing with clean prefills; beside it, the TTFT through the proxy."""
    variants = data["variants"]
    figure = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=("reuse vs the answers", "time to first token"))
    agree = data.get("agree_tokens")
    for index, (name, result) in enumerate(variants.items()):
        colour = "black" if name == "none" else PALETTE[index % len(PALETTE)]
        requests = result["requests"] or 1
        first, same = result["same_first_tokens"] / requests, result["same_text"] / requests
        hover = (
            f"{safe_label(name)}: {safe_label(result.get('what', ''))}<br>hit rate {result['hit_rate_metrics']:.0%} "
            f"({result['metrics_hits']:,.0f} of {result['metrics_queries']:,.0f} prompt tokens); same first {agree} tokens "
            f"{result['same_first_tokens']}/{result['requests']}, same text {result['same_text']}/{result['requests']}"
        )
        figure.add_scatter(
            x=[result["hit_rate_metrics"]] * 2,
            y=[first, same],
            mode="markers+text",
            marker={"color": colour, "size": 12, "symbol": ["circle", "diamond-open"]},
            text=[safe_label(name), ""],
            textposition=DEPLOY_LABELS.get(name, "top center"),
            hovertext=[hover] * 2,
            hoverinfo="text",
            name=safe_label(name),
            legendgroup=name,
            row=1,
            col=1,
        )
        ttft = result["ttft_p50_s"]
        figure.add_bar(
            x=[safe_label(name)],
            y=[ttft["median"]],
            error_y=whiskers([ttft]),
            marker_color=colour,
            text=[f"×{result['ttft_p50_ratio_to_none']:.2g}" if "ttft_p50_ratio_to_none" in result else ""],
            textposition="outside",
            showlegend=False,
            legendgroup=name,
            row=1,
            col=2,
        )
    figure.update_xaxes(title_text="vLLM prefix-cache hit rate (/metrics)", range=[-0.05, 1.05], tickformat=".0%", row=1, col=1)
    figure.update_yaxes(title_text="answers agreeing with clean prefills", range=[-0.05, 1.25], tickformat=".0%", row=1, col=1)
    figure.update_yaxes(title_text="TTFT p50 through the proxy (s)", row=1, col=2)
    figure.update_layout(height=480, legend=LEGEND_BELOW)
    not_run = "; ".join(f"{safe_label(name)} not run: {safe_label(why)}" for name, why in (data.get("not_run") or {}).items())
    set_title(
        figure,
        f"The audit's repairs at the gateway: LiteLLM proxy + KVScope hook in front of vLLM ({safe_label(str(data.get('model')))}), "
        f"{data.get('reps')} interleaved rep(s) of {', '.join(safe_label(name) for name in data.get('variants') or {})}",
        f"sessions: {', '.join(safe_label(name) for name in data.get('sessions') or {})}, each reply fed back; filled: the same "
        f"first {agree} tokens, open: the same text; bars: median TTFT p50, min–max over reps, × the no-hook baseline",
        not_run,
        subplot_titles=1,
    )
    return figure
