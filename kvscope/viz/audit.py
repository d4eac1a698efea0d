"""Figures and views of a request-log audit (``kvscope.engine.audit``): the reused fraction of every repair per turn, fidelity
against cost, the recommendation per turn in words, and the rendered prompt with its changed or volatile spans marked;
for a log audited as traffic (``TrafficReport.as_dict()``), its sessions, the engines' reuse, the causes, the sampled
groups, and a timeline per session.

Figures take the audit's JSON (``kvscope.engine.audit.ci.report``: ``PromptAudit``, ``LogAudit``, or a benchmark file with
the same ``turns``; a turn is ``AuditTurn``'s JSON, a repair ``RepairResult``'s), so a stored result draws without a model.
Every user or model string is escaped: plotly text through :func:`safe_label`, HTML through :func:`html.escape`, Markdown
through :func:`markdown_literal`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from kvscope.engine.audit.changes.causes import CAUSES
from kvscope.engine.audit.ci.gate import budget_lines
from kvscope.engine.audit.ci.report import AuditJSON, LogAudit
from kvscope.engine.audit.logs.requests import Skipped
from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS
from kvscope.engine.audit.simulate.hosted import TOKENS_NOTE
from kvscope.engine.audit.simulate.observed import OBSERVED_CAUSES
from kvscope.engine.audit.simulate.registry import ENGINES, LABELS, PROVIDERS
from kvscope.engine.audit.simulate.step import replies_sentence
from kvscope.engine.words import counted
from kvscope.viz.common import GREY, LEGEND_BELOW, PALETTE, markdown_literal, message_figure, safe_label, set_title

TurnJSON = dict[str, Any]  # a measured turn as the report holds it (``measure.turn.AuditTurn``'s JSON)
RepairJSON = dict[str, Any]  # a repair on a turn as the report holds it (``measure.repairs.RepairResult``'s JSON)

KL_FLOOR = 1e-9  # KL drawn on a log axis: exact states (KL 0) sit on this floor
X_AXES = {"computed": "context tokens computed (% of the request, log scale)", "ttft": "TTFT speed-up vs a full prefill (×, log scale)"}
Y_AXES = {"kl": "next-token KL(clean ‖ repaired), log", "agreement": "greedy tokens agreeing with the clean prefill"}
MAX_SHOWN_CHARS = 600  # an unmarked stretch longer than this is shown by its ends only
CONTEXT_CHARS = 200
RequestRow = dict[str, Any]  # one of the report's requests: a scan.token_pass.TrafficRequest in JSON
DODGE = 0.05  # requests: each repair's points sit this far apart on the timeline's x axis
LABEL_BINS = (40, 16)  # fidelity against cost: points within 1/40 of the x span and 1/16 of the y span share one label


def repair_colours(names: Sequence[str]) -> dict[str, str]:
    """A colour per repair: recompute (the exact reference) black, the others the palette's."""
    return {name: ("black" if name == "recompute" else PALETTE[i % len(PALETTE)]) for i, name in enumerate(names)}


def within(result: RepairJSON, data: AuditJSON) -> bool:
    """A repair's fidelity within the bars the audit judged it against (``within_bars``: the thresholds widened to the
    noise floor); a stored result written before that key: KL ≤ the threshold, the same top token and at least
    ``min_agreement`` of the greedy tokens agreeing."""
    if "within_bars" in result:
        return bool(result["within_bars"])
    return bool(
        result.get("applicable")
        and result["kl"] <= data["threshold"]
        and result["top1_agree"]
        and result["generation_agreement"] >= data["min_agreement"]
    )


def reused_fraction(result: RepairJSON) -> float | None:
    """The share of the state a repair serves from that was reused from the cache (None when it does not apply)."""
    if not result.get("applicable"):
        return None
    total = result["reused_tokens"] + result["computed_tokens"]
    return result["reused_tokens"] / total if total else 0.0


def _audited(data: AuditJSON) -> list[TurnJSON]:
    return [turn for turn in data["turns"] if turn["repairs"]]


def _hover(name: str, turn: TurnJSON, result: RepairJSON, data: AuditJSON) -> str:
    if not result.get("applicable"):
        return f"<b>{safe_label(name)}</b>, request {turn['request']}: not applicable"
    ratio = result.get("ttft_ratio")
    return (
        f"<b>{safe_label(name)}</b>, request {turn['request']} ({turn['tokens']:,} tokens)<br>"
        f"reused {result['reused_tokens']:,}, computed {result['computed_tokens']:,}<br>"
        f"TTFT {result['ttft_ms']:.0f} ms{'' if ratio is None else f' (×{ratio:.2f} vs full)'}<br>"
        f"KL {result['kl']:.3g} · top-1 {'same' if result['top1_agree'] else 'differs'} · "
        f"{result['generation_agreement']:.0%} of {data['generated_tokens']} greedy tokens agree<br>"
        f"{'within' if within(result, data) else 'outside'} the threshold"
    )


def within_symbols(results: Sequence[RepairJSON], data: AuditJSON) -> list[str]:
    """Each result's marker: filled within the audit's bars, open outside them."""
    return ["circle" if within(result, data) else "circle-open" for result in results]


def block_tokens(data: AuditJSON) -> int:
    """The block size the report's block-aligned prefixes were counted in: a log's simulated vLLM block (its token pass's
    engine settings), else vLLM's default (one prompt audited against its change)."""
    engines = data.get("engines")
    return engines["settings"]["block"] if engines else BLOCK_TOKENS


