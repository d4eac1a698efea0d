"""The serving benchmark: workload, clean-prefill answers and accuracy, agreement, the headline, and an
end-to-end run on llama.cpp's C++ server."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from benchmarks.common import PERCENTILE, free_port
from benchmarks.serving import serving, serving_workload
from benchmarks.serving.loadgen import CacheCounters, Load, RequestResult
from benchmarks.serving.serving import Settings, accuracy, agreement, headline, recorded_clean, saturation_rps
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, OpenAIServer, resolve_gguf, wait_until_ready
from benchmarks.serving.serving_workload import (
    Variant,
    Workload,
    WorkloadError,
    build_policy,
    build_workload,
    load_scenario,
    nth_permutation,
    policy_sources,
)
from kvscope.engine.edit.erratum import erratum_text


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def refund_workload() -> Workload:
    return Workload(load_scenario("refund_gate"), "HANDBOOK TEXT\nline two", policy_tokens=5)


# --------------------------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------------------------


def test_policy_starts_with_the_long_policy_and_fits_the_target():
    sources = policy_sources()
    assert sources[0].startswith("NORTHWIND OUTFITTERS - RETURNS AND REFUNDS OPERATIONS POLICY")
    assert all("{{" not in text for text in sources)
    policy = build_policy(words, 700)
    assert 650 <= words(policy) <= 700 and policy.startswith(sources[0][:200])


def test_policy_repeats_the_skills_for_long_targets():
    total = sum(words(text) for text in policy_sources())
    policy = build_policy(words, 2 * total + 100)
    assert words(policy) <= 2 * total + 100 and policy.count("OPERATIONS POLICY") == 3


def test_the_scenario_field_comes_first_then_its_rule_then_the_handbook_then_the_question():
    workload = refund_workload()
    prompt = workload.prompt(Variant.IN_PREFIX, "true", 7)
    field, rule = prompt.index("refund_eligible: true\n"), prompt.index("Approve the refund only if refund_eligible is true.")
    request, handbook, question = prompt.index("REQUEST 7\n"), prompt.index("HANDBOOK TEXT"), prompt.index("Should the refund be approved?")
    assert field < rule < request < handbook < question
    assert prompt.startswith("<|im_start|>system\nYou are a careful support agent.") and prompt.endswith("<|im_start|>assistant\n")
    assert workload.values == ("false", "true") and workload.field == "refund_eligible"


def test_erratum_keeps_the_prefix_byte_identical_and_in_prefix_edits_near_the_start():
    workload = refund_workload()
    erratum = [workload.prompt(Variant.ERRATUM, value, request) for value, request in (("true", 1), ("false", 2))]
    in_prefix = [workload.prompt(Variant.IN_PREFIX, value, request) for value, request in (("true", 1), ("true", 2))]
    shared = erratum[0][: erratum[0].index("REQUEST 1")]
    assert erratum[1].startswith(shared) and shared.endswith("line two\n\n")
    assert "refund_eligible: false\n" in shared  # the stale value stays in place
    assert erratum_text("refund_eligible", "true") + "\n" in erratum[0]
    first_difference = next(i for i, (a, b) in enumerate(zip(*in_prefix, strict=False)) if a != b)
    assert first_difference < in_prefix[0].index("HANDBOOK TEXT")  # the same value, yet every later token changes
    assert "[STATE UPDATE]" not in in_prefix[0] and "refund_eligible: true\n" in in_prefix[0]


def test_request_values_alternate_and_labels_follow_the_scenario_answers():
    workload = refund_workload()
    assert workload.request_values(5, first=1) == ["true", "false", "true", "false", "true"]
    assert workload.request_values(2, first=0) == ["false", "true"]
    assert workload.label(" Yes, approve it") == "yes" and workload.label("\n\nno.") == "no"
    assert workload.label("Maybe") == "maybe" and workload.label("...") == ""
    assert workload.expected("true") == "yes" and workload.expected("false") == "no"


def composed_workload() -> Workload:
    return Workload(load_scenario("refund_gate"), "", 0, "composed", ("BLOCK A", "BLOCK B", "BLOCK C"), " # # ")


def test_composed_prompts_give_every_request_its_own_block_order():
    workload = composed_workload()
    assert [workload.order(request) for request in range(4)] == [(0, 1, 2), (2, 1, 0), (2, 0, 1), (1, 2, 0)]
    assert len({workload.order(request) for request in range(6)}) == 6  # 3! requests in a row, no order twice
    first = workload.prompt(Variant.CHUNK_REUSE, "true", 1)
    assert "<|im_start|>user\n # # BLOCK C # # BLOCK B # # BLOCK A # # SESSION\nrefund_eligible: true" in first
    assert workload.prompt(Variant.PREFIX_ONLY, "true", 1) == first  # the variants differ in what the engine reuses
    assert workload.variants == (Variant.CHUNK_REUSE, Variant.PREFIX_ONLY)
    assert workload.clean_key("false", 1) == "false @ 2-1-0" and refund_workload().clean_key("false", 4) == "false"
    assert workload.clean_prompt("true", 1) == first
    assert refund_workload().clean_prompt("true", 9) == refund_workload().prompt(Variant.IN_PREFIX, "true", 0)
    assert nth_permutation(3, 5) == (2, 1, 0) and nth_permutation(4, 0) == (0, 1, 2, 3)


def test_engines_say_how_they_reuse_composed_blocks():
    server = LlamaServer.__new__(LlamaServer)
    server.reuse_chunk = 16
    assert server.composed_variants() == (Variant.CHUNK_REUSE, Variant.PREFIX_ONLY)
    assert server.request_options(Variant.CHUNK_REUSE) == {"n_cache_reuse": 16} and server.request_options(Variant.ERRATUM) == {}
    assert server.clean_options() == {"cache_prompt": False}  # a clean prefill
    assert OpenAIServer("vllm", "http://127.0.0.1:1", "m").clean_options() == {}
    assert OpenAIServer("lmcache", "http://127.0.0.1:1", "m").composed_variants() == (Variant.CHUNK_REUSE,)
    assert OpenAIServer("vllm", "http://127.0.0.1:1", "m").composed_variants() == (Variant.PREFIX_ONLY,)


def test_recorded_clean_answers_must_come_from_the_same_prompts(tmp_path):
    workload = composed_workload()
    requests = [("true", 1), ("false", 2), ("true", 3)]
    answers = {workload.clean_key(value, request): "Yes" if value == "true" else "No" for value, request in requests}
    recorded = {"model": "m", "scenario": "Refund gate", "blocks": 3, "separator": " # # ", "agreement": {"clean_answers": answers}}
    path = tmp_path / "serving-vllm-composed.json"
    path.write_text(json.dumps(recorded))
    assert recorded_clean(path, workload, requests, "m") == answers
    with pytest.raises(WorkloadError, match="'model': 'm'.*this run has .*'model': 'other'"):
        recorded_clean(path, workload, requests, "other")
    path.write_text(json.dumps({**recorded, "separator": "\n\n"}))
    with pytest.raises(WorkloadError, match="measured with .*'separator': '.n.n'}, this run has"):
        recorded_clean(path, workload, requests, "m")
    path.write_text(json.dumps(recorded))
    with pytest.raises(WorkloadError, match=r"no clean-prefill answer for 1 request\(s\), e.g. 'true @ 1-0-2'"):
        recorded_clean(path, workload, [*requests, ("true", 4)], "m")


def test_the_plan_is_reproducible_and_alternates_values():
    settings = Settings(loads=(2.0, 0.5), requests=5, max_duration_s=100.0, max_tokens=2, request_timeout_s=1.0, seed=3)
    planned = serving.plan(refund_workload(), settings)
    assert [len(run.arrivals) for run in planned] == [5, 5] and planned[0].arrivals == serving.plan(refund_workload(), settings)[0].arrivals
    assert planned[0].first == 1 and planned[0].values == ["true", "false", "true", "false", "true"]  # seed 3: starts at values[1]
    assert planned[1].first == 0 and planned[1].requests[:2] == [("false", 1), ("true", 2)]


def test_a_run_empties_the_cache_warms_up_on_the_other_value_then_sends_its_plan(monkeypatch):
    calls = []

    class Stub(OpenAIServer):
        def reset_cache(self) -> None:
            calls.append("reset")

        def cache_counters(self):
            return CacheCounters(10.0, 100.0) if not calls.count("counted") else CacheCounters(30.0, 300.0)

    async def fake_load(base_url, payloads, arrivals, timeout):
        calls.append("counted")
        return [
            RequestResult(i, at, at, 0.1, 0.2, 1, "Yes" if "refund_eligible: true" in p["prompt"] else "No")
            for i, (p, at) in enumerate(zip(payloads, arrivals))
        ]

    monkeypatch.setattr(serving, "send_one", lambda engine, prompt, settings, options: calls.append(("warm-up", prompt)))
    monkeypatch.setattr(serving, "run_load", fake_load)
    workload = refund_workload()
    planned = serving.PlannedRun(Load(1.0, 2, 10.0), [0.5, 1.5], ["true", "false"], first=1)
    settings = Settings(loads=(1.0,), requests=2, max_duration_s=10.0, max_tokens=2, request_timeout_s=1.0, seed=0)
    row, answered = serving.run_variant(Stub("vllm", "http://127.0.0.1:1", "m"), workload, Variant.IN_PREFIX, planned, settings, CLEAN)
    assert calls[0] == "reset" and calls[1] == ("warm-up", workload.prompt(Variant.IN_PREFIX, "false", 0)) and calls[2] == "counted"
    assert [(value, request) for value, request, _ in answered] == [("true", 1), ("false", 2)]
    assert row["accuracy"] == 1.0 and row["arrival_rps"] == 1.0
    assert row["prefix_hit_rate"] == 0.1 and row["prompt_tokens"] == 200.0  # no usage reports: the /metrics difference
    assert row["metrics_prefix_hit_rate"] == 0.1 and row["metrics_prefix_hit_tokens"] == 20.0  # the cross-check's own fields


def test_vllm_is_started_here_without_a_url_and_its_block_size_must_be_a_multiple_of_32(capsys):
    args = serving.parse_args(["--engine", "vllm", "--block-size", "128", "--tag", "block128"])
    assert (args.url, args.block_size, args.tag) == (None, 128, "block128")
    with pytest.raises(SystemExit):
        serving.parse_args(["--engine", "vllm", "--block-size", "48"])
    assert "--block-size 48: vLLM's CPU backend takes a multiple of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.parse_args(["--engine", "sglang"])
    assert "needs --url" in capsys.readouterr().err


def test_a_tagged_result_is_written_under_its_own_name(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "RESULTS", tmp_path)

    class Figure:
        def write_html(self, path, **_):
            path.write_text("")

    monkeypatch.setattr(serving, "serving_figure", lambda data: Figure())
    assert serving.write({"engine": "vllm", "workload": "edit", "tag": "block128"}).name == "serving-vllm-block128.json"
    assert serving.write({"engine": "vllm", "workload": "composed", "tag": ""}).name == "serving-vllm-composed.json"


def test_reset_cache_posts_to_the_engines_route_and_names_the_switch_when_missing():
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.path)
            self.send_response(200 if self.path == "/flush_cache" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        OpenAIServer("sglang", url, "m").reset_cache()
        with pytest.raises(WorkloadError, match="VLLM_SERVER_DEV_MODE=1"):
            OpenAIServer("vllm", url, "m").reset_cache()
        assert seen == ["/flush_cache", "/reset_prefix_cache"]
    finally:
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------------------------
# Accuracy, agreement, headline
# --------------------------------------------------------------------------------------------


def _done(text: str, index: int = 0) -> RequestResult:
    return RequestResult(index, 0.0, 0.0, 0.1, 0.2, 2, text)


TIMEOUT = RequestResult(0, 0.0, 0.0, None, None, 0, "", error="timeout after 1 s")
CLEAN = {"false": "No", "true": "Yes"}


def test_accuracy_compares_each_answer_with_the_clean_answer_for_its_request():
    answered = [("true", 1, _done("Yes")), ("false", 2, _done("Yes")), ("false", 3, _done(" no")), ("true", 4, TIMEOUT)]
    assert accuracy(refund_workload(), CLEAN, answered) == pytest.approx(2 / 3, abs=1e-4)
    assert accuracy(refund_workload(), CLEAN, [("true", 1, TIMEOUT)]) is None
    composed = composed_workload()
    by_order = {composed.clean_key("true", 1): "No", composed.clean_key("true", 2): "Yes"}
    assert accuracy(composed, by_order, [("true", 1, _done("No")), ("true", 2, _done("No"))]) == 0.5  # each its own order


def test_agreement_per_variant_against_each_other_the_clean_answer_and_the_expected_answer():
    erratum = [("true", 1, _done("Yes")), ("false", 2, _done("Yes")), ("true", 3, _done(" yes")), ("false", 4, _done("No"))]
    in_prefix = [("true", 1, _done("Yes")), ("false", 2, _done("No.")), ("true", 3, _done("No")), ("false", 4, TIMEOUT)]
    report = agreement(
        refund_workload(), {"false": "Yes", "true": "Yes"}, {Variant.ERRATUM: erratum, Variant.IN_PREFIX: in_prefix}, sample=2
    )
    assert report["pairs"] == 3
    assert report["erratum_vs_in_prefix"] == pytest.approx(1 / 3, abs=1e-4)
    assert report["erratum_vs_clean"] == 1.0 and report["in_prefix_vs_clean"] == pytest.approx(1 / 3, abs=1e-4)
    assert report["clean_vs_expected"] == pytest.approx(2 / 3, abs=1e-4)  # the clean "Yes" for false is wrong
    assert report["erratum_vs_expected"] == pytest.approx(2 / 3, abs=1e-4)
    assert report["in_prefix_vs_expected"] == pytest.approx(2 / 3, abs=1e-4)
    assert report["sample"][1] == {"value": "false", "clean": "Yes", "erratum": "Yes", "in_prefix": "No."}
    single = agreement(refund_workload(), CLEAN, {Variant.CHUNK_REUSE: erratum}, sample=0)
    assert single["pairs"] == 4 and single["chunk_reuse_vs_clean"] == 0.75 and "erratum_vs_in_prefix" not in single
    with pytest.raises(ValueError, match="variants answered different requests"):
        agreement(refund_workload(), CLEAN, {Variant.ERRATUM: erratum, Variant.IN_PREFIX: in_prefix[::-1]}, sample=0)


def test_agreement_with_the_expected_answer_leaves_out_values_the_scenario_states_none_for():
    workload = refund_workload()
    report = agreement(
        workload, {"true": "Yes", "maybe": "No"}, {Variant.CHUNK_REUSE: [("true", 1, _done("Yes")), ("maybe", 2, _done("No"))]}, sample=0
    )
    assert report["chunk_reuse_vs_expected"] == 1.0 and report["clean_vs_expected"] == 1.0  # "maybe" has no expectation


def _row(variant: str, rps: float, throughput: float, p90: float, accuracy: float = 1.0) -> dict:
    return {
        "variant": variant,
        "offered_rps": rps,
        "arrival_rps": rps * 0.8,
        "throughput_rps": throughput,
        "ttft_p90_ms": p90,
        "prefix_hit_rate": 0.9 if variant == "erratum" else 0.05,
        "accuracy": accuracy,
    }


def test_headline_reports_ratios_at_the_top_load_and_where_each_variant_saturates():
    runs = [
        _row("erratum", 0.05, 0.037, 900),
        _row("erratum", 1.5, 1.1, 1200),
        _row("in_prefix", 0.05, 0.038, 30_000),
        _row("in_prefix", 0.2, 0.048, 200_000),
        _row("in_prefix", 1.5, 0.048, 600_000, accuracy=0.9),
    ]
    summary = headline(runs)
    assert summary["offered_rps"] == 1.5 and summary["in_prefix_accuracy"] == 0.9
    assert summary["p90_ttft_ratio_in_prefix_over_erratum"] == 500.0
    assert summary["throughput_ratio_erratum_over_in_prefix"] == pytest.approx(22.9)
    assert summary["saturation_rps"] == {"erratum": None, "in_prefix": 0.2}  # judged against each run's own arrivals
    assert saturation_rps([_row("in_prefix", 0.1, None, 1.0)]) == 0.1  # nothing completed
    assert saturation_rps([{**_row("in_prefix", 0.1, None, 1.0), "arrival_rps": None}]) is None  # one arrival: cannot tell


def test_arrival_rate_is_the_runs_own():
    assert serving.arrival_rate([1.0, 3.0, 5.0, 11.0]) == 0.3 and serving.arrival_rate([4.0]) is None


class AlwaysNo(OpenAIServer):
    """A stand-in engine whose every answer is "No"."""

    def __init__(self) -> None:
        super().__init__("stub", "http://127.0.0.1:1", "stub")


def test_a_workload_whose_clean_answer_ignores_the_field_is_refused(monkeypatch):
    monkeypatch.setattr(serving, "send_one", lambda engine, prompt, settings, options: "No")
    monkeypatch.setattr(AlwaysNo, "reset_cache", lambda self: None)
    settings = Settings(loads=(1.0,), requests=1, max_duration_s=1.0, max_tokens=2, request_timeout_s=1.0, seed=0)
    refused = r"does not change with refund_eligible on stub \(refund_eligible=true: 'No', refund_eligible=false: 'No'\)"
    with pytest.raises(WorkloadError, match=refused):
        serving.clean_answers(AlwaysNo(), refund_workload(), settings, [("true", 1), ("false", 2)])


# --------------------------------------------------------------------------------------------
# What the engines report
# --------------------------------------------------------------------------------------------


def _serve_metrics(text: str) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = text.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_openai_server_reads_prefix_cache_counters_from_metrics():
    text = 'vllm:prefix_cache_queries_total{model_name="m"} 4096\nvllm:prefix_cache_hits_total{model_name="m"} 4000\n'
    server = _serve_metrics(text)
    try:
        engine = OpenAIServer("vllm", f"http://127.0.0.1:{server.server_address[1]}", "m")
        assert engine.cache_counters() == CacheCounters(4000.0, 4096.0)
    finally:
        server.shutdown()
        server.server_close()


def test_openai_server_refuses_non_loopback():
    with pytest.raises(ValueError, match="loopback"):
        OpenAIServer("vllm", "http://10.0.0.2:8000", "m")


# --------------------------------------------------------------------------------------------
# End to end on llama.cpp's C++ server with the embedded model
# --------------------------------------------------------------------------------------------

needs_llama_server = pytest.mark.skipif(
    not SERVER_BINARY.is_file(), reason="llama-server is not built: bash scripts/build_llama_server.sh (~10 min)"
)


@needs_llama_server
def test_end_to_end_on_llama_server_with_the_embedded_model(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    settings = Settings(loads=(2.0,), requests=3, max_duration_s=10.0, max_tokens=2, request_timeout_s=120.0, seed=0)
    gguf, model = resolve_gguf("embedded")
    scenario = load_scenario("refund_gate")
    with LlamaServer(SERVER_BINARY, gguf, n_ctx=1024, threads=2, log_path=tmp_path / "server.log", model=model) as server:
        workload = build_workload(server, scenario, "edit", policy_tokens=256, separator="\n\n")
        data = serving.benchmark(server, workload, settings=settings, progress=print)
        as_openai = OpenAIServer("vllm", server.base_url, model)  # counts through usage.prompt_tokens
        assert as_openai.count_tokens("one two three") == server.count_tokens("one two three")
        assert as_openai.cache_counters() is None and as_openai.cache_hit_rate_gauge() is None  # no /metrics: usage only
    assert server._process is None  # stopped
    path = serving.write(data)
    saved = json.loads(path.read_text())
    assert path.name == "serving-llama-cpp.json" and saved["engine"] == "llama-cpp" and path.with_suffix(".html").is_file()
    assert 200 <= saved["policy_tokens"] <= 256 and saved["field"] == "refund_eligible" and saved["percentile"] == PERCENTILE
    clean = saved["agreement"]["clean_answers"]
    assert {Workload(scenario, "", 0).label(text) for text in clean.values()} == {"yes", "no"}  # follows the field
    runs = {row["variant"]: row for row in saved["runs"]}
    assert set(runs) == {"erratum", "in_prefix"}
    for row in runs.values():
        assert row["offered_rps"] == 2.0 and row["errors"] == 0 and row["completed"] == 3
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"] and row["throughput_rps"] > 0
    assert runs["in_prefix"]["accuracy"] >= 0.66 and runs["erratum"]["accuracy"] >= 0.66  # 3 requests, clear margins here
    # each answer's own usage: the erratum reuses the handbook, the in-prefix edit only the head before the value
    erratum, in_prefix = runs["erratum"], runs["in_prefix"]
    assert erratum["prefix_hit_tokens"] >= erratum["completed"] * saved["policy_tokens"]
    assert erratum["prefix_hit_rate"] >= 0.8 and in_prefix["prefix_hit_rate"] <= 0.4
    assert saved["agreement"]["pairs"] == 3
    assert saved["summary"]["erratum_accuracy"] == erratum["accuracy"]


@needs_llama_server
def test_composed_blocks_on_llama_server_chunk_reuse_against_prefix_only(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    blocks = [f"FACT SHEET {name}\n" + " ".join(f"{name} item {i} ships in {i % 5 + 1} days." for i in range(8)) for name in "ABC"]
    monkeypatch.setattr(serving_workload, "policy_sources", lambda: ["long policy, left out", *blocks])
    settings = Settings(loads=(2.0,), requests=3, max_duration_s=10.0, max_tokens=2, request_timeout_s=120.0, seed=0)
    gguf, model = resolve_gguf("embedded")
    with LlamaServer(SERVER_BINARY, gguf, n_ctx=2048, threads=2, log_path=tmp_path / "server.log", model=model) as server:
        workload = build_workload(server, load_scenario("refund_gate"), "composed", policy_tokens=0, separator="\n\n")
        data = serving.benchmark(server, workload, settings=settings, progress=print)
    path = serving.write(data)
    assert path.name == "serving-llama-cpp-composed.json"
    assert len(data["agreement"]["clean_answers"]) == 3  # one per request (its value and block order), no cache
    runs = {row["variant"]: row for row in data["runs"]}
    assert set(runs) == {"chunk_reuse", "prefix_only"} and all(row["completed"] == 3 for row in runs.values())
    assert runs["prefix_only"]["accuracy"] == 1.0  # a prefix cache is exact
    assert runs["chunk_reuse"]["prefix_hit_rate"] > runs["prefix_only"]["prefix_hit_rate"] + 0.1  # chunks shifted, not recomputed
    assert data["agreement"]["pairs"] == 3 and "chunk_reuse_vs_prefix_only" in data["agreement"]


def test_a_server_that_exits_before_it_answers_is_reported_with_its_log(tmp_path):
    import subprocess
    import sys

    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", "print('model file missing'); raise SystemExit(3)"], stdout=out)
    process.wait()
    with pytest.raises(RuntimeError, match=r"(?s)test server exited \(3\):.*model file missing"):
        wait_until_ready(process, f"http://127.0.0.1:{free_port()}/health", "test server", log, timeout_s=5)
