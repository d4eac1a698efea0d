"""The CLI prints exactly one JSON object on stdout; bad input gives an error object and exit code 2."""

import contextlib
import io
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from kvscope.engine.cli import main, parser
from kvscope.engine.models import load_model
from tests.shared import SAME_LENGTH_SCENARIO, assert_valid_report

ROOT = Path(__file__).resolve().parents[2]
REFUND = str(ROOT / "demos" / "scenarios" / "refund_gate.toml")


def run_cli(*args: str) -> tuple[int, dict]:
    """The CLI in this process (each new process spends ~10 s importing torch): exit code and its one JSON line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*args, "--json"])
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1, out.getvalue()
    return code, json.loads(lines[0])


def run_process(*args: str) -> tuple[int, dict]:
    """``python -m kvscope`` as its own process: exit code and the one JSON line on stdout."""
    done = subprocess.run([sys.executable, "-m", "kvscope", *args, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout + done.stderr
    return done.returncode, json.loads(lines[0])


def test_the_entry_point_prints_one_json_line_and_exits_2_on_bad_input():
    code, info = run_process("info", "--model", "tiny-llama")
    assert code == 0 and info["layers"] == 3
    code, error = run_process("decide", "--model", "tiny-qwen2", "--scenario", "missing.toml")
    assert code == 2 and "missing.toml" in error["error"]


def test_with_json_what_else_is_printed_meanwhile_goes_to_stderr(monkeypatch, capsys):
    def chatty(args):  # prints as Ray's driver thread does when a worker dies
        thread = threading.Thread(target=print, args=("(raylet) A worker died or was killed while executing a task",))
        thread.start()
        thread.join()
        return {"ok": 1}

    monkeypatch.setitem(parser.COMMANDS, "info", chatty)
    assert main(["info", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"ok": 1} and out.count("\n") == 1
    assert "(raylet) A worker died" in err
    assert main(["info"]) == 0  # without --json the command's own output stays on stdout
    assert "(raylet) A worker died" in capsys.readouterr().out


def test_info_and_selftest():
    code, info = run_cli("info", "--model", "tiny-llama")
    assert code == 0 and info["layers"] == 3 and info["kv_heads"] == 2
    code, report = run_cli("selftest", "--model", "tiny-llama")
    assert code == 0 and report["ok"] is True
    for key in ("rope_roundtrip_max_err", "reposition_vs_prefill_max_err", "splice_identity_max_logit_err"):
        assert report[key] < 1e-4


def test_selftest_reports_gpt2_without_rope():
    code, report = run_cli("selftest", "--model", "tiny-gpt2")
    assert code == 0 and report["rope_supported"] is False and "rotary" in report["rope_reason"]


def test_decide_and_edit_shapes():
    code, decision = run_cli("decide", "--model", "tiny-qwen2", "--scenario", REFUND)
    assert code == 0 and {"scores", "margin", "decision", "values"} <= set(decision)
    code, edit = run_cli("edit", "--model", "tiny-qwen2", "--scenario", REFUND, "--strategies", "erratum,full_downstream")
    assert code == 0 and set(edit["strategies"]) == {"erratum", "full_downstream"}
    assert {"model", "scenario", "field", "old", "new", "flips", "stale", "oracle"} <= set(edit)
    code, fused = run_cli("edit", "--model", "tiny-qwen2", "--scenario", REFUND, "--strategies", "erratum,full_downstream", "--fused")
    assert code == 0 and "fused forward" in fused["strategies"]["erratum"]["detail"]["timing"]
    for name in ("erratum", "full_downstream"):
        assert fused["strategies"][name]["margin"] == pytest.approx(edit["strategies"][name]["margin"], abs=1e-3)


def test_calibrate_lists_every_bundled_scenario():
    code, result = run_cli("calibrate", "--model", "tiny-qwen2")
    assert code == 0 and result["total"] == len(list((ROOT / "demos" / "scenarios").glob("*.toml"))) > 0


def test_probe_compose_and_agent_shapes():
    code, probe = run_cli("probe", "locality", "--model", "tiny-qwen2", "--scenario", REFUND)
    assert code == 0 and probe["probe"] == "locality" and {"field_only", "full_downstream"} <= set(probe)
    code, compose = run_cli("compose", "--model", "tiny-qwen2", "--skills", "account_gate", "--remedy", "seam:2")
    assert code == 0
    assert {"cosine", "kl", "top1_agree", "top5_agree", "decision_agree", "seam", "ttft_ms", "speedup"} <= set(compose)
    assert set(compose["ttft_ms"]) == {"splice", "full"} and compose["seam"] == 2
    code, agent = run_cli("agent", "--model", "tiny-qwen2", "--skills", "account_gate", "--turns", "2", "--policy", "every:2")
    assert (
        code == 0
        and len(agent["turns"]) == 3
        and {"cumulative_ttft_ms", "clean_state_agreement", "identical_tokens_agreement"} <= set(agent)
    )
    assert agent["policy"] == "every:2" and agent["compactions"] == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (("decide", "--model", "tiny-qwen2", "--scenario", REFUND, "--set", "nope=1"), "unknown field 'nope'"),
        (("decide", "--model", "tiny-qwen2", "--scenario", "missing.toml"), "missing.toml"),
        (("edit", "--model", "tiny-qwen2", "--scenario", REFUND, "--strategies", "magic"), "unknown strategy 'magic'"),
        (("edit", "--model", "tiny-qwen2", "--scenario", REFUND, "--strategies", "field_topk", "--topk", "9999"), "K=9999 is larger"),
        (("info", "--model", "no-such-alias"), "no-such-alias"),
        (("probe", "vibes", "--model", "tiny-qwen2", "--scenario", REFUND), "unknown probe 'vibes'"),
        (("probe", "notes_map", "--model", "tiny-qwen2", "--scenario", REFUND, "--opt", "bogus=1"), "no option 'bogus'"),
        (("compose", "--model", "tiny-qwen2", "--skills", "nope"), "unknown skill 'nope'"),
        (("compose", "--model", "tiny-gpt2", "--skills", "account_gate"), "no rotary"),
    ],
)
def test_bad_input_gives_error_json(args, message):
    code, result = run_cli(*args)
    assert code == 2 and message in result["error"]


def test_edit_json_reports_the_notes_share_and_probe_frontier_runs():
    path = Path(tempfile.mkdtemp()) / "same.toml"
    path.write_text(SAME_LENGTH_SCENARIO)
    code, edit = run_cli("edit", "--model", "tiny-qwen2", "--scenario", str(path), "--strategies", "erratum", "--fused")
    assert code == 0 and {"share", "field_recovery", "downstream_recovery", "headline"} <= set(edit["notes"])
    code, frontier = run_cli("probe", "frontier", "--model", "tiny-qwen2", "--scenario", str(path))
    assert code == 0 and frontier["probe"] == "frontier" and frontier["context_tokens"] > 0
    assert {"field_topk (causal)", "field_topk (deviation)", "field_erratum"} <= {p["method"] for p in frontier["points"]}


@pytest.fixture
def rotation_off_by_one(monkeypatch):
    """Re-rotation one position off: the cache self-test fails, as it would on a model whose RoPE KVScope gets wrong."""
    from kvscope.engine.cache.rope import Rotary

    move = Rotary.move
    monkeypatch.setattr(Rotary, "move", lambda self, keys, values, deltas, entries=None: move(self, keys, values, deltas + 1, entries))


@pytest.mark.parametrize(
    "args",
    [
        ("compose", "--skills", "account_gate"),
        ("agent", "--skills", "account_gate", "--turns", "2"),
        ("keystone", "--skills", "account_gate"),
        ("memory", "--skills", "account_gate,user_memory"),
    ],
)
def test_splicing_commands_refuse_a_model_whose_selftest_fails(rotation_off_by_one, args):
    code, result = run_cli(*args, "--model", "tiny-qwen2")
    assert code == 2 and result["type"] == "SpliceLocked", result
    assert "splicing stays locked on tiny-qwen2: its cache self-test failed (FAILED in float32" in result["error"]
    assert "reposition" in result["error"] and " > " in result["error"]  # the self-test's numbers against their limits


def _token_span(messages: list[dict], value: str) -> tuple[int, int]:
    """The tokens of ``value`` in the chat-rendered request, found by the tokenizer's own character offsets."""
    tokenizer = load_model("tiny-qwen2").tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    first = text.index(value)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    inside = [index for index, (begin, finish) in enumerate(offsets) if begin < first + len(value) and finish > first]
    return inside[0], inside[-1] + 1