def reuse_timeline_figure(data: AuditJSON) -> go.Figure:
    """Per turn (request number), the reused fraction of each repair's state (the repairs dodged apart by DODGE), and
    the block-aligned prefix a vLLM-style cache keeps (in the report's block size); filled markers are within the
    fidelity threshold, open ones outside it."""
    turns, names = _audited(data), list(data["repairs"])
    figure = go.Figure()
    if not turns:
        return message_figure(no_turns(data, "nothing to draw of a repair's reuse"))
    requests = [turn["request"] for turn in turns]
    figure.add_scatter(
        x=requests,
        y=[turn["block_prefix_tokens"] / turn["tokens"] for turn in turns],
        mode="lines",
        name=f"{block_tokens(data)}-token blocks (vLLM)",
        line={"color": GREY, "dash": "dash"},
        hovertext=[f"block-aligned prefix: {turn['block_prefix_tokens']:,} of {turn['tokens']:,} tokens" for turn in turns],
        hoverinfo="text",
    )
    colours = repair_colours(names)
    for index, name in enumerate(names):
        results = [turn["repairs"].get(name, {"applicable": False}) for turn in turns]
        dodge = DODGE * (index - (len(names) - 1) / 2)  # repairs reusing about as much stay apart
        figure.add_scatter(
            x=[request + dodge for request in requests],
            y=[reused_fraction(result) for result in results],
            mode="lines+markers",
            name="recompute (exact prefix)" if name == "recompute" else safe_label(name),
            line={"color": colours[name], "width": 3 if name == "recompute" else 2},
            marker={"size": 10, "symbol": within_symbols(results, data), "line": {"width": 2, "color": colours[name]}},
            hovertext=[_hover(name, turn, result, data) for turn, result in zip(turns, results)],
            hoverinfo="text",
            connectgaps=False,
        )
    for turn in turns:
        if turn["fields"]:
            names_changed = ", ".join(field["name"] for field in turn["fields"][:2]) + (
                f" +{len(turn['fields']) - 2}" if len(turn["fields"]) > 2 else ""
            )
            figure.add_annotation(
                x=turn["request"], y=1.04, text=safe_label(names_changed, 28), showarrow=False, font={"size": 10, "color": "#6a4c93"}
            )
    figure.update_layout(
        xaxis={"title": "request", "tickmode": "array", "tickvals": requests},
        yaxis={"title": "share of the state reused from the cache", "range": [0, 1.1], "tickformat": ".0%"},
        height=460,
        legend=LEGEND_BELOW,
        margin={"b": 110},
    )
    set_title(figure, "Reused fraction per turn", "filled: within the fidelity threshold · labels: the fields that changed")
    return figure


def _x(result: RepairJSON, turn: TurnJSON, axis: str) -> float | None:
    if axis == "ttft":
        return result.get("ttft_ratio")
    return 100 * result["computed_tokens"] / max(turn["tokens"], 1)


def _y(result: RepairJSON, axis: str) -> float:
    return result["generation_agreement"] if axis == "agreement" else max(result["kl"], KL_FLOOR)


def fidelity_cost_figure(data: AuditJSON, x: str = "computed", y: str = "kl") -> go.Figure:
    """Fidelity against cost, one point per repair per turn (labelled with its request): computed tokens (% of the
    request) or the TTFT speed-up on x, the next-token KL or the greedy agreement on y; the threshold drawn, filled
    markers within it."""
    if x not in X_AXES or y not in Y_AXES:
        raise ValueError(f"axes are x in {sorted(X_AXES)} and y in {sorted(Y_AXES)}, got {x!r}, {y!r}")
    turns, names = _audited(data), list(data["repairs"])
    if not turns:
        return message_figure(no_turns(data, "no repair to measure"))
    figure, colours, placed = go.Figure(), repair_colours(names), []
    for name in names:
        points = [(turn, turn["repairs"][name]) for turn in turns if turn["repairs"].get(name, {}).get("applicable")]
        points = [(turn, result) for turn, result in points if _x(result, turn, x) is not None]
        if not points:
            continue
        placed += [(_x(result, turn, x), _y(result, y), turn["request"]) for turn, result in points]
        figure.add_scatter(
            x=[_x(result, turn, x) for turn, result in points],
            y=[_y(result, y) for _, result in points],
            mode="markers",
            name=safe_label(name),
            marker={
                "size": 12,
                "color": colours[name],
                "symbol": within_symbols([result for _, result in points], data),
                "line": {"width": 2, "color": colours[name]},
            },
            hovertext=[_hover(name, turn, result, data) for turn, result in points],
            hoverinfo="text",
        )
    _label_points(figure, placed, y == "kl")
    level = data["min_agreement"] if y == "agreement" else data["threshold"]
    figure.add_hline(y=level, line={"color": "#e76f51", "dash": "dash"}, annotation_text="threshold", annotation_position="right")
    if x == "ttft":
        figure.add_vline(x=1.0, line={"color": GREY, "dash": "dot"}, annotation_text="as fast as a full prefill", annotation_position="top")
    figure.update_layout(
        xaxis={
            "title": X_AXES[x],
            "type": "log",
            **_log_ticks([p for p, _, _ in placed], "%" if x == "computed" else ""),
        },
        yaxis={
            "title": Y_AXES[y],
            **({"type": "log", "exponentformat": "power"} if y == "kl" else {"range": [-0.05, 1.1], "tickformat": ".0%"}),
        },
        height=520,
        legend=LEGEND_BELOW,
        margin={"b": 110, "r": 70},
    )
    set_title(
        figure,
        "Fidelity against cost, per repair and turn",
        (f"KL 0 drawn at {KL_FLOOR:g} · " if y == "kl" else "")
        + f"filled: KL ≤ {data['threshold']:g}, same top token, ≥ {data['min_agreement']:.0%} of greedy tokens agreeing",
    )
    return figure


