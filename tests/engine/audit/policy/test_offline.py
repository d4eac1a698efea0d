"""``kvscope rewrite`` end to end. Done when (issue 66): on a log this test generates (a coding agent whose system
prompt starts with a per-minute clock) and on the bundled coding agent, ``rewrite --repair hoist`` lifts the clock
session's simulated vLLM reuse from 0 (the bundled log: from 160 tokens) to at least 30% of its tokens, as ``audit
--sample 0`` counts it. And ``audit --policy-out`` writes only repairs measured within the bars, which ``rewrite
--policy`` applies as the tokens the audit measured."""

import contextlib
import io
import json
import random
from pathlib import Path

import pytest

from kvscope.engine.audit.policy.document import load_policy
from kvscope.engine.cli import main

ROOT = Path(__file__).resolve().parents[4]
RULES = "\n".join(
    f"- Rule {k}: read every file before you edit it, run the tests after each change, and report what you ran." for k in range(12)
)


def _cli(*args: str, model: str = "embedded") -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*args, "--model", model, "--json"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue().strip().splitlines()[-1])


def coding_agent_log(sessions: int = 3, turns: int = 5, seed: int = 0) -> str:
    """Sessions of a coding agent whose system prompt opens with the minute it was sent (each request a minute later),
    each turn the history so far plus a reply and a new task; the first session's clock is the one in question."""
    rng = random.Random(seed)
    lines = []
    for session in range(sessions):
        history: list[dict] = []
        for turn in range(turns):
            minute = 9 * 60 + 41 + session * 10 + turn
            system = f"Clock {minute // 60:02d}:{minute % 60:02d} UTC, 2026-05-12. You are Forge, a coding agent.\n{RULES}"
            history.append({"role": "user", "content": f"Task {turn}: fix bug #{rng.randrange(1000)} in module {rng.randrange(50)}."})
            messages = [{"role": "system", "content": system}, *history]
            lines.append(json.dumps({"model": "forge-coder", "session_id": f"agent-{session}", "messages": messages}))
            history.append({"role": "assistant", "content": f"Fixed it: edited {rng.randrange(9)} lines and the tests pass."})
    return "\n".join(lines) + "\n"


def _reuse(log: Path) -> dict[str | None, tuple[int, int]]:
    """Each session's (vLLM tokens reused, tokens), as the token pass counts them."""
    sessions = _cli("audit", str(log), "--sample", "0")["sessions"]
    return {s["session"]: (s["reused_tokens"]["vllm"], s["tokens"]) for s in sessions}


@pytest.mark.parametrize("source", ["generated", "bundled"])
def test_rewrite_repair_hoist_lifts_the_clock_session_s_vllm_reuse_to_at_least_30_percent(tmp_path, source):
    log = tmp_path / "agent.jsonl"
    if source == "generated":
        log.write_text(coding_agent_log())
    else:
        log.write_text((ROOT / "demos" / "logs" / "coding_agent.jsonl").read_text(encoding="utf-8"))
    out = tmp_path / "hoisted.jsonl"
    done = _cli("rewrite", str(log), "--repair", "hoist", "--out", str(out))
    before, after = _reuse(log), _reuse(out)
    session = "agent-0" if source == "generated" else None
    assert before[session][0] == (0 if source == "generated" else 160)
    reused, tokens = after[session]
    assert reused >= 0.3 * tokens, (reused, tokens)
    assert len(done["rewritten_requests"]) == done["requests"] == (15 if source == "generated" else 6)
    rewritten = _cli("audit", str(log), "--rewritten", str(out), "--sample", "0", model="tiny-qwen2")["rewrite"]
    assert len(rewritten) == done["requests"]  # paired with the original by audit --rewritten


def test_the_policy_holds_only_repairs_measured_within_the_bars_and_rewrite_sends_what_was_measured(tmp_path):
    log = tmp_path / "agent.jsonl"
    log.write_text(coding_agent_log(sessions=1, turns=3))
    strict, loose = tmp_path / "strict.json", tmp_path / "loose.json"
    audited = {}
    for path, bars in ((strict, ("--threshold", "0", "--min-agreement", "1")), (loose, ("--threshold", "100", "--min-agreement", "0"))):
        audited[path] = _cli("audit", str(log), "--repairs", "erratum,hoist", "--tokens", "4", *bars, "--policy-out", str(path),
                             model="tiny-qwen2")  # fmt: skip
    for path, report in audited.items():
        policy = load_policy(path.read_text())
        turns = [turn for turn in report["turns"] if turn["fields"]]
        assert turns and policy.fields
        for entry in policy.fields:
            measured = [turn["repairs"] for turn in turns if any(f["name"] == entry.field for f in turn["fields"])]
            within = {name for name in ("erratum", "hoist") if all(repairs[name]["within_bars"] for repairs in measured)}
            assert (entry.repair is None) == (not within) and (entry.repair is None or entry.repair in within)
    assert all(entry.repair is None for entry in load_policy(strict.read_text()).fields)  # KL 0 is past a random model's reach
    unchanged = _cli("rewrite", str(log), "--policy", str(strict), "--out", str(tmp_path / "same.jsonl"))
    assert unchanged["rewritten_requests"] == []
    policy = load_policy(loose.read_text())
    (entry,) = policy.applied
    out = tmp_path / "rewritten.jsonl"
    rewritten = _cli("rewrite", str(log), "--policy", str(loose), "--out", str(out))["rewritten_requests"]
    assert rewritten == ([1, 2, 3] if entry.repair == "hoist" else [2, 3])  # the erratum leaves a session's first request
    rows = _cli("audit", str(log), "--rewritten", str(out), "--sample", "0", "--tokens", "4", model="tiny-qwen2")["rewrite"]
    second = next(turn for turn in audited[loose]["turns"] if turn["request"] == 2)["repairs"][entry.repair]
    assert rows[1]["tokens_after"] == second["reused_tokens"] + second["computed_tokens"]
    assert rows[1]["kl"] == pytest.approx(second["kl"], abs=1e-5)
