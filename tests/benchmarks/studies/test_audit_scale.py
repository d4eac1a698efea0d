"""The audit_scale benchmark's synthetic log is what the issue asks for (50 interleaved sessions, a clock that never
repeats, agent turns with tools), and the token pass renders it exactly: every request's ids and offsets equal the
tokenizer's on its whole rendered text."""

import json
import re

from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.studies.audit_scale import as_langfuse_traces, as_otlp, memory_scale, stage2_memory, synthetic_log
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.render import render_batch
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE


def test_the_log_interleaves_sessions_and_its_clock_never_repeats():
    records = synthetic_log(1200, 50)
    sessions = [record["user"] for record in records]
    clocks = [re.search(r"The current time is ([\d: -]+)\.", record["messages"][0]["content"]).group(1) for record in records]
    assert len(set(sessions)) == 50 and sum(a != b for a, b in zip(sessions, sessions[1:])) > 1000
    assert clocks == sorted(clocks) and len(set(clocks)) == 1200 // 3  # one minute per three requests, never again
    assert all(record["tools"] for record in records) and any(m.get("tool_calls") for m in records[-1]["messages"])


def test_the_token_pass_renders_the_log_exactly():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    log = read_log("\n".join(json.dumps(record) for record in synthetic_log(150, 7)))
    for item in render_batch(tokenizer, log.requests, 100_000):
        encoding = tokenizer.backend_tokenizer.encode(item.text, add_special_tokens=False)
        assert item.token_ids.tolist() == encoding.ids and item.offsets.tolist() == [list(p) for p in encoding.offsets]


def test_the_exports_hold_the_same_requests_as_the_jsonl():
    """The benchmark's Langfuse and OTLP exports of a log read back as the JSONL's requests, in its order, with their
    timestamps (so the speed comparison is of the same work)."""
    records = synthetic_log(300, 7)
    plain = read_log("\n".join(json.dumps(record) for record in records))
    for writer, name in ((as_langfuse_traces, "langfuse_trace"), (as_otlp, "otel")):
        log = read_log(writer(records))
        assert log.formats == {name: 300} and log.order == "timestamps" and not log.skipped
        assert [(r.messages, r.tools, r.session) for r in log.requests] == [(r.messages, r.tools, r.session) for r in plain.requests]
    assert len(as_otlp(records).splitlines()) == 1  # 300 spans: one batch of up to 512


def test_the_drivers_memory_is_measured_with_and_without_a_budget(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    unbounded, bounded = stage2_memory(60, 6, tmp_path), stage2_memory(60, 6, tmp_path, budget_tokens=512)
    assert unbounded["requests"] == bounded["requests"] == 60 and unbounded["mean_tokens"] == bounded["mean_tokens"] > 0
    assert bounded["settings"]["budget_tokens"] == 512 and bounded["settings"]["budget_blocks"] == 32
    assert 0 < bounded["caches_bytes_per_request"] < unbounded["caches_bytes_per_request"] < unbounded["driver_bytes_per_request"]


def test_one_process_memory_is_measured_under_each_budget(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    # a model dir as the command loads one: its config and (random) weights beside the tokenizer
    Qwen2ForCausalLM(Qwen2Config(**config, vocab_size=512, intermediate_size=128)).save_pretrained(tmp_path)
    unbounded, bounded, sized = memory_scale([60], 6, ["0", "512", "gpu:1"], tmp_path, tmp_path)
    assert [run["budget"] for run in (unbounded, bounded, sized)] == ["0", "512", "gpu:1"]
    assert unbounded["tokens"] == bounded["tokens"] == sized["tokens"] > 0 and unbounded["exact_check"]["ids_and_offsets_equal"]
    assert all(run["peak_rss_mb"] >= run["rss_before_mb"] > 0 for run in (unbounded, bounded, sized))
    assert unbounded["caches_held_tokens"]["sglang"] > bounded["caches_held_tokens"]["sglang"] <= 512
    assert "GiB" in sized["budgets"][0] and "RAM prompt cache" in sized["budgets"][2]  # vLLM sized by the GPU; llama's RAM cache
    # the command a user runs, with the same model and budget flags, measured in its own process
    assert [run["command"]["argv"][-2:] for run in (bounded, sized)] == [["--kv-budget-blocks", "32"], ["--gpu-memory-gib", "1"]]
    assert all(run["command"]["peak_rss_mb"] > 0 for run in (unbounded, bounded, sized))
