"""Benchmark figures from result dictionaries shaped like the JSON files the scripts write."""

import json
from pathlib import Path

import pytest

from kvscope.viz.benchmarks import (
    audit_cli_figure,
    cache_reuse_figure,
    chat_replay_figure,
    edit_latency_figure,
    forward_paths_figure,
    greedy_lookup_figure,
    prefill_figure,
    serving_figure,
    ttft_figure,
)
from kvscope.viz.common import figure_label
from kvscope.viz.results import result_figures


def test_edit_latency_one_line_per_strategy_with_gaps_for_not_applicable():
    data = {
        "model": "tiny",
        "device": "cpu",
        "rows": [
            {"context_tokens": 1024, "ms": {"field_only": None, "erratum": 20.0, "oracle": 400.0}},
            {"context_tokens": 256, "ms": {"field_only": 5.0, "erratum": 10.0, "oracle": 100.0}},
        ],
    }
    figure = edit_latency_figure(data)
    assert [trace.name for trace in figure.data] == ["field_only", "erratum", "full recompute (oracle)"]
    assert list(figure.data[0].x) == [256, 1024] and list(figure.data[0].y) == [5.0, None]
    assert figure.layout.xaxis.type == figure.layout.yaxis.type == "log"
    assert "measured on tiny, cpu" in figure.layout.title.text


def test_prefill_times_and_ratio():
    data = {"rows": [{"tokens": 512, "prefill_ms": 40.0, "read_ms": 4.0}, {"tokens": 256, "prefill_ms": 20.0, "read_ms": 5.0}]}
    prefill, read, ratio = prefill_figure(data).data
    assert list(prefill.x) == [256, 512] and list(prefill.y) == [20.0, 40.0] and list(read.y) == [5.0, 4.0]
    assert list(ratio.y) == pytest.approx([4.0, 10.0]) and ratio.type == "bar"


def test_serving_per_variant_ttft_quantiles_throughput_hit_rate_and_accuracy():
    runs = [
        {
            "variant": v,
            "offered_rps": rps,
            "completed": 30,
            "ttft_p50_ms": rps * 10 + i,
            "ttft_p90_ms": rps * 20 + i,
            "throughput_rps": rps * 0.9,
            "prefix_hit_rate": 0.8 - i * 0.5,
            "accuracy": 1.0 - i * 0.25,
        }
        for i, v in enumerate(["erratum", "in_prefix"])
        for rps in (4, 1, 2)
    ]
    figure = serving_figure({"engine": "vllm", "scenario": "Loan <b>", "policy_tokens": 2028, "runs": runs})
    assert len(figure.data) == 2 * 5
    p50, p90 = figure.data[0], figure.data[1]
    assert list(p50.x) == [1, 2, 4] and list(p50.y) == [10, 20, 40] and list(p90.y) == [20, 40, 80]
    assert p90.line.dash == "dash" and p50.line.color == p90.line.color and list(p50.customdata) == [30, 30, 30]
    hit = [trace for trace in figure.data if trace.xaxis == "x3"]
    assert [list(t.y) for t in hit] == [[0.8] * 3, [pytest.approx(0.3)] * 3]
    accuracy = [trace for trace in figure.data if trace.xaxis == "x4"]
    assert [list(t.y) for t in accuracy] == [[1.0] * 3, [0.75] * 3]
    assert figure.layout.xaxis.type == "log" and figure.layout.yaxis.type == "log"
    title = figure.layout.title.text
    assert title.startswith("Serving: erratum vs in_prefix on vllm (2,028 tokens)") and "Loan &lt;b&gt;, 30 completed" in title
    json.loads(figure.to_json())
    runs[0].update(prefix_hit_rate=None, ttft_p90_ms=None)  # the script writes None where the server reports nothing
    assert None in serving_figure({"runs": runs}).data[1].y
    for run in runs:
        del run["accuracy"]  # a result from before accuracy was measured
    assert all(y is None for trace in serving_figure({"runs": runs}).data if trace.xaxis == "x4" for y in trace.y)


