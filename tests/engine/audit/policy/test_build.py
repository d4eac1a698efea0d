"""A policy from measured turns: per field, the prompt-level repair within the bars on every turn it changed in, the
one computing the fewest tokens; none where none held them (and why, from the numbers); KV-level repairs named, never
applied; and what the policy file holds is what ``load_policy`` reads back, its schema the published one."""

import json
from pathlib import Path

import jsonschema
import pytest

from kvscope.engine.audit.changes.fields import FieldChange, TurnDiff
from kvscope.engine.audit.logs.requests import Message, Request
from kvscope.engine.audit.measure.recommend import Bars, Recommendation
from kvscope.engine.audit.measure.repairs import RepairResult
from kvscope.engine.audit.measure.turn import AuditReport, AuditTurn
from kvscope.engine.audit.policy.build import policy_from_report
from kvscope.engine.audit.policy.document import PUBLISHED, PolicyError, load_policy, policy_schema
from kvscope.engine.audit.policy.rewrite import plain_rendering
from kvscope.engine.audit.prompts.repair_requests import OutputFidelity
from kvscope.engine.audit.report.records import json_text
from kvscope.engine.cli import main

ROOT = Path(__file__).resolve().parents[4]
SYSTEM = "You are Forge.\nTime now: {clock}\nBe brief."
BARS = Bars(0.05, 0.9, OutputFidelity(0.0, True, 1.0, 1.0, 8))


def _request(index: int, clock: str) -> Request:
    return Request(index, index, (Message("system", SYSTEM.format(clock=clock)), Message("user", f"task {index}")))


def _result(name: str, kl: float, agreement: float = 1.0, reused: int = 90, computed: int = 10) -> RepairResult:
    return RepairResult(name, True, reused, computed, 5.0, OutputFidelity(kl, True, 1.0, agreement, 4))


def _turn(index: int, old: str, new: str, results: list[RepairResult]) -> tuple[AuditTurn, object]:
    """Request ``index`` whose clock changed from ``old`` to ``new``, with ``results`` measured (recompute first)."""
    request = _request(index, new)
    rendered = plain_rendering(request)
    start = rendered.text.index(new)  # the system message is the first, unstripped
    change = FieldChange("clock", 0, old, new, 0, 0, 0, 0, (start, start + len(new)), (start, start + len(new)))
    repairs = {"recompute": _result("recompute", 0.0, reused=5, computed=95), **{r.name: r for r in results}}
    turn = AuditTurn(index, 100, TurnDiff(5, 0, (change,), 100, 100), 10.0, repairs, Recommendation("recompute", "", None, BARS))
    return turn, rendered


def _report(*turns: tuple[AuditTurn, object]) -> AuditReport:
    return AuditReport("tiny", "float32", 0.05, 0.9, 8, ("recompute", "erratum", "hoist"), None, tuple(t for t, _ in turns),
                       tuple(r for _, r in turns))  # fmt: skip


def test_the_cheapest_prompt_level_repair_within_the_bars_on_every_turn_is_applied():
    report = _report(
        _turn(2, "09:41", "09:42", [_result("erratum", 0.01, computed=12), _result("hoist", 0.02, computed=8, reused=92)]),
        _turn(3, "09:41", "09:43", [_result("erratum", 0.03, computed=12), _result("hoist", 0.04, computed=9, reused=91)]),
    )
    policy = policy_from_report(report, "log.jsonl")
    (entry,) = policy.fields
    assert (entry.field, entry.role, entry.message, entry.pattern, entry.example) == ("clock", "system", 0, "Time now: {clock}", "09:43")
    assert entry.repair == "hoist" and not entry.forced
    fidelity = entry.fidelity
    assert (fidelity.kl, fidelity.agreement, fidelity.turns, fidelity.kl_bar, fidelity.agreement_bar) == (0.04, 1.0, 2, 0.05, 0.9)
    assert (entry.tokens, entry.baseline_reused_tokens, entry.reused_tokens, entry.gained_tokens) == (200, 10, 183, 173)
    assert {m.repair: m.within_bars for m in entry.measured} == {"recompute": True, "erratum": True, "hoist": True}
    assert load_policy(policy.text()) == policy
    assert "clock (system message 1, found by 'Time now: {clock}'): hoist; measured: KL 0.04 (bar 0.05)" in policy.words()[1]


def test_a_repair_past_the_bars_on_one_turn_is_not_applied_and_the_why_says_its_numbers():
    report = _report(
        _turn(2, "09:41", "09:42", [_result("erratum", 0.01), _result("hoist", 0.2), _result("field_only", 0.001, computed=2)]),
        _turn(3, "09:41", "09:43", [_result("erratum", 0.3), _result("hoist", 0.01, agreement=0.5), _result("field_only", 0.002)]),
    )
    (entry,) = policy_from_report(report).fields
    assert entry.repair is None and entry.fidelity is None and entry.reused_tokens == entry.baseline_reused_tokens == 10
    assert "erratum KL 0.3 (bar 0.05)" in entry.why and "hoist KL 0.2 (bar 0.05), 50% of greedy tokens agreeing (bar 90%)" in entry.why
    assert entry.needs_cache_editing == ("field_only",)
    assert "field_only held the bars too (KV-level, needs a cache-editing engine): not applied" in entry.words()


def test_the_policy_refuses_at_load_an_applied_repair_outside_its_bars_a_kv_repair_and_a_bad_pattern():
    report = _report(_turn(2, "09:41", "09:42", [_result("erratum", 0.01), _result("hoist", 0.2)]))
    data = json.loads(policy_from_report(report).text())
    assert data["fields"][0]["repair"] == "erratum"
    cases = [
        (("repair", "hoist"), ("fidelity", {**data["fields"][0]["fidelity"], "kl": 0.2}), "applied but was not measured within the bars"),
        (("repair", "field_only"), None, "KV-level, needs a cache-editing engine"),
        (("repair", "recompute"), None, "the exact reference"),
        (("repair", "coarsen"), None, "grain None: coarsen needs one of date, hour, minute"),
        (("pattern", "{clock}"), None, "has no text beside the value"),
        (("pattern", "Time now: {time}"), None, "must hold {clock} once"),
        (("message", "first"), None, "fields.0.message: Input should be a valid integer"),
        (("bogus", 1), None, "fields.0.bogus: Unexpected keyword argument"),
    ]
    for first, second, reason in cases:
        entry = dict(data["fields"][0], **dict([first, *([second] if second else [])]))
        with pytest.raises(PolicyError, match="fields.0") as refused:
            load_policy(json.dumps({**data, "fields": [entry]}))
        assert reason in str(refused.value), (first, str(refused.value))
    with pytest.raises(PolicyError, match="version: this KVScope reads policy version 1, the file says 2"):
        load_policy(json.dumps({**data, "version": 2}))
    with pytest.raises(PolicyError, match="not JSON"):
        load_policy("{")
    forced = dict(data["fields"][0], repair="hoist", fidelity=None, forced=True)
    assert load_policy(json.dumps({**data, "fields": [forced]})).fields[0].repair == "hoist"


def test_the_published_schema_is_the_generated_one_and_a_policy_validates_against_it(capsys):
    assert (ROOT / PUBLISHED).read_text(encoding="utf-8") == json_text(policy_schema())
    assert main(["policy-schema", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == policy_schema()
    policy = json.loads(policy_from_report(_report(_turn(2, "09:41", "09:42", [_result("erratum", 0.01)]))).text())
    jsonschema.validate(policy, policy_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**policy, "extra": 1}, policy_schema())
