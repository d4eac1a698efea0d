"""Audit figures and views from dictionaries shaped like ``AuditReport.as_dict()`` and the audit benchmark's JSON: the
numbers drawn are the numbers given, markers say within or outside the threshold, and every user string is escaped."""

from __future__ import annotations

import copy

import pytest

from kvscope.engine import CacheSettings, budgets
from kvscope.viz.audit import (
    ENGINE_LABELS,
    KL_FLOOR,
    NO_SESSION,
    Mark,
    candidates_html,
    engine_reuse_figure,
    fidelity_cost_figure,
    fit_setting_words,
    groups_markdown,
    marked_prompt_html,
    recommendations_markdown,
    reuse_timeline_figure,
    session_timeline_figure,
    traffic_markdown,
    turns_html,
)
from kvscope.viz.benchmarks import audit_benchmark_figure
from kvscope.viz.common import markdown_literal


def _repair(reused, computed, kl, agreement, ms, top1=True):
    return {
        "applicable": True,
        "reused_tokens": reused,
        "computed_tokens": computed,
        "ttft_ms": ms,
        "ttft_ratio": round(100.0 / ms, 3),
        "kl": kl,
        "top1_agree": top1,
        "top5_overlap": 1.0,
        "generation_agreement": agreement,
        "generated_common_prefix": 4,
    }


NOT_APPLICABLE = {"applicable": False, "reason": "no field changed"}
DATA = {
    "model": "tiny<b>",
    "dtype": "float32",
    "threshold": 0.05,
    "min_agreement": 0.9,
    "generated_tokens": 4,
    "repairs": ["recompute", "field_only"],
    "grain": None,
    "turns": [
        {"request": 1, "tokens": 100, "fields": [], "repairs": {}, "recommendation": None},
        {
            "request": 2,
            "tokens": 100,
            "common_prefix_tokens": 20,
            "block_prefix_tokens": 16,
            "appended_tokens": 0,
            "fields": [{"name": "time", "old": "09:41", "new": "<i>09:42</i>", "start": 20, "end": 23}],
            "full_ttft_ms": 100.0,
            "repairs": {"recompute": _repair(20, 80, 0.0, 1.0, 80.0), "field_only": _repair(97, 3, 0.2, 0.5, 10.0)},
            "recommendation": {"repair": "recompute", "reason": "field_only drifts <past>"},
        },
        {
            "request": 3,
            "tokens": 120,
            "common_prefix_tokens": 100,
            "block_prefix_tokens": 96,
            "appended_tokens": 20,
            "fields": [],
            "full_ttft_ms": 110.0,
            "repairs": {"recompute": _repair(100, 20, 1e-8, 1.0, 20.0), "field_only": NOT_APPLICABLE},
            "recommendation": {"repair": "recompute", "reason": "only growth"},
        },
    ],
}


def test_timeline_draws_each_repairs_reused_fraction_with_gaps_and_threshold_markers():
    figure = reuse_timeline_figure(DATA)
    traces = {trace.name: trace for trace in figure.data}
    assert list(traces["recompute (exact prefix)"].y) == [0.2, 100 / 120] and list(traces["recompute (exact prefix)"].x) == [1.975, 2.975]
    assert list(traces["field_only"].y) == [0.97, None]  # not applicable on a growth-only turn
    assert list(traces["field_only"].marker.symbol) == ["circle-open", "circle-open"]  # KL 0.2 > 0.05
    assert list(traces["recompute (exact prefix)"].marker.symbol) == ["circle", "circle"]
    assert list(traces["16-token blocks (vLLM)"].y) == [0.16, 0.8]
    assert [a.text for a in figure.layout.annotations] == ["time"]


def test_fidelity_against_cost_on_either_axis():
    figure = fidelity_cost_figure(DATA)
    traces = {trace.name: trace for trace in figure.data}
    assert list(traces["recompute"].x) == [80.0, 100 * 20 / 120] and list(traces["recompute"].y) == [KL_FLOOR, 1e-8]
    assert list(traces["field_only"].x) == [3.0]
    (labels,) = [trace for trace in figure.data if trace.text]  # each place labelled once, with its requests
    assert list(zip(labels.x, labels.y, labels.text)) == [(80.0, KL_FLOOR, "r2"), (100 * 20 / 120, 1e-8, "r3"), (3.0, 0.2, "r2")]
    assert figure.layout.shapes[0].y0 == 0.05
    by_speed = fidelity_cost_figure(DATA, "ttft", "agreement")
    assert list({t.name: t for t in by_speed.data}["field_only"].x) == [10.0] and by_speed.layout.shapes[0].y0 == 0.9
    with pytest.raises(ValueError, match="axes"):
        fidelity_cost_figure(DATA, "cost", "kl")