def _log_ticks(values: Sequence[float], suffix: str) -> dict:
    """A log axis's ticks, each with ``suffix``: one a decade over a decade or more; over less (a log whose points all sit
    between 22% and 67%), four values across the points, rounded to two digits, since decade ticks would label none."""
    low, high = math.log10(max(min(values), KL_FLOOR)), math.log10(max(max(values), KL_FLOOR))
    if high - low >= 1:
        return {"dtick": 1, "ticksuffix": suffix}
    ticks = sorted({float(f"{10 ** (low + (high - low) * k / 3):.2g}") for k in range(4)})
    return {"tickmode": "array", "tickvals": ticks, "ticktext": [f"{tick:g}{suffix}" for tick in ticks]}


def _label_points(figure: go.Figure, points: Sequence[tuple[float, float, int]], y_log: bool) -> None:
    """Each place the repairs' ``points`` (x, y, request) sit labelled once with its requests ("r2·r3"): the repairs of a
    turn often land on one spot, and a label per point stacked their "rN"s into one glyph. A place is a cell of
    LABEL_BINS over the drawn span (log on x, and on y where ``y_log``); its label sits over the first point in it."""
    if not points:
        return
    xs = [math.log10(max(x, KL_FLOOR)) for x, _, _ in points]
    ys = [math.log10(y) if y_log else y for _, y, _ in points]
    x_step, y_step = ((max(v) - min(v)) / bins or 1.0 for v, bins in zip((xs, ys), LABEL_BINS))
    places: dict[tuple[int, int], list[int]] = {}
    for index, (x, y) in enumerate(zip(xs, ys)):
        places.setdefault((round(x / x_step), round(y / y_step)), []).append(index)
    firsts = [indices[0] for indices in places.values()]
    figure.add_scatter(
        x=[points[i][0] for i in firsts],
        y=[points[i][1] for i in firsts],
        mode="markers+text",
        marker={"size": 12, "opacity": 0},  # the repairs' markers' size: the label sits above them, not on them
        text=["·".join(f"r{request}" for request in sorted({points[i][2] for i in indices})) for indices in places.values()],
        textposition="top center",
        textfont={"size": 11, "color": "#444"},
        hoverinfo="skip",
        showlegend=False,
    )


def recommendations_markdown(data: AuditJSON) -> str:
    """Per turn, in words: what a prefix cache reuses, the fields that changed (old → new), what was appended, and the
    recommended repair with the engine's reason; a ``cancelled`` model pass is said first (no repair was measured)."""
    lines, block = unmeasured_lines(data), block_tokens(data)
    lines += [
        f"**{markdown_literal(data['model'])}** ({markdown_literal(data['dtype'])}) · threshold KL ≤ {data['threshold']:g}, "
        f"≥ {data['min_agreement']:.0%} of {data['generated_tokens']} greedy tokens agreeing"
        + (f" · coarsen grain {markdown_literal(data['grain'])}" if data.get("grain") else "")
    ]
    for turn in data["turns"]:
        if not turn["repairs"]:
            lines.append(f"- **Request {turn['request']}** ({turn['tokens']:,} tokens): the first request, prefilled and cached.")
            continue
        fields = (
            "; ".join(
                f"*{markdown_literal(field['name'])}* {_value(field['old'])} → {_value(field['new'])} "
                f"(tokens {field['start']}–{field['end']})"
                for field in turn["fields"]
            )
            or "none (only new turns appended)"
        )
        reuse = (
            f"a prefix cache reuses {turn['common_prefix_tokens']:,} of {turn['tokens']:,} tokens "
            f"({turn['common_prefix_tokens'] / turn['tokens']:.0%}; {turn['block_prefix_tokens']:,} in {block}-token blocks)"
        )
        recommendation = turn["recommendation"]
        lines.append(
            f"- **Request {turn['request']}**: {reuse}; {turn['appended_tokens']:,} tokens appended; fields changed: {fields}.  \n"
            f"  **Recommended: {markdown_literal(recommendation['repair'])}** — {markdown_literal(recommendation['reason'])}."
        )
    return "\n".join(lines)


def _value(text: str, limit: int = 60) -> str:
    shown = text if len(text) <= limit else text[: limit - 1] + "…"
    return f"“{markdown_literal(shown)}”"


# ---------------------------------------------------------------------------- the rendered prompt, marked
@dataclass(frozen=True)
class Mark:
    """A character span of a rendered prompt to highlight: ``kind`` is ``field``, ``growth``, ``cut`` (an empty span:
    where the prefix cache stops) or ``candidate``; ``title`` is the hover text, ``badge`` a short label shown."""

    start: int
    end: int
    kind: str
    title: str
    badge: str = ""


PROMPT_CSS = """
<style>
.kv-prompt{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px;line-height:1.45;max-height:480px;overflow:auto;
 border:1px solid #d0d7de;border-radius:6px;padding:8px;background:#fbfbfc}
.kv-prompt mark{border-radius:3px;padding:0 1px}
.kv-prompt mark.field{background:#ffd6e7;outline:1px solid #e040fb}
.kv-prompt mark.candidate{background:#fff1b8;outline:1px solid #e9c46a}
.kv-prompt mark.growth{background:#e3f2e8}
.kv-prompt .cut{color:#e76f51;font-weight:700}
.kv-prompt .gap{color:#888;font-style:italic}
.kv-prompt .badge{font-size:10px;vertical-align:super;color:#6a4c93;font-weight:600}
.kv-turn summary{cursor:pointer;margin:4px 0}
</style>
"""