def _served(ratio: float, hits: tuple[float, float], block: int | None = None) -> dict:
    summary = {"offered_rps": 1.5, "erratum_prefix_hit_rate": hits[0], "in_prefix_prefix_hit_rate": hits[1]}
    runs = [{"variant": v, "offered_rps": 1.5, "completed": 32, "ttft_p50_ms": 1.0, "ttft_p90_ms": 2.0} for v in ("erratum", "in_prefix")]
    settings = {"block_size": block} if block else {"server": "llama-server"}
    return {"workload": "edit", "policy_tokens": 2028, "engine_settings": settings, "runs": runs,
            "summary": summary | {"p90_ttft_ratio_in_prefix_over_erratum": ratio}}  # fmt: skip


def test_serving_engines_side_by_side_give_each_results_hit_rates_and_p90_ratio_before_their_own_figures():
    results = {
        "prefill-x": {"rows": [{"tokens": 256, "prefill_ms": 20.0, "read_ms": 5.0}]},
        "serving-llama-cpp": _served(53.6, (0.985, 0.016)),
        "serving-llama-cpp-composed": {
            "workload": "composed",
            "runs": [{"variant": "prefix_only", "offered_rps": 0.2, "ttft_p50_ms": 1.0, "ttft_p90_ms": 2.0}],
        },
        "serving-vllm": _served(12.0, (0.96, 0.07), block=32),
    }
    figures = result_figures(results)
    titles = [figure.layout.title.text for figure in figures]
    assert len(figures) == 5 and titles[1].startswith("Serving engines side by side")
    assert [title.startswith("Serving:") for title in titles[2:]] == [True] * 3
    erratum, in_prefix, ratio = figures[1].data
    assert list(erratum.x) == ["llama-cpp<br>2,028 tok", "vllm<br>block 32 · 2,028 tok"]
    assert list(erratum.y) == [0.985, 0.96] and list(in_prefix.y) == [0.016, 0.07]
    assert list(ratio.y) == [53.6, 12.0] and list(ratio.text) == ["×53.6 at 1.5 req/s", "×12 at 1.5 req/s"]
    assert len(result_figures({"serving-llama-cpp": results["serving-llama-cpp"]})) == 1  # one engine: no comparison


def test_ttft_figures_of_two_scenarios_have_distinct_titles_naming_what_follows_the_skill():
    rows = [{"skill_tokens": 256, "full_ms": 10.0, "splice_ms": 2.0, "speedup": 5.0}]
    before = ttft_figure({"rows": rows, "scenario": "Refund gate", "model": "m", "device": "cpu"})
    alone = ttft_figure({"rows": rows, "scenario": "skills: ", "model": "m", "device": "cpu"})
    assert len(before.data) == 3 and list(before.data[2].y) == [5.0]
    assert figure_label(before) == "Time to first token: a skill spliced vs a full prefill before Refund gate"
    assert figure_label(alone) == "Time to first token: a skill spliced vs a full prefill before a question alone"
    assert "measured on m, cpu" in before.layout.title.text


