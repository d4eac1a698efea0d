"""The audit benchmark: the JSON a small run writes on tiny-qwen2 (two repetitions of a log written here)."""

from __future__ import annotations

import json
import statistics

from benchmarks.studies import audit

SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 {time}\nBe brief."


def _request(time: str, *turns: str) -> str:
    messages = [{"role": "system", "content": SYSTEM.format(time=time)}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]
    return json.dumps({"messages": messages})


def test_audit_benchmark_writes_reuse_fidelity_and_ttft_per_repair_per_turn(tmp_path):
    (tmp_path / "desk.jsonl").write_text(
        "\n".join([_request("09:41", "Hi"), _request("09:42", "Hi"), _request("09:42", "Hi", "Hello", "Bye")])
    )
    argv = ["--model", "tiny-qwen2", "--logs", "desk", "--log-dir", str(tmp_path), "--out", str(tmp_path), "--tokens", "2", "--reps", "2"]
    (data,) = audit.main(argv)
    stored = json.loads((tmp_path / "audit-desk-tiny-qwen2-cpu.json").read_text())
    assert stored["turns"] == json.loads(json.dumps(data["turns"])) and stored["reps"] == 2 and stored["dtype"] == "float32"
    assert {"avx2", "avx512_bf16", "model_name"} <= set(stored["cpu"]) and len(stored["load_average_before"]) == 3
    assert stored["repairs"] == list(audit.REPAIRS) and stored["grain"] == "date" and stored["generated_tokens"] == 2
    second, third = stored["turns"][1], stored["turns"][2]
    assert [field["name"] for field in second["fields"]] == ["session_started"] and third["fields"] == []
    for turn in (second, third):
        recompute = turn["repairs"]["recompute"]
        assert recompute["kl"] < 1e-6 and recompute["generation_agreement"] == 1.0
        assert turn["full_ttft_ms"] == statistics.median(turn["full_ttft_runs_ms"]) and len(turn["full_ttft_runs_ms"]) == 2
        for result in turn["repairs"].values():
            if result["applicable"]:
                assert result["ttft_ms"] == statistics.median(result["ttft_runs_ms"])
                assert result["reused_fraction"] == round(
                    result["reused_tokens"] / (result["reused_tokens"] + result["computed_tokens"]), 4
                )
    coarsen = second["repairs"]["coarsen"]
    assert coarsen["applicable"] and coarsen["coarse_values"] == {"session_started": "2026-05-12"}
    summary = stored["summary"]
    assert summary["turns"] == 2 and sum(summary["recommended"].values()) == 2
    assert summary["repairs"]["field_only"]["turns_applicable"] == 1  # growth alone: nothing to edit in place
    assert summary["recompute_computed_tokens"] == sum(t["repairs"]["recompute"]["computed_tokens"] for t in (second, third))
