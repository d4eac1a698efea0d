"""Audit figures and views from dictionaries shaped like ``AuditReport.as_dict()`` and the audit benchmark's JSON: the
numbers drawn are the numbers given, markers say within or outside the threshold, and every user string is escaped."""

from __future__ import annotations

import pytest

from viz.audit import (
    KL_FLOOR,
    Mark,
    candidates_html,
    fidelity_cost_figure,
    marked_prompt_html,
    recommendations_markdown,
    reuse_timeline_figure,
    turns_html,
)
from viz.benchmarks import audit_benchmark_figure


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
    "repairs": ["recompute", "in_place"],
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
            "repairs": {"recompute": _repair(20, 80, 0.0, 1.0, 80.0), "in_place": _repair(97, 3, 0.2, 0.5, 10.0)},
            "recommendation": {"repair": "recompute", "reason": "in_place drifts <past>"},
        },
        {
            "request": 3,
            "tokens": 120,
            "common_prefix_tokens": 100,
            "block_prefix_tokens": 96,
            "appended_tokens": 20,
            "fields": [],
            "full_ttft_ms": 110.0,
            "repairs": {"recompute": _repair(100, 20, 1e-8, 1.0, 20.0), "in_place": NOT_APPLICABLE},
            "recommendation": {"repair": "recompute", "reason": "only growth"},
        },
    ],
}


def test_timeline_draws_each_repairs_reused_fraction_with_gaps_and_threshold_markers():
    figure = reuse_timeline_figure(DATA)
    traces = {trace.name: trace for trace in figure.data}
    assert list(traces["recompute (exact prefix)"].y) == [0.2, 100 / 120] and list(traces["recompute (exact prefix)"].x) == [1.975, 2.975]
    assert list(traces["in_place"].y) == [0.97, None]  # not applicable on a growth-only turn
    assert list(traces["in_place"].marker.symbol) == ["circle-open", "circle-open"]  # KL 0.2 > 0.05
    assert list(traces["recompute (exact prefix)"].marker.symbol) == ["circle", "circle"]
    assert list(traces["16-token blocks (vLLM)"].y) == [0.16, 0.8]
    assert [a.text for a in figure.layout.annotations] == ["time"]


def test_fidelity_against_cost_on_either_axis():
    figure = fidelity_cost_figure(DATA)
    traces = {trace.name: trace for trace in figure.data}
    assert list(traces["recompute"].x) == [80.0, 100 * 20 / 120] and list(traces["recompute"].y) == [KL_FLOOR, 1e-8]
    assert list(traces["in_place"].x) == [3.0] and list(traces["in_place"].text) == ["r2"]
    assert figure.layout.shapes[0].y0 == 0.05
    by_speed = fidelity_cost_figure(DATA, "ttft", "agreement")
    assert list({t.name: t for t in by_speed.data}["in_place"].x) == [10.0] and by_speed.layout.shapes[0].y0 == 0.9
    with pytest.raises(ValueError, match="axes"):
        fidelity_cost_figure(DATA, "cost", "kl")


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
    assert names.count("in_place") == 3 and names.count("recompute") == 3 and "clean prefill" in names
    ttft = [trace for trace in figure.data if trace.name == "in_place" and trace.xaxis == "x2"][0]
    assert list(ttft.y) == [10.0, None]
    assert "Audit of coding_agent" in figure.layout.title.text and "measured on embedded, cpu" in figure.layout.title.text