def test_audit_prints_the_per_turn_schema(tmp_path):
    system = "Agent.\nSession started: {}\nRules follow."
    requests = [
        {"messages": [{"role": "system", "content": system.format(time)}, {"role": "user", "content": "Go."}]}
        for time in ("2026-12-01 09:14", "2026-12-01 09:15")
    ]
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps(request) for request in requests))
    scenario = tmp_path / "scenario.toml"
    code, audit = run_cli(
        "audit",
        str(log),
        "--model",
        "tiny-qwen2",
        "--tokens",
        "3",
        "--repairs",
        "field_only,erratum",
        "--threshold",
        "0.5",
        "--scenario-out",
        str(scenario),
    )
    assert code == 0 and len(audit["turns"]) == 2
    assert_valid_report(audit)  # a model pass's report: every key of every turn and repair, of its type
    turn = audit["turns"][1]
    start, end = _token_span(requests[1]["messages"], "2026-12-01 09:15")
    assert turn["fields"] == [
        {
            "name": "session_started",
            "old": "2026-12-01 09:14",
            "new": "2026-12-01 09:15",
            "start": start,
            "end": end,
        }
    ]
    assert set(turn["repairs"]) == {"recompute", "field_only", "erratum"}
    assert all(repair["applicable"] for repair in turn["repairs"].values())
    # erratum, the one prompt-level repair asked for, changes the top token; field_only (KV-level) agrees on 2 of 3
    # greedy tokens, below the 90% bar: the exact reference is recommended with no KV-level repair beside it
    assert not turn["repairs"]["erratum"]["top1_agree"] and turn["repairs"]["field_only"]["generation_agreement"] < 0.9
    assert turn["recommendation"]["repair"] == "recompute" and turn["recommendation"]["kv_alternative"] is None
    assert audit["threshold"] == 0.5
    code, edit = run_cli("edit", "--model", "tiny-qwen2", "--scenario", str(scenario), "--strategies", "field_only")
    assert code == 0 and edit["field"] == "session_started" and edit["new"] == "2026-12-01 09:15"
    code, error = run_cli("audit", str(log), "--model", "tiny-qwen2", "--repairs", "magic")
    assert code == 2 and "unknown repair 'magic'" in error["error"]