def test_repairs_on_one_spot_share_one_label_naming_each_request():
    """Two turns whose repairs land on one place (here field_only and erratum of r2 and r3 alike): one label, "r2·r3", not
    four stacked into one glyph; and points within one decade still get x tick labels (decade ticks would label none)."""
    turns = copy.deepcopy(DATA["turns"])
    for turn in turns[1:]:
        turn["tokens"] = turns[1]["tokens"]
        turn["repairs"] = {name: dict(DATA["turns"][1]["repairs"]["field_only"]) for name in ("field_only", "erratum")}
    figure = fidelity_cost_figure({**DATA, "repairs": ["field_only", "erratum"], "turns": turns})
    (labels,) = [trace for trace in figure.data if trace.text]
    assert list(labels.text) == ["r2·r3"] and list(figure.layout.xaxis.ticktext) == ["3%"]  # within a decade: its own ticks


def test_recommendations_escape_markdown_and_html():
    text = recommendations_markdown(DATA)
    assert "tiny&lt;b&gt;" in text and "&lt;i&gt;09:42&lt;/i&gt;" in text and "drifts &lt;past&gt;" in text
    assert "**Recommended: recompute**" in text and "a prefix cache reuses 20 of 100 tokens (20%; 16 in 16-token blocks)" in text
    assert "fields changed: none (only new turns appended)" in text


def test_marked_prompt_escapes_text_and_titles_and_cuts_long_unmarked_stretches():
    text = "<script>alert(1)</script> " + "x" * 2000 + " time: 09:42 end"
    at = text.index("09:42")
    shown = marked_prompt_html(text, [Mark(at, at + 5, "field", 'time: "09:41" → <b>', "time"), Mark(at, at, "cut", "stop")])
    assert "<script>" not in shown and "&lt;script&gt;" in shown
    assert 'title="time: &quot;09:41&quot; → &lt;b&gt;"' in shown and '<mark class="field"' in shown
    assert "characters not shown" in shown and len(shown) < 1500
    assert shown.index('class="cut"') < shown.index('<mark class="field"')
    assert "&lt;script&gt;" in candidates_html(text, [Mark(0, 8, "candidate", "1", "1")])
    assert "No date, time" in candidates_html(text, [])
    sections = turns_html([(2, text, [Mark(at, at + 5, "field", "t")]), (3, "plain", [])], open_request=2)
    assert sections.count("<details") == 2 and 'data-request="2" open' in sections and 'data-request="3">' in sections


def test_audit_benchmark_figure_draws_reuse_ttft_and_kl_per_repair():
    data = {**DATA, "model": "embedded", "device": "cpu", "log": "coding_agent", "reps": 3, "summary": None}
    figure = audit_benchmark_figure(data)
    names = [trace.name for trace in figure.data]
    assert names.count("field_only") == 3 and names.count("recompute") == 3 and "clean prefill" in names
    ttft = [trace for trace in figure.data if trace.name == "field_only" and trace.xaxis == "x2"][0]
    assert list(ttft.y) == [10.0, None]
    assert "Audit of coding_agent" in figure.layout.title.text and "measured on embedded, cpu" in figure.layout.title.text


def _row(request, session, tokens, causes=(), appended=0, reused=(0, 0, 0), matched=None):
    return {
        "request": request,
        "line": request,
        "session": session,
        "tokens": tokens,
        "matched_request": matched,
        "common_prefix_tokens": reused[1],
        "appended_tokens": appended,
        "causes": [{"name": name, "field": None, "detail": f"{name} <detail>", "tokens": 5} for name in causes],
        "reused_tokens": dict(zip(("vllm", "sglang", "llama_cpp"), reused)),
    }