def test_cache_reuse_points_are_the_numbers_per_engine_arm_and_case():
    def row(kl, error, evaluated):
        return {"kl": kl, "margin_error": error, "evaluated_tokens": evaluated, "clean_evaluated_tokens": 400}

    data = {
        "model": "tiny",
        "device": "cpu",
        "cases": [
            {
                "case": "moved",
                "scenario": "A <b>",
                "llama_cpp": {"reuse": row(0.2, -0.5, 8)},
                "kvscope": {"move, seam 4": row(0.01, 0.1, 12)},
            },
            {"case": "edit", "scenario": "B", "llama_cpp": {"reuse": row(0.0, 0.0, 300)}, "kvscope": {"erratum": row(0.3, 0.4, 20)}},
        ],
    }
    figure = cache_reuse_figure(data)
    names = [trace.name for trace in figure.data if trace.showlegend]
    assert names == ["llama.cpp, moved cases", "llama.cpp, edit cases", "KVScope, moved cases", "KVScope, edit cases"]
    llama_moved_kl, llama_moved_error, llama_moved_share = figure.data[:3]
    assert list(llama_moved_kl.y) == ["llama.cpp: reuse"] and list(llama_moved_kl.x) == [0.2] and list(llama_moved_error.x) == [0.5]
    assert list(llama_moved_share.x) == pytest.approx([0.02]) and llama_moved_kl.marker.symbol == "circle"
    llama_edit_kl, kvscope_edit_kl = figure.data[3], figure.data[9]
    assert list(llama_edit_kl.x) == [1e-7] and llama_edit_kl.marker.symbol == "diamond" and list(kvscope_edit_kl.y) == ["KVScope: erratum"]
    assert llama_moved_kl.marker.color != kvscope_edit_kl.marker.color
    assert list(figure.layout.yaxis.categoryarray) == ["KVScope: erratum", "KVScope: move, seam 4", "llama.cpp: reuse"]
    assert "&lt;b&gt;" in llama_moved_kl.text[0] and figure.layout.xaxis.type == "log"
    json.loads(figure.to_json())


def test_a_chat_replay_draws_simulation_equal_to_server_per_server_and_way():
    part = {"requests": 20, "equal": 19, "equal_prompts_only": 4}
    data = {
        "sessions": 4,
        "turns": 5,
        "max_tokens": [8, 24, 64],
        "servers": {
            "vllm-32": {
                "token_ids": part | {"equal": 20},
                "text_only": part | {"equal": 20},
                "no_flags": {"token_ids": part | {"equal": 18}},
            },
            "llama<b>": {"text_only": part},
        },
    }
    figure = chat_replay_figure(data)
    bars = {trace.name: (list(trace.x), list(trace.y)) for trace in figure.data}
    assert bars["replies from the server's token ids"] == (["vllm-32"], [20])
    assert bars["replies from their text alone"] == (["vllm-32", "llama&lt;b&gt;"], [20, 19])
    assert bars["prompts only (no reply cached)"] == (["vllm-32", "llama&lt;b&gt;"], [4, 4])
    assert bars["with no flags (engine and settings read from the log)"] == (["vllm-32"], [18])  # drawn where stored
    title = figure.layout.title.text.replace("<br>", " ")
    assert "4 chat sessions × 5 turns" in title and "8, 24, 64 tokens" in title


def _spread(*runs: float) -> dict:
    ordered = sorted(runs)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1], "runs": list(runs)}


def test_the_cli_audits_time_draws_medians_with_their_spread_beside_the_goals():
    row = {"log": "rag<b>", "default_s": _spread(28.0, 30.0, 33.0), "rewrite_ratio": _spread(1.6, 1.7, 1.8)}
    row |= {"rewrite_only_ratio": _spread(0.9, 0.95, 1.0)}
    data = {"model": "embedded", "device": "cpu", "dtype": "float32", "tokens": 32, "reps": 3, "goal_ratio": 1.3, "goal_audit_s": 60}
    figure = audit_cli_figure(data | {"logs": [row]})
    bars = {trace.name: (list(trace.x), list(trace.y), list(trace.error_y.array), list(trace.error_y.arrayminus)) for trace in figure.data}
    assert bars == {  # no baseline timed: no baseline bars
        "default audit": (["rag&lt;b&gt;"], [30.0], [3.0], [2.0]),
        "--rewritten": (["rag&lt;b&gt;"], [1.7], [pytest.approx(0.1)], [pytest.approx(0.1)]),
        "rewrite alone": (["rag&lt;b&gt;"], [0.95], [pytest.approx(0.05)], [pytest.approx(0.05)]),
    }
    assert [shape.y0 for shape in figure.layout.shapes] == [60, 1.3]  # the goals, dotted
    # each axis shows its goal and every whisker, whichever is higher (here the goal of 60 s, the ratio's 1.8)
    assert figure.layout.yaxis.range == (0, pytest.approx(69.0)) and figure.layout.yaxis2.range == (0, pytest.approx(1.8 * 1.15))
    with_baseline = audit_cli_figure(data | {"logs": [row | {"baseline_default_s": _spread(40.0), "baseline_rewrite_ratio": _spread(2.0)}]})
    names = [(trace.name, trace.showlegend) for trace in with_baseline.data]
    assert names[:2] == [("the baseline checkout", True), ("default audit", True)] and names[2] == ("the baseline checkout", False)
    stored = json.loads(Path("benchmarks/studies/results/audit_cli-embedded-cpu.json").read_text())
    assert "The CLI audit's time" in result_figures({"audit_cli-embedded-cpu": stored})[0].layout.title.text