def _plain(text: str) -> str:
    """Unmarked text, escaped; a stretch longer than MAX_SHOWN_CHARS keeps CONTEXT_CHARS at each end."""
    if len(text) <= MAX_SHOWN_CHARS:
        return html.escape(text)
    hidden = len(text) - 2 * CONTEXT_CHARS
    gap = f'<span class="gap">… {hidden:,} characters not shown …</span>'
    return html.escape(text[:CONTEXT_CHARS]) + gap + html.escape(text[-CONTEXT_CHARS:])


def marked_prompt_html(text: str, marks: Sequence[Mark], element_id: str | None = None) -> str:
    """The rendered prompt as escaped HTML with ``marks`` highlighted (overlapping marks: the earlier one wins);
    long unmarked stretches are cut to their ends."""
    chosen, cursor = [], 0
    for mark in sorted(marks, key=lambda m: (m.start, m.end)):
        if mark.start < cursor or not (0 <= mark.start <= mark.end <= len(text)):
            continue
        chosen.append(mark)
        cursor = mark.end
    parts, cursor = [], 0
    for mark in chosen:
        parts.append(_plain(text[cursor : mark.start]))
        title = html.escape(mark.title, quote=True)
        badge = f'<span class="badge">{html.escape(mark.badge)}</span>' if mark.badge else ""
        if mark.kind == "cut":
            parts.append(f'<span class="cut" title="{title}">▸</span>')
        else:
            kind, shown = html.escape(mark.kind, quote=True), html.escape(text[mark.start : mark.end])
            parts.append(f'<mark class="{kind}" title="{title}" data-kind="{kind}">{shown}</mark>{badge}')
        cursor = mark.end
    parts.append(_plain(text[cursor:]))
    ident = f' id="{html.escape(element_id, quote=True)}"' if element_id else ""
    return f'<div class="kv-prompt"{ident}>{"".join(parts)}</div>'


def turns_html(
    turns: Sequence[tuple[int, str, Sequence[Mark]]],
    open_request: int | None = None,
    empty: str = "one request only: nothing changed between requests",
) -> str:
    """Each audited request's rendered prompt, marked, in a collapsible section (``open_request`` open); ``empty``:
    why there is none (e.g. :func:`no_turns`)."""
    if not turns:
        return PROMPT_CSS + f"<p>{html.escape(empty[:1].upper() + empty[1:])}.</p>"
    legend = (
        '<p><mark class="field" style="background:#ffd6e7">changed field</mark> (hover: old → new) · '
        '<span style="background:#e3f2e8">appended since the previous request</span> · '
        '<b style="color:#e76f51">▸</b> where an exact prefix cache stops reusing</p>'
    )
    sections = []
    for request, text, marks in turns:
        fields = sum(mark.kind == "field" for mark in marks)
        summary = f"Request {request}: {fields} changed field{'s' if fields != 1 else ''}"
        sections.append(
            f'<details class="kv-turn" data-request="{request}"{" open" if request == open_request else ""}>'
            f"<summary>{html.escape(summary)}</summary>{marked_prompt_html(text, marks, f'audit-prompt-{request}')}</details>"
        )
    return PROMPT_CSS + legend + "".join(sections)


def candidates_html(text: str, marks: Sequence[Mark]) -> str:
    """One prompt with its candidate volatile spans highlighted and numbered (the numbers of the choice menu)."""
    if not marks:
        return PROMPT_CSS + "<p>No date, time, id, number or <code>key: value</code> span found: type the text to change instead.</p>"
    note = f"<p>{len(marks)} candidate span{'s' if len(marks) != 1 else ''}: pick one by its number, or type the text to change.</p>"
    return PROMPT_CSS + note + marked_prompt_html(text, marks, "audit-candidates-prompt")


# ---------------------------------------------------------------------------- a log as traffic (``TrafficReport.as_dict()``)
ENGINE_LABELS = {name: LABELS[name] for name in ENGINES}  # the serving engines' short names
NO_SESSION = "(no session key)"
MAX_TABLE_ROWS = 40  # sessions listed in the tab; every one is in the JSON
REUSED = "reused"  # a request with no cause that appends nothing: the same tokens as its match
_CAUSE_ORDER = (*CAUSES, "growth", REUSED)


def session_name(session: str | None) -> str:
    return NO_SESSION if session is None else session


def main_cause(row: RequestRow) -> str:
    """What a request is drawn as: its first cause of a miss in its prompt (a ``CAUSES`` name; the observed gaps are
    marked apart), else ``growth`` when it only appends to its match, else ``reused`` (identical to it)."""
    prompt = [cause for cause in row["causes"] if cause["name"] not in OBSERVED_CAUSES]
    if prompt:
        return prompt[0]["name"]
    return "growth" if row["appended_tokens"] > 0 else REUSED


def cause_words(name: str) -> str:
    """A cause's line as the engine registers it (``causes.CAUSES``); the two drawing-only names said here."""
    extra = {"growth": "only new turns appended to the matched request", REUSED: "the same tokens as the matched request"}
    return CAUSES.get(name) or extra.get(name, name)


def _cause_colours(names: Sequence[str]) -> dict[str, str]:
    ordered = sorted(set(names), key=_CAUSE_ORDER.index)
    fixed = {"new_prefix": "#264653", "growth": "#2a9d8f", REUSED: GREY}
    others = [colour for colour in PALETTE if colour not in fixed.values()]
    rest = [name for name in ordered if name not in fixed]
    return {name: fixed.get(name) or others[rest.index(name) % len(others)] for name in ordered}


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "–"