def test_audit_reads_a_servers_metrics_scrapes_and_the_llama_server_prompt_cache_setting(tmp_path):
    log = tmp_path / "log.jsonl"
    turns = [{"messages": [{"role": "user", "content": "Hi"}]}, {"messages": [{"role": "user", "content": "Hi there"}]}]
    log.write_text("\n".join(json.dumps(turn) for turn in turns))
    before, after = tmp_path / "before.prom", tmp_path / "after.prom"
    before.write_text(
        "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total 100\nvllm:prefix_cache_queries_total 400\n"
    )
    after.write_text('vllm:prefix_cache_hits_total{model_name="m"} 164\nvllm:prefix_cache_queries_total{model_name="m"} 480\n')
    base = ("audit", str(log), "--model", "tiny-qwen2", "--sample", "0")
    code, audit = run_cli(*base, "--metrics", str(before), "--metrics", str(after), "--prompt-cache")
    metrics = audit["observed"]["metrics"]
    assert_valid_report(audit)
    assert code == 0 and (metrics["hits"], metrics["queries"], metrics["hit_rate"]) == (64, 80, 0.8)
    assert "two scrapes" in metrics["source"] and set(metrics["simulated_hit_rate"]) == {"vllm", "sglang", "llama_cpp"}
    assert audit["engines"]["settings"]["prompt_cache"] is True
    code, error = run_cli(*base, "--metrics", str(after), "--metrics", str(before))
    assert code == 2 and "counts less than the first" in error["error"]
    code, error = run_cli(*base, "--metrics", str(log))
    assert code == 2 and "metrics line 1 is not a Prometheus sample" in error["error"]


def test_the_audit_of_a_log_never_holds_its_file_as_one_text(tmp_path, monkeypatch):
    """A log over ``WHOLE_TEXT_BYTES`` (made 0 here) is read record by record (``LogFiles.log``); only --new reads its
    one prompt whole (a 707 MB log's text was held through a whole audit: 3.5 GB peak at 100,000 requests, 2.8 GB
    without it)."""
    from kvscope.engine.audit.logs import shards
    from kvscope.engine.audit.logs.shards import LogFiles

    monkeypatch.setattr(shards, "WHOLE_TEXT_BYTES", 0)

    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Hi {n}"}]}) for n in range(3)))

    def read_whole(self):
        raise AssertionError("the log's file read whole as one text")

    monkeypatch.setattr(LogFiles, "text", read_whole)
    code, audit = run_cli("audit", str(log), "--model", "tiny-qwen2", "--sample", "0")
    assert code == 0 and audit["engines"]["requests"] == 3


def test_audit_refuses_settings_out_of_range_by_name_with_exit_code_2(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    base = ("audit", str(log), "--model", "tiny-qwen2", "--sample", "0")
    refused = {
        ("--min-agreement", "3"): "--min-agreement: the minimum agreement is a share between 0 and 1, got 3",
        ("--threshold", "-1"): "--threshold: the KL threshold cannot be negative, got -1",
        ("--tokens", "0"): "--tokens: generate at least one token per state, got 0",
        ("--block-size", "0"): "--block-size is at least 1 token, got 0",
        ("--kv-budget-blocks", "0"): "--kv-budget-blocks is at least 1 (leave it out: unbounded), got 0",
    }
    for flag, message in refused.items():
        code, error = run_cli(*base, *flag)
        assert (code, error["error"], error["type"]) == (2, message, "RequestLogError"), flag
    code, error = run_cli(*base, "--prompt-cache", "--cache-reuse", "256")
    assert code == 2 and "--cache-reuse is not simulated with it" in error["error"]