ROWS = [
    _row(1, "a<b>", 100, ["new_prefix"]),
    _row(2, None, 50, ["new_prefix"]),
    _row(3, "a<b>", 120, ["clock", "block_straddle"], 20, (64, 70, 70), 1),
    _row(4, None, 60, [], 10, (48, 50, 50), 2),
    _row(5, "a<b>", 120, [], 0, (112, 119, 119), 3),
]
TRAFFIC = {
    "formats": {"openai_chat": 5},
    "skipped": [{"line": 6, "key": "", "reason": "is not JSON: Expecting value (column 1)"}],
    "skipped_count": 1,
    "engines": {
        "settings": {"block": 16, "budget_blocks": 4, "budget_tokens": None, "slots": None, "cache_reuse": 0},
        "budgets": [budget.as_dict() for budget in budgets(CacheSettings(budget_blocks=4))],
        "requests": 5,
        "tokens": 450,
        "reused_tokens": {"vllm": 224, "sglang": 239, "llama_cpp": 239},
    },
    "sessions": [
        {"session": "a<b>", "requests": 3, "tokens": 340, "reused_tokens": {"vllm": 176, "sglang": 189, "llama_cpp": 189}},
        {"session": None, "requests": 2, "tokens": 110, "reused_tokens": {"vllm": 48, "sglang": 50, "llama_cpp": 50}},
    ],
    "causes": {"new_prefix": {"requests": 2, "occurrences": 2, "tokens": 150}, "clock": {"requests": 1, "occurrences": 1, "tokens": 5}},
    "requests": ROWS,
    "sample": 1,
    "sampled": True,
    "sample_bound": "this server (public profile) measures at most 8 turns of a log: --sample lowered from 3 to 1",
    "groups": [
        {
            "signature": "block_straddle + clock:current_time + growth",
            "count": 1,
            "token_share": 0.2667,
            "requests": [3],
            "measurable": 1,
            "measured": [3],
            "reason": None,
            "fidelity": {
                "field_only": {
                    "measured": 1,
                    "applicable": 1,
                    "recommended": 1,
                    "worst_kl": 0.002,
                    "min_agreement": 0.75,
                    "mean_computed_share": 0.1,
                }
            },
        },
        {
            "signature": "new_prefix",
            "count": 2,
            "token_share": 0.3333,
            "requests": [1, 2],
            "measurable": 0,
            "measured": [],
            "reason": "not measured: a cold prefill has nothing cached to repair",
            "fidelity": {},
        },
    ],
}


def test_session_timeline_draws_one_row_per_session_and_one_trace_per_cause():
    figure = session_timeline_figure(TRAFFIC)
    markers = {trace.name: trace for trace in figure.data if trace.mode == "markers"}
    assert list(markers) == ["new_prefix", "clock", "growth", "reused"]  # the registry's order, then growth and reused
    assert list(markers["new_prefix"].x) == [1, 2] and list(markers["new_prefix"].y) == ["a&lt;b&gt;", NO_SESSION]
    assert list(markers["clock"].x) == [3] and list(markers["growth"].x) == [4] and list(markers["reused"].x) == [5]
    assert list(markers["new_prefix"].marker.size) == [8 + 12 * 100 / 120, 8 + 12 * 50 / 120]  # sized by tokens
    lines = [trace for trace in figure.data if trace.mode == "lines"]
    assert [(list(t.x), t.y[0]) for t in lines] == [([1, 3, 5], "a&lt;b&gt;"), ([2, 4], NO_SESSION)]
    assert list(figure.layout.yaxis.categoryarray) == [NO_SESSION, "a&lt;b&gt;"]  # the first session on top
    hover = markers["clock"].hovertext[0]
    assert "vLLM 64 · SGLang 70 · llama.cpp 70" in hover and "clock &lt;detail&gt;" in hover and "<detail>" not in hover
    assert "nothing to draw" in session_timeline_figure({**TRAFFIC, "requests": []}).layout.annotations[0].text


def test_engine_reuse_figure_draws_each_engines_share_per_request_and_its_total():
    figure = engine_reuse_figure(TRAFFIC)
    traces = {trace.name.split(":")[0]: trace for trace in figure.data}
    assert list(traces) == ["vLLM", "SGLang", "llama.cpp"]
    assert list(traces["vLLM"].y) == [0, 0, 64 / 120, 48 / 60, 112 / 120] and list(traces["SGLang"].x) == [1, 2, 3, 4, 5]
    assert traces["SGLang"].name == "SGLang: 239 of 450 (53%)"
    assert "budgets: vLLM blocks 4" in figure.layout.title.text


