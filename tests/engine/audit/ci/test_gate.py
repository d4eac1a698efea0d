"""The CI gate: each quantity read from the report as defined, exit 1 exactly when a condition holds (the bound itself
included or not as the operator says), each malformed condition named with exit 2, and the Markdown summary."""

import contextlib
import io
import json
from pathlib import Path

import pytest

from kvscope.engine.audit.ci.gate import EXIT_FAILED, GateError, exit_code, gate, markdown, parse_conditions, quantity
from kvscope.engine.cli import main

ROWS = [  # two measured requests of a rewrite
    {
        "tokens_after": 100,
        "reused_tokens_after": {"vllm": 64, "sglang": 90, "llama_cpp": 90},
        "kl": 0.02,
        "generation_agreement": 0.75,
        "top1_agree": True,
    },
    {
        "tokens_after": 100,
        "reused_tokens_after": {"vllm": 16, "sglang": 10, "llama_cpp": 0},
        "kl": 0.05,
        "generation_agreement": 1.0,
        "top1_agree": False,
    },
]
LOG = {  # a log's engines and one measured turn recommending hoist
    "engines": {"tokens": 400, "reused_tokens": {"vllm": 100, "sglang": 120, "llama_cpp": 0}},
    "turns": [
        {"request": 1, "recommendation": None, "repairs": {}},
        {
            "request": 2,
            "recommendation": {"repair": "hoist"},
            "repairs": {"hoist": {"kl": 0.2, "generation_agreement": 0.5, "top1_agree": True}},
        },
    ],
}


def test_each_quantity_is_over_what_it_names():
    rewrite = {**LOG, "rewrite": ROWS}
    assert quantity("reuse", rewrite) == 80 / 200 and quantity("reuse.sglang", rewrite) == 100 / 200
    assert quantity("kl", rewrite) == 0.05 and quantity("agreement", rewrite) == 0.75 and quantity("top1", rewrite) == 0.5
    assert quantity("reuse", LOG) == 0.25 and quantity("reuse.llama_cpp", LOG) == 0.0
    assert quantity("kl", LOG) == 0.2 and quantity("agreement", LOG) == 0.5 and quantity("top1", LOG) == 1.0
    prompt = {"turns": LOG["turns"]}  # one prompt's audit (--new): no engines simulated
    assert quantity("kl", prompt) == 0.2
    with pytest.raises(GateError, match="one prompt's audit \\(--new\\) simulates no serving engine"):
        quantity("reuse", prompt)


@pytest.mark.parametrize(
    "condition, holds",
    [
        ("reuse<0.4", False),
        ("reuse<=0.4", True),
        ("reuse<0.41", True),
        ("reuse>0.4", False),
        ("reuse>=0.4", True),
        ("kl>0.05", False),
        ("kl>=0.05", True),
        ("kl>0.049", True),
        ("agreement<0.75", False),
        ("agreement<=0.75", True),
        ("top1<0.5", False),
        ("top1<1", True),
        (" reuse.vllm < 0.4 , kl > 0.05 ", False),
        ("reuse<0.4,kl>=0.05", True),
    ],
)
def test_the_gate_fails_exactly_when_a_condition_holds(condition, holds):
    report = {**LOG, "rewrite": ROWS}
    report["gate"] = gate(parse_conditions([condition]), report).as_dict()
    assert report["gate"]["failed"] is holds
    assert exit_code(report) == (EXIT_FAILED if holds else 0)


@pytest.mark.parametrize(
    "condition, message",
    [
        ("reuse<0.5,,kl>1", "--fail-on 'reuse<0.5,,kl>1' holds an empty condition"),
        ("reuse=0.5", "--fail-on condition 'reuse=0.5' is not QUANTITY<NUMBER"),
        ("reuse", "--fail-on condition 'reuse' is not QUANTITY<NUMBER"),
        ("reus<0.5", "--fail-on condition 'reus<0.5': unknown quantity 'reus'"),
        ("reuse.tgi<0.5", "unknown quantity 'reuse.tgi'"),
        ("kl>abc", "--fail-on condition 'kl>abc': 'abc' is not a number"),
        ("kl>nan", "the bound must be a finite number, got 'nan'"),
        ("reuse<50", "reuse is a share between 0 and 1, got 50"),
        ("kl>-1", "a KL divergence is never negative, got -1"),
    ],
)
def test_each_malformed_condition_is_named(condition, message):
    with pytest.raises(GateError) as error:
        parse_conditions([condition])
    assert message in str(error.value)


def test_a_condition_over_nothing_measured_is_refused():
    with pytest.raises(GateError, match="no request was measured with the model"):
        gate(parse_conditions(["kl>0.05"]), {**LOG, "turns": []})


def _log(tmp_path: Path) -> str:
    system = "You are the support agent of Northwind.\nThe current time is {}.\nAccount tier: gold\nAnswer in one short paragraph."
    requests = [
        {"messages": [{"role": "system", "content": system.format(time)}, {"role": "user", "content": "Where is my parcel?"}]}
        for time in ("2026-12-01 09:14", "2026-12-01 09:15")
    ]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in requests), encoding="utf-8")
    return str(path)


def _run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["audit", *args, "--model", "tiny-qwen2", "--tokens", "2"])
    return code, out.getvalue()


def test_the_cli_exits_1_exactly_when_a_condition_holds_and_2_on_a_malformed_one(tmp_path):
    log = _log(tmp_path)
    code, out = _run(log, "--sample", "0", "--json")
    engines = json.loads(out)["engines"]
    rate = engines["reused_tokens"]["vllm"] / engines["tokens"]
    assert _run(log, "--sample", "0", "--json", "--fail-on", f"reuse<={rate!r}")[0] == 1
    assert _run(log, "--sample", "0", "--json", "--fail-on", f"reuse<{rate!r}")[0] == 0
    code, out = _run(log, "--sample", "0", "--json", "--fail-on", "kl>0.05,agreement<0.9x")
    assert code == 2 and "'0.9x' is not a number" in json.loads(out)["error"]
    code, out = _run(log, "--sample", "0", "--json", "--rewritten", log, "--fail-on", "kl>0", "--fail-on", "agreement<1")
    report = json.loads(out)
    assert code == 0 and [row["value"] for row in report["gate"]["conditions"]] == [0.0, 1.0]
    assert [row["kl"] for row in report["rewrite"]] == [0.0, 0.0] and report["verdict"].startswith("reuse ")


def test_markdown_prints_the_turns_their_causes_the_verdict_and_the_gate(tmp_path):
    log = _log(tmp_path)
    code, out = _run(log, "--sample", "0", "--rewritten", log, "--markdown", "--fail-on", "agreement<=1")
    assert code == 1
    assert "| request | session | matched | tokens | vLLM | SGLang | llama.cpp | causes | recommended |" in out
    assert "clock:current_time" in out and "### Rewrite" in out and "the first 2 tokens unchanged on 2/2" in out
    assert "- `agreement<=1`: agreement = 1, holds: fail" in out and out.rstrip().endswith("**failed**")
    report = {"model": "m", "skipped_count": 0, "engines": {"requests": 0, "tokens": 0, "hit_rate": {}, "budgets": []}, "requests": []}
    assert markdown(report).startswith("## KVScope audit (m)")