def test_greedy_lookup_draws_both_decodings_forwards_and_the_speedup_with_its_spread():
    row = {"log": "rag<b>", "same_tokens": False, "plain_forwards": 41, "lookup_forwards": 21, "speedup": _spread(1.7, 1.8, 2.1)}
    data = {"model": "embedded", "device": "cpu", "tokens": 32, "reps": 3, "lookup_tokens": 8, "logs": [row]}
    figure = greedy_lookup_figure(data)
    bars = {trace.name: (list(trace.x), list(trace.y)) for trace in figure.data}
    assert bars == {
        "a token a forward": (["rag&lt;b&gt; *"], [41]),  # escaped, marked: its tokens parted at a tie
        "prompt lookup": (["rag&lt;b&gt; *"], [21]),
        "speedup": (["rag&lt;b&gt; *"], [1.8]),
    }
    assert list(figure.data[2].error_y.array) == [pytest.approx(0.3)] and list(figure.data[2].error_y.arrayminus) == [pytest.approx(0.1)]
    assert [shape.y0 for shape in figure.layout.shapes] == [1.0] and figure.layout.yaxis2.range == (0, pytest.approx(2.1 * 1.2))
    stored = json.loads(Path("benchmarks/studies/results/greedy_lookup-embedded-cpu.json").read_text())
    assert "prompt lookup" in result_figures({"greedy_lookup-embedded-cpu": stored})[0].layout.title.text


def test_forward_paths_draws_each_dtypes_speedups_and_marks_a_pair_whose_numbers_differed():
    def pair(replaced: str, fast: str, slow_ms: float, fast_ms: float, same: bool = True) -> dict:
        return {
            replaced: _spread(slow_ms, slow_ms, slow_ms),
            fast: _spread(fast_ms, fast_ms, fast_ms),
            "speedup": round(slow_ms / fast_ms, 2),
            "same": same,
        }

    rows = {
        "bfloat16": {
            "output_rows": pair("slice", "fresh_view", 540.0, 16.0),
            "causal_prefill": pair("masked", "padded_causal", 2860.0, 2573.0),
        },
        "float32<b>": {
            "output_rows": pair("slice", "fresh_view", 39.0, 39.0),
            "causal_prefill": pair("masked", "padded_causal", 5478.0, 5114.0, same=False),
        },
    }
    figure = forward_paths_figure({"model": "embedded", "device": "cpu", "chunk": 1024, "stored": 42, "dtypes": rows})
    bars = {trace.name: (list(trace.y), list(trace.text)) for trace in figure.data}
    assert bars == {
        "bfloat16": ([33.75, 1.11], ["×33.75", "×1.11"]),
        "float32&lt;b&gt;": ([1.0, 1.07], ["×1.00", "×1.07 (numbers differ)"]),  # escaped; the differing pair marked
    }
    assert figure.data[0].hovertext[0] == "slice: 540.0 ms, fresh_view: 16.0 ms"
    assert figure.layout.yaxis.type == "log" and figure.layout.yaxis.range[1] > 1.528  # log10(33.75): the top bar fits
    assert "marked: a pair whose numbers differed" in figure.layout.title.text