def test_traffic_and_groups_markdown_name_sessions_causes_and_the_sample_escaped():
    text = traffic_markdown(TRAFFIC)
    assert "**5 requests** in **2 sessions**, 450 tokens" in text and "lines that gave no request of their own: 1" in text
    assert (
        "line 6 is not JSON" in text
        and "| a&lt;b&gt; | 3 | 340 | 176 (52%) · 189 (56%) · 189 (56%) |" in text
        and f"| {markdown_literal(NO_SESSION)} | 2 | 110 |" in text
    )
    assert "<b>" not in text
    assert "| clock | a clock or date changed | 1 | 5 |" in text  # the engine's own words for the cause
    assert text.index("new\\_prefix |") < text.index("| clock |")  # most tokens first
    groups = groups_markdown(TRAFFIC)
    assert "**2 change signatures**; the model measured up to 1 turn of each (1 in all): **sampled**" in groups
    assert "\\-\\-sample lowered from 3 to 1" in groups and "| r3 (1 of 1) |" in groups
    assert "field\\_only: KL ≤ 0\\.002, ≥ 75% agreeing, 10% computed, recommended 1/1" in groups
    assert "not measured: a cold prefill has nothing cached to repair" in groups
    never = groups_markdown({**TRAFFIC, "groups": [{**TRAFFIC["groups"][0], "fidelity": {"hoist": {"applicable": 0}}}]})
    assert "| not applicable: hoist |" in never


def test_a_token_pass_only_audit_says_so_rather_than_one_request_only():
    token_pass = {**DATA, **TRAFFIC, "sample": 0, "sampled": False, "turns": []}
    assert "the token pass only (--sample 0): no turn was measured with the model." in groups_markdown(token_pass)
    assert "measured up to 0" not in groups_markdown(token_pass)
    for figure in (reuse_timeline_figure(token_pass), fidelity_cost_figure(token_pass)):
        words = figure.layout.annotations[0].text
        assert "token pass only" in words and "one request only" not in words
    alone = {**token_pass, "requests": TRAFFIC["requests"][:1]}
    assert "one request only" in reuse_timeline_figure(alone).layout.annotations[0].text


def _observed_traffic() -> dict:
    """TRAFFIC with observed counts (request 2 reports none; request 4 is a shortfall of 32 tokens against vLLM), a
    fit, one request to OpenAI, and a format name to escape."""
    counts = {1: 0, 2: None, 3: 64, 4: 16, 5: 112}
    rows = []
    for row in ROWS:
        row = {**row, "observed_cached_tokens": counts[row["request"]], "hosted_reused_tokens": {}}
        if row["request"] == 4:
            row["causes"] = [{"name": "observed_shortfall", "field": None, "detail": "observed 16 <x>: 32 fewer", "tokens": 32}]
        if row["request"] == 5:
            row["hosted_reused_tokens"] = {"openai": 0}
        rows.append(row)
    observed = {
        "engine": "vllm",
        "requests_with_count": 4,
        "requests_without_count": 1,
        "tokens": 400,
        "observed_tokens": 192,
        "hit_rate": {"observed": 0.48, "vllm": 0.56, "sglang": 0.5975, "llama_cpp": 0.5975},
        "equal": 3,
        "equal_share": 0.75,
        "shortfalls": {"requests": 1, "tokens": 32},
        "excesses": {"requests": 0, "tokens": 0},
        "fit": {
            "engine": "vllm",
            "requests_with_count": 4,
            "working_set_tokens": 300,
            "best": {"block": 32, "budget_tokens": 150, "matches": 4, "share": 1.0},
            "tied": [{"block": 32, "budget_tokens": 150, "matches": 4}],
            "tried": [],
        },
    }
    hosted = {"openai": {"rule": "", "requests": 1, "tokens": 120, "reused_tokens": 0, "hit_rate": 0.0}, "note": "n"}
    return {**TRAFFIC, "formats": {"litellm<x>": 5}, "requests": rows, "observed": observed, "hosted": hosted}


def test_the_timelines_draw_the_observed_line_mark_the_shortfalls_and_name_the_formats():
    data = _observed_traffic()
    sessions = session_timeline_figure(data)
    ring = [trace for trace in sessions.data if trace.name == "observed shortfall (1)"]
    assert len(ring) == 1 and list(ring[0].x) == [4] and list(ring[0].y) == [NO_SESSION]
    assert {trace.name for trace in sessions.data if trace.mode == "markers"} >= {"growth"}  # request 4 still drawn by its prompt
    assert "formats read: litellm&lt;x&gt; 5" in sessions.layout.title.text
    engines = engine_reuse_figure(data)
    traces = {trace.name.split(":")[0]: trace for trace in engines.data}
    observed = traces["observed"]
    assert list(observed.y) == [0.0, None, 64 / 120, 16 / 60, 112 / 120] and observed.connectgaps is False
    assert observed.name == "observed: 192 of 400 (48%), 4 of 5 requests report it"
    assert (
        list(traces["observed shortfall against vLLM"].x) == [4] and "&lt;x&gt;" in traces["observed shortfall against vLLM"].hovertext[0]
    )
    assert list(traces["OpenAI (simulated)"].x) == [5]
    assert "formats read: litellm&lt;x&gt; 5" in engines.layout.title.text
    text = traffic_markdown(data)
    assert "(4 of 5 requests report a cached count; compared with vLLM): hit rate observed 48% · vLLM 56% · SGLang 60%" in text
    assert "Observed equals vLLM on 3 of 4 (75%); **1 shortfall** (32 tokens) · 0 excesses (0 tokens)." in text
    assert "Best fit of vLLM's settings: 32-token blocks, KV budget 150 tokens: 4 of 4 exactly (1 tied)." in text
    assert "**Hosted APIs**: OpenAI (simulated): 1 request, hit rate 0%" in text
    none = traffic_markdown({**data, "observed": {**data["observed"], "requests_with_count": 0, "requests_without_count": 5}})
    assert "none of the 5 requests reports one (formats read: litellm&lt;x&gt; 5)" in none
    assert "observed" not in {trace.name.split(":")[0] for trace in engine_reuse_figure(TRAFFIC).data}  # a stored result without counts