def _reuse_hover(row: RequestRow) -> str:
    reuse = " · ".join(f"{ENGINE_LABELS[e]} {n:,}" for e, n in row["reused_tokens"].items())
    causes = "<br>".join(f"{safe_label(c['name'])}: {safe_label(c['detail'], 90)}" for c in row["causes"]) or safe_label(
        cause_words(main_cause(row))
    )
    matched = "none" if row["matched_request"] is None else f"request {row['matched_request']}"
    return (
        f"<b>request {row['request']}</b> (line {row['line']}) · {safe_label(session_name(row['session']), 40)}<br>"
        f"{row['tokens']:,} tokens · matched {matched} ({row['common_prefix_tokens']:,} shared)<br>"
        f"reused: {reuse}<br>{causes}"
    )


def session_timeline_figure(data: LogAudit) -> go.Figure:
    """One row per session, its requests along the log, each marker coloured by its first cause of a miss
    (:func:`main_cause`) and sized by its tokens; a red ring marks each request the server served worse than the compared
    engine (``observed_shortfall``)."""
    rows = data["requests"]
    if not rows:
        return message_figure("no request was read: nothing to draw")
    sessions = [session_name(s["session"]) for s in data["sessions"]]
    labels = {name: safe_label(name, 24) for name in sessions}
    figure = go.Figure()
    for name in sessions:
        own = [row for row in rows if session_name(row["session"]) == name]
        figure.add_scatter(
            x=[row["request"] for row in own],
            y=[labels[name]] * len(own),
            mode="lines",
            line={"color": GREY, "width": 1},
            hoverinfo="skip",
            showlegend=False,
        )
    largest = max(row["tokens"] for row in rows)
    by_cause: dict[str, list[RequestRow]] = {}
    for row in rows:
        by_cause.setdefault(main_cause(row), []).append(row)
    colours = _cause_colours(list(by_cause))
    for cause in colours:
        own = by_cause[cause]
        figure.add_scatter(
            x=[row["request"] for row in own],
            y=[labels[session_name(row["session"])] for row in own],
            mode="markers",
            name=safe_label(cause),
            marker={
                "color": colours[cause],
                "size": [8 + 12 * row["tokens"] / largest for row in own],
                "line": {"width": 1, "color": "white"},
            },
            hovertext=[_reuse_hover(row) for row in own],
            hoverinfo="text",
        )
    short = [row for row in rows if observed_gap(row, "observed_shortfall")]
    if short:
        figure.add_scatter(
            x=[row["request"] for row in short],
            y=[labels[session_name(row["session"])] for row in short],
            mode="markers",
            name=f"observed shortfall ({len(short):,})",
            marker={"color": SHORTFALL_COLOUR, "size": 22, "symbol": "circle-open", "line": {"width": 2}},
            hovertext=[_reuse_hover(row) for row in short],
            hoverinfo="text",
        )
    figure.update_layout(
        xaxis=request_axis(rows),
        yaxis={"title": "session", "type": "category", "categoryorder": "array", "categoryarray": [labels[n] for n in reversed(sessions)]},
        height=min(300 + 34 * len(sessions), 900),
        legend={"title": {"text": "cause"}},
    )
    set_title(
        figure,
        "Requests per session, coloured by the cause of their miss",
        "marker size: tokens · hover: the match, each engine's reuse and every cause",
        formats_words(data),
    )
    return figure


PER_REQUEST_UP_TO = 100  # requests drawn one point each; a longer log is drawn in ``BINS`` runs of consecutive requests
BINS = 50