def _long_traffic(requests: int) -> dict:
    """TRAFFIC stretched to ``requests`` rows: each reuses half of its 100 tokens on every engine, the server a quarter."""
    rows = [
        {
            **TRAFFIC["requests"][0],
            "request": n,
            "tokens": 100,
            "reused_tokens": {e: 50 for e in ENGINE_LABELS},
            "observed_cached_tokens": 25,
        }
        for n in range(1, requests + 1)
    ]
    engines = {
        **TRAFFIC["engines"],
        "requests": requests,
        "tokens": 100 * requests,
        "reused_tokens": {e: 50 * requests for e in ENGINE_LABELS},
    }
    return {**TRAFFIC, "requests": rows, "engines": engines, "observed": None}


def test_a_long_log_is_drawn_in_runs_of_requests_and_a_short_one_per_request_on_whole_numbers():
    figure = engine_reuse_figure(_long_traffic(300))
    traces = {trace.name.split(":")[0]: trace for trace in figure.data}
    assert len(traces["vLLM"].x) == 50 and list(traces["vLLM"].y) == [0.5] * 50 and list(traces["observed"].y) == [0.25] * 50
    assert traces["vLLM"].x[0] == 3.5 and traces["vLLM"].hovertext[0] == "requests 1–6: vLLM reuses 300 of 600 (50%)"
    assert "per run of 6 requests (300 in all)" in figure.layout.title.text and figure.layout.xaxis.tickformat == "d"
    short = engine_reuse_figure(TRAFFIC)
    assert short.layout.xaxis.dtick == 1 and "per request" in short.layout.title.text
    assert session_timeline_figure(TRAFFIC).layout.xaxis.dtick == 1


def test_a_cancelled_model_pass_heads_the_groups():
    head = groups_markdown({**TRAFFIC, "cancelled": "the model pass was cancelled after 1 of 8 steps"}).split("\n")[0]
    assert head.startswith("**2 change signatures**; the model pass was cancelled: it keeps no measured turn")


def test_a_cancelled_audit_says_first_what_it_kept():
    text = traffic_markdown({**TRAFFIC, "cancelled": "the model pass was cancelled after 1 of 8 steps"})
    assert text.startswith("**Cancelled**: the model pass was cancelled after 1 of 8 steps.\n\n**5 requests**")
    assert "Cancelled" not in traffic_markdown(TRAFFIC)


def test_a_cancelled_model_pass_is_said_before_the_recommendations():
    cancelled = {**DATA, "cancelled": "the model pass was cancelled after 1 of 8 steps"}
    text = recommendations_markdown(cancelled)
    assert text.startswith("**Cancelled**: the model pass was cancelled after 1 of 8 steps.\n\n**")
    assert text.split("\n\n", 1)[1] == recommendations_markdown(DATA)
    empty = fidelity_cost_figure({**cancelled, "turns": DATA["turns"][:1]})
    assert "a cancelled pass keeps no measured turn" in empty.layout.annotations[0].text


def test_a_fitted_setting_reads_in_words_for_each_engine():
    assert fit_setting_words({"block": 32, "budget_tokens": None, "matches": 4}) == "32-token blocks, KV budget unbounded"
    assert fit_setting_words({"page": 16, "budget_tokens": 1200}) == "16-token pages, KV budget 1,200 tokens"
    assert fit_setting_words({"slots": None, "prompt_cache": True, "cache_reuse": 0}) == (
        "the server's own slot choice with its RAM prompt cache, --cache-reuse off"
    )
    assert fit_setting_words({"slots": 2, "prompt_cache": False, "cache_reuse": 64}) == "-np 2, a slot per session, --cache-reuse 64"