def request_runs(rows: Sequence[RequestRow]) -> list[list[RequestRow]]:
    """The rows one per point (up to ``PER_REQUEST_UP_TO``), else in ``BINS`` runs of consecutive requests."""
    if len(rows) <= PER_REQUEST_UP_TO:
        return [[row] for row in rows]
    size = -(-len(rows) // BINS)
    return [list(rows[start : start + size]) for start in range(0, len(rows), size)]


def _run_x(run: Sequence[RequestRow]) -> float:
    """Where a run is drawn: its middle request."""
    return (run[0]["request"] + run[-1]["request"]) / 2


def _run_name(run: Sequence[RequestRow]) -> str:
    return f"request {run[0]['request']}" if len(run) == 1 else f"requests {run[0]['request']}–{run[-1]['request']}"


def request_axis(rows: Sequence[RequestRow]) -> dict:
    """An x axis of request numbers: whole numbers only (every one up to 20 requests)."""
    return {"title": "request (log order)", "tickformat": "d", **({"dtick": 1} if len(rows) <= 20 else {})}


def engine_reuse_figure(data: LogAudit) -> go.Figure:
    """Per request, the share of its tokens each simulated engine (and hosted provider) serves from its cache, beside the
    share the server reported cached, its shortfalls marked; above ``PER_REQUEST_UP_TO`` requests each point is a run of
    consecutive requests (:func:`request_runs`), so that a long log stays readable."""
    rows = data["requests"]
    if not rows:
        return message_figure("no request was read: nothing to draw")
    engines, runs = data["engines"], request_runs(rows)
    figure = go.Figure()
    for index, engine in enumerate(ENGINE_LABELS):
        total = engines["reused_tokens"][engine]
        shares = [sum(row["reused_tokens"][engine] for row in run) / sum(row["tokens"] for row in run) for run in runs]
        figure.add_scatter(
            x=[_run_x(run) for run in runs],
            y=shares,
            mode="lines+markers",
            name=f"{ENGINE_LABELS[engine]}: {total:,} of {engines['tokens']:,} ({_share(total, engines['tokens'])})",
            line={"color": PALETTE[index], "width": 2, "dash": ("solid", "dash", "dot")[index]},
            marker={"size": 6 if len(runs) == len(rows) else 4},
            hovertext=[
                f"{_run_name(run)}: {ENGINE_LABELS[engine]} reuses {sum(r['reused_tokens'][engine] for r in run):,} of "
                f"{sum(r['tokens'] for r in run):,} ({share:.0%})"
                for run, share in zip(runs, shares)
            ],
            hoverinfo="text",
        )
    _hosted_lines(figure, data)
    _observed_line(figure, data, runs)
    settings = engines["settings"]
    budgets = ", ".join(
        f"{what} {settings[key]:,}" for key, what in (("budget_blocks", "vLLM blocks"), ("budget_tokens", "SGLang tokens")) if settings[key]
    )
    per = "per request" if len(runs) == len(rows) else f"per run of {len(runs[0]):,} requests ({len(rows):,} in all)"
    figure.update_layout(
        xaxis=request_axis(rows),
        yaxis={"title": "tokens reused (share)", "range": [0, 1.05], "tickformat": ".0%"},
        height=460,
        legend=LEGEND_BELOW,
        margin={"b": 120},
    )
    set_title(
        figure,
        f"Tokens each engine reuses, {per}",
        f"{settings['block']}-token blocks · budgets: {budgets or 'unbounded'}"
        + (f" · llama.cpp --cache-reuse {settings['cache_reuse']}" if settings["cache_reuse"] else ""),
        formats_words(data),
    )
    return figure


SHORTFALL_COLOUR = "#d62828"
OBSERVED_COLOUR = "#111111"
PROVIDER_LABELS = {name: LABELS[name] for name in PROVIDERS}  # the hosted providers' short names


def formats_words(data: LogAudit) -> str:
    """The formats the log was read in, with their request counts (escaped for plotly)."""
    read = ", ".join(f"{safe_label(name, 30)} {count:,}" for name, count in data["formats"].items())
    return f"formats read: {read or 'none'}"


def observed_gap(row: RequestRow, name: str) -> int:
    """The tokens of a request's ``observed_shortfall`` or ``observed_excess`` cause (0 without one)."""
    return sum(cause["tokens"] for cause in row["causes"] if cause["name"] == name)


def _observed_line(figure: go.Figure, data: LogAudit, runs: Sequence[Sequence[RequestRow]]) -> None:
    """The share each request's (or run's) server reported cached (a gap where none reported one), and the shortfalls
    marked one by one."""
    rows = data["requests"]
    reporting = [row for row in rows if row.get("observed_cached_tokens") is not None]
    if not reporting:
        return
    observed = data.get("observed") or {}
    tokens, cached = sum(row["tokens"] for row in reporting), sum(row["observed_cached_tokens"] for row in reporting)
    reported = [[row for row in run if row.get("observed_cached_tokens") is not None] for run in runs]
    shares = [sum(r["observed_cached_tokens"] for r in own) / sum(r["tokens"] for r in own) if own else None for own in reported]
    figure.add_scatter(
        x=[_run_x(run) for run in runs],
        y=shares,
        mode="lines+markers",
        connectgaps=False,
        name=f"observed: {cached:,} of {tokens:,} ({_share(cached, tokens)}), {len(reporting):,} of {len(rows):,} requests report it",
        line={"color": OBSERVED_COLOUR, "width": 3},
        marker={"size": 7 if len(runs) == len(rows) else 4},
        hovertext=[
            f"{_run_name(run)}: the server reported {sum(r['observed_cached_tokens'] for r in own) if own else None} of "
            f"{sum(r['tokens'] for r in run):,} cached"
            + ("" if len(own) == len(run) else f" ({len(own):,} of {len(run):,} report a count)")
            for run, own in zip(runs, reported)
        ],
        hoverinfo="text",
    )
    short = [row for row in reporting if observed_gap(row, "observed_shortfall")]
    if short:
        engine = ENGINE_LABELS.get(observed.get("engine", "vllm"), "the engine")
        figure.add_scatter(
            x=[row["request"] for row in short],
            y=[row["observed_cached_tokens"] / row["tokens"] for row in short],
            mode="markers",
            name=f"observed shortfall against {engine}: {counted(len(short), 'request')}",
            marker={"color": SHORTFALL_COLOUR, "size": 14, "symbol": "x"},
            hovertext=[
                "<br>".join(safe_label(c["detail"], 110) for c in row["causes"] if c["name"] == "observed_shortfall") for row in short
            ],
            hoverinfo="text",
        )


def _hosted_lines(figure: go.Figure, data: LogAudit) -> None:
    """Each hosted provider's simulated share on its own requests (in runs, as ``request_runs`` draws a long log)."""
    for index, (provider, label) in enumerate(PROVIDER_LABELS.items()):
        own = [row for row in data["requests"] if provider in (row.get("hosted_reused_tokens") or {})]
        if not own:
            continue
        tokens, reused = sum(row["tokens"] for row in own), sum(row["hosted_reused_tokens"][provider] for row in own)
        runs = request_runs(own)
        figure.add_scatter(
            x=[_run_x(run) for run in runs],
            y=[sum(r["hosted_reused_tokens"][provider] for r in run) / sum(r["tokens"] for r in run) for run in runs],
            mode="lines+markers",
            name=f"{label}: {_share(reused, tokens)} of {counted(len(own), 'request')}",
            line={"color": PALETTE[3 + index], "width": 2, "dash": "dashdot"},
            marker={"size": 6},
            hoverinfo="skip",
        )


def observed_markdown(data: LogAudit) -> str:
    """The observed counts beside the simulation in words: how many requests report one, the hit rates, the share where
    observed equals simulated, the shortfalls and excesses, the fitted cache (with --fit-observed) and the hosted
    providers' engines (empty for a stored result without these keys)."""
    observed, hosted = data.get("observed"), data.get("hosted") or {}
    lines = []
    if observed:
        reporting = observed["requests_with_count"]
        total = reporting + observed["requests_without_count"]
        if not reporting:
            read = ", ".join(f"{markdown_literal(name)} {count:,}" for name, count in data["formats"].items()) or "none"
            lines.append(f"**Observed cached tokens**: none of the {total:,} requests reports one (formats read: {read}).")
        else:
            rates = observed["hit_rate"]
            shown = " · ".join(
                f"{ENGINE_LABELS.get(name) or PROVIDER_LABELS.get(name) or name} {_percent(rate)}" for name, rate in rates.items()
            )
            engine = ENGINE_LABELS.get(observed["engine"], observed["engine"])
            short, excess = observed["shortfalls"], observed["excesses"]
            evidence = observed.get("engine_evidence")
            lines += [
                f"**Observed beside simulated** ({reporting:,} of {total:,} requests report a cached count; compared with {engine}): "
                f"hit rate {shown}",
                *(["", f"Compared with {engine}: {markdown_literal(evidence)}."] if evidence else []),
                *(
                    ["", f"The observed rate is over {markdown_literal(observed['observed_rate_over'])}."]
                    if "observed_rate_over" in observed
                    else []
                ),
                "",
                f"Observed equals {engine} on {observed['equal']:,} of {reporting:,} ({_percent(observed['equal_share'])}); "
                f"**{short['requests']:,} shortfall{'s' if short['requests'] != 1 else ''}** ({short['tokens']:,} tokens) · "
                f"{excess['requests']:,} excess{'es' if excess['requests'] != 1 else ''} "
                f"({excess['tokens']:,} tokens).",
            ]
            fit = observed.get("fit")
            if fit:
                best = fit["best"]
                fitted = ENGINE_LABELS.get(fit.get("engine", ""), "the engine")
                lines.append(
                    f"Best fit of {fitted}'s settings: {fit_setting_words(best)}: {best['matches']:,} of "
                    f"{fit['requests_with_count']:,} exactly ({len(fit['tied'])} tied)."
                )
    if hosted:
        providers = " · ".join(
            f"{PROVIDER_LABELS[name]}: {counted(entry['requests'], 'request')}, hit rate {_percent(entry['hit_rate'])}"
            for name, entry in hosted.items()
            if name in PROVIDER_LABELS
        )
        lines += ["", f"**Hosted APIs**: {providers} ({markdown_literal(TOKENS_NOTE)})."]
    return "\n".join(lines)


FIT_SETTING_WORDS = {  # a fitted setting's value in words, by the key the engine's ``fit_grid`` names it
    "block": lambda value: f"{value}-token blocks",
    "page": lambda value: f"{value}-token pages",
    "budget_tokens": lambda value: "KV budget unbounded" if value is None else f"KV budget {value:,} tokens",
    "slots": lambda value: f"-np {value}",
    "prompt_cache": lambda value: "the server's own slot choice with its RAM prompt cache" if value else "a slot per session",
    "cache_reuse": lambda value: f"--cache-reuse {value}" if value else "--cache-reuse off",
}


def fit_setting_words(setting: dict) -> str:
    """One fitted setting (``observed.fit.best`` or a tied one) in words, whichever engine's settings it names."""
    named = {key: value for key, value in setting.items() if key in FIT_SETTING_WORDS and not (key == "slots" and value is None)}
    return ", ".join(FIT_SETTING_WORDS[key](value) for key, value in named.items())  # slots None: the mode's own


def _percent(rate: float | None) -> str:
    return "–" if rate is None else f"{rate:.0%}"


def traffic_markdown(data: LogAudit) -> str:
    """The log in words and tables: requests, sessions, formats and the lines that gave no request (and why); each
    engine's reuse in total and per session; each cause with the requests and tokens it costs."""
    engines, sessions = data["engines"], data["sessions"]
    tokens = engines["tokens"]
    formats = ", ".join(f"{markdown_literal(name)} {count:,}" for name, count in data["formats"].items()) or "none"
    lines = unmeasured_lines(data)
    lines += [
        f"**{counted(engines['requests'], 'request')}** in **{counted(len(sessions), 'session')}**, "
        # a line can give no request of its own and still be read (an OTel logs batch joined to its spans): each says which
        f"{tokens:,} tokens · formats: {formats} · lines that gave no request of their own: {data['skipped_count']:,}",
        *(f"- {markdown_literal(Skipped(**item).message)}" for item in data["skipped"][:MAX_TABLE_ROWS]),
        "",
        "**Tokens the engines reuse** (simulated, fed the log in order): "
        + " · ".join(
            f"{ENGINE_LABELS[e]} {engines['reused_tokens'][e]:,} ({_share(engines['reused_tokens'][e], tokens)})" for e in ENGINE_LABELS
        ),
        "",
        markdown_literal(replies_sentence(engines)),
        "",
        "**KV budgets** (where each simulated cache evicts):",
        *(f"- {markdown_literal(line)}" for line in budget_lines(engines["budgets"])),
        "",
        f"| session | requests | tokens | tokens reused: {' · '.join(ENGINE_LABELS.values())} |",
        "|---|---:|---:|---|",
    ]
    for summary in sessions[:MAX_TABLE_ROWS]:
        reused = " · ".join(
            f"{summary['reused_tokens'][e]:,} ({_share(summary['reused_tokens'][e], summary['tokens'])})" for e in ENGINE_LABELS
        )
        lines.append(
            f"| {markdown_literal(session_name(summary['session']))} | {summary['requests']:,} | {summary['tokens']:,} | {reused} |"
        )
    if len(sessions) > MAX_TABLE_ROWS:
        lines.append(f"\n{len(sessions) - MAX_TABLE_ROWS:,} more sessions in the JSON.")
    lines += ["", "**Causes of the misses**", "", "| cause | what it means | requests | tokens recomputed |", "|---|---|---:|---:|"]
    misses = {name: entry for name, entry in data["causes"].items() if name not in OBSERVED_CAUSES}  # the gaps: their own section
    for name, entry in sorted(misses.items(), key=lambda item: -item[1]["tokens"]):
        counts = f"{entry['requests']:,} | {entry['tokens']:,}"
        lines.append(f"| {markdown_literal(name)} | {markdown_literal(cause_words(name))} | {counts} |")
    if not misses:
        lines.append("| none | every request only grows the one it matches | | |")
    observed = observed_markdown(data)
    return "\n".join([*lines, *(["", observed] if observed else [])])


def _fidelity_words(fidelity: dict[str, dict[str, Any]]) -> str:  # measure.traffic.RepairFidelity per repair, in JSON
    """Per repair over a group's measured turns: its computed share and how often it was recommended, and for the others
    than recompute (the exact reference) their worst KL and least agreement; the repairs that never applied, named last."""
    parts, never = [], []
    for name, entry in fidelity.items():
        if not entry["applicable"]:
            never.append(name)
            continue
        worst = "" if name == "recompute" else f"KL ≤ {entry['worst_kl']:.2g}, ≥ {entry['min_agreement']:.0%} agreeing, "
        chosen = f"recommended {entry['recommended']}/{entry['measured']}" if entry["recommended"] else "never recommended"
        parts.append(f"{name}: {worst}{entry['mean_computed_share']:.0%} computed, {chosen}")
    return markdown_literal("; ".join(parts + ([f"not applicable: {', '.join(never)}"] if never else [])))


def unmeasured_lines(data: AuditJSON) -> list[str]:
    """Why no turn is measured, said first: the model pass was cancelled, or is still measuring (the token pass shown
    meanwhile)."""
    if data.get("cancelled"):
        return [f"**Cancelled**: {markdown_literal(data['cancelled'])}.", ""]
    if data.get("pending"):
        return [f"**Measuring**: {markdown_literal(data['pending'])}.", ""]
    return []


def no_turns(data: AuditJSON, what: str) -> str:
    """Why a figure of the measured turns is empty: the token pass alone was asked for, one request only, or no turn
    could be measured."""
    requests = len(data.get("requests") or ())
    if data.get("cancelled"):
        return f"the model pass was cancelled, and a cancelled pass keeps no measured turn, so {what}"
    if data.get("pending"):
        return f"the model pass is measuring the sampled turns, so {what} yet"
    if data.get("sample") == 0 and requests > 1:
        return f"the token pass only (--sample 0): no turn was measured with the model, so {what}"
    if requests <= 1:
        return f"one request only: there is no earlier request to reuse, so {what}"
    return f"no turn could be measured (each group's reason is in the table), so {what}"


def groups_markdown(data: LogAudit) -> str:
    """The change signatures: each group's count, share of the log's tokens, the turns measured (or why none was) and
    its repairs' fidelity over them; whether the model ran on a sample, and ``sample_bound`` (where the app put it):
    how the server lowered the sample."""
    groups = data["groups"]
    measured = sum(len(group["measured"]) for group in groups)
    signatures = f"**{len(groups):,} change signature{'s' if len(groups) != 1 else ''}**"
    if data.get("cancelled"):
        head = f"{signatures}; the model pass was cancelled: it keeps no measured turn (the line above says how far it went)."
    elif data.get("pending"):
        head = f"{signatures}; the model pass is measuring the sampled turns now: their fidelity follows when it ends."
    elif data["sample"] == 0:
        head = f"{signatures}; the token pass only (--sample 0): no turn was measured with the model."
    else:
        head = (
            f"{signatures}; the model measured up to {data['sample']} turn{'s' if data['sample'] != 1 else ''} of each "
            f"({measured:,} in all)" + (": **sampled**, not every turn was measured." if data["sampled"] else ": every measurable turn.")
        )
    bound = data.get("sample_bound")
    lines = [
        head + (f" **{markdown_literal(bound)}**." if bound else ""),
        "",
        "| signature | n | tokens | measured | repairs' fidelity |",
        "|---|---:|---:|---|---|",
    ]
    for group in groups:
        picked = ", ".join(f"r{index}" for index in group["measured"])
        measured_words = (
            f"{picked} ({len(group['measured'])} of {group['measurable']})" if picked else markdown_literal(group["reason"] or "")
        )
        lines.append(
            f"| {markdown_literal(group['signature'])} | {group['count']:,} | {group['token_share']:.0%} | {measured_words} | "
            f"{_fidelity_words(group['fidelity']) or '–'} |"
        )
    return "\n".join(lines)
