"""A rewrite measured against the original on a tiny model: an identical rewrite changes nothing, a reworded question
measures what two independent clean prefills measure, reuse equals an independent block count, a template applies
to the log's own values, and a rewrite that drops or reorders requests is refused with the numbers."""

import contextlib
import dataclasses
import io
import json
import re

import pytest
import torch

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.rewrite.measure import apply_template, check_pairing, measure_rewrite, measure_rewrites
from kvscope.engine.cli import main
from kvscope.engine.models.tiny import tiny_model

RULES = "Account tier: gold\nAnswer in one short paragraph. Never promise a refund above the tier's limit; check the order first."
SYSTEM = "You are the support agent of Northwind.\nThe current time is {time}.\n" + RULES
HOISTED = "You are the support agent of Northwind.\n" + RULES
TOKENS = 4


def _request(time: str, question: str, session: str = "a") -> dict:
    system = SYSTEM.format(time=time)
    return {"user": session, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def _log(*requests: dict) -> str:
    return "\n".join(json.dumps(request) for request in requests)


ORIGINAL = _log(_request("2026-12-01 09:14", "Where is my parcel?"), _request("2026-12-01 09:15", "Can I return the boots?"))


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


def _ids(lm, request: dict) -> list[int]:
    text = lm.tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
    return lm.tokenizer(text, add_special_tokens=False).input_ids


def _clean(lm, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """A clean prefill without the notebook: next-token log-probs and greedy tokens, each from a full forward."""
    with torch.no_grad():
        logprobs = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0, -1].float(), -1)
        generated, context = [], list(ids)
        while len(generated) < TOKENS:
            token = int(lm.model(torch.tensor([context])).logits[0, -1].argmax())
            if token in lm.stop_ids:
                break
            generated.append(token)
            context.append(token)
    return logprobs, generated


def test_an_identical_rewrite_measures_kl_0_and_agreement_1(lm):
    report = measure_rewrite(lm, read_log(ORIGINAL), read_log(ORIGINAL), tokens=TOKENS)
    for row in report.requests:
        f = row.fidelity
        assert f.kl == 0.0 and f.top1_agree and f.top5_overlap == 1.0 and f.generation_agreement == 1.0 and row.same_text
        assert row.reused_before == row.reused_after and row.tokens_before == row.tokens_after
    assert "the first token unchanged on 2/2" in report.verdict() and f"the first {TOKENS} tokens unchanged on 2/2" in report.verdict()


def test_a_reworded_question_measures_what_two_clean_prefills_measure(lm):
    requests = [json.loads(line) for line in ORIGINAL.splitlines()]
    reworded = [requests[0], _request("2026-12-01 09:15", "Can I return the shoes?")]
    report = measure_rewrite(lm, read_log(ORIGINAL), read_log(_log(*reworded)), tokens=TOKENS)
    for row, old, new in zip(report.requests, requests, reworded):
        p, clean = _clean(lm, _ids(lm, old))
        q, moved = _clean(lm, _ids(lm, new))
        kl = float(torch.sum(p.exp() * (p - q)).clamp_min(0.0))
        agree = sum(a == b for a, b in zip(clean, moved)) / max(len(clean), len(moved), 1)
        prefix = next((k for k, (a, b) in enumerate(zip(clean, moved)) if a != b), min(len(clean), len(moved)))
        assert row.fidelity.kl == pytest.approx(kl, abs=1e-5)
        assert row.fidelity.top1_agree == (int(p.argmax()) == int(q.argmax()))
        assert row.fidelity.generation_agreement == pytest.approx(agree) and row.fidelity.generated_common_prefix == prefix
        assert row.same_text == (lm.tokenizer.decode(clean) == lm.tokenizer.decode(moved))
    assert report.requests[1].fidelity.kl > 0  # the question changed


def _vllm_reuse(previous: list[int], ids: list[int]) -> int:
    """Whole 16-token blocks shared with the one earlier request, within the tokens before the last."""
    shared = next((k for k, (a, b) in enumerate(zip(previous, ids)) if a != b), min(len(previous), len(ids)))
    return min(shared // 16, (len(ids) - 1) // 16) * 16


TEMPLATE = json.dumps(
    [
        {"role": "system", "content": HOISTED},
        {"role": "user", "content": "Can I return the boots?\n\nThe current time is {current_time}."},
    ]
)


def test_a_template_applies_to_each_requests_own_values_and_its_reuse_is_counted(lm):
    rewritten = apply_template(TEMPLATE, read_log(ORIGINAL))
    assert [r.contents for r in rewritten.requests] == [
        (HOISTED, "Where is my parcel?\n\nThe current time is 2026-12-01 09:14."),
        (HOISTED, "Can I return the boots?\n\nThe current time is 2026-12-01 09:15."),
    ]
    report = measure_rewrite(lm, read_log(ORIGINAL), rewritten, tokens=1)
    before = [_ids(lm, json.loads(line)) for line in ORIGINAL.splitlines()]
    after = [_ids(lm, {"messages": [m.template_dict() for m in r.messages]}) for r in rewritten.requests]
    second = report.requests[1]
    assert second.reused_before["vllm"] == _vllm_reuse(before[0], before[1])
    assert second.reused_after["vllm"] == _vllm_reuse(after[0], after[1]) > second.reused_before["vllm"]
    assert (second.tokens_before, second.tokens_after) == (len(before[1]), len(after[1]))


@pytest.mark.parametrize(
    "template, message",
    [
        ("not json", "the template is not JSON"),
        ('[{"role": "system"}]', "template message 1 needs a 'role' and a 'content' string"),
        (
            '[{"role": "system", "content": "x"}, {"role": "user", "content": "Order {order} now"}, {"role": "user", "content": "q"}]',
            "template message 2 (user) holds a placeholder inside the conversation",
        ),
        ('[{"role": "system", "content": "{time}"}, {"role": "user", "content": "q"}]', "has no text beside its placeholder"),
        (
            '[{"role": "system", "content": "Today is {day}."}, {"role": "user", "content": "q"}]',
            "the template applies to no request of the log: no line of line 1 (request 1) matches the template's 'Today is {day}.'",
        ),
        ('{"messages": [{"role": "system", "content": "x"}], "why": 1}', "a template object holds 'messages' and 'read' only"),
        ('{"messages": [{"role": "system", "content": "x"}], "read": "time"}', "the template's 'read' must be a non-empty list"),
        ('{"messages": [{"role": "system", "content": "x"}], "read": ["at {t:date}"]}', "reads a value as logged: write {name}"),
        ('{"messages": [{"role": "system", "content": "x"}], "read": ["a\\nb {t}"]}', "must be one line holding a {placeholder}"),
        ('[{"role": "system", "content": "At {t:week}"}, {"role": "user", "content": "q"}]', "{t:week}: unknown grain 'week'"),
        (
            '[{"role": "system", "content": "a"}, {"role": "system", "content": "b"}, {"role": "user", "content": "q"}]',
            "applies to no request of the log: line 1 (request 1) starts with the roles system, user, the template with system, system",
        ),
    ],
)
def test_a_bad_template_is_refused_by_name(template, message):
    with pytest.raises(RequestLogError, match=re.escape(message)):
        apply_template(template, read_log(ORIGINAL))


def test_a_rewrite_with_other_requests_or_another_order_is_refused_with_the_numbers():
    original = read_log(ORIGINAL).requests
    with pytest.raises(RequestLogError, match="the original log has 2 requests, the rewritten 1"):
        check_pairing(original, original[:1])
    sessions = (original[0], dataclasses.replace(original[1], session="b"))
    with pytest.raises(RequestLogError, match="request 2: session 'a' in the original, 'b' in the rewrite"):
        check_pairing(original, sessions)
    swapped = read_log(_log(_request("2026-12-01 09:14", "Can I return the boots?"), _request("2026-12-01 09:15", "Where is my parcel?")))
    with pytest.raises(RequestLogError, match="rewritten request 1 carries the last user turn of original request 2"):
        check_pairing(original, swapped.requests)


def test_a_template_reads_values_from_lines_it_does_not_hold_and_leaves_another_prompt_as_logged():
    """The object form: the prompt keeps a frozen value, each request's own is read from its clock line (indented in
    the log) and stated after its last message, at the hour; a request of another prompt (no clock line) is kept."""
    other = {"user": "b", "messages": [{"role": "system", "content": "You are another agent."}, {"role": "user", "content": "Hi"}]}
    log = read_log(_log(_request("2026-12-01 09:14", "Where is my parcel?"), other, _request("2026-12-01 10:15", "And the boots?")))
    system = SYSTEM.format(time="2026-12-01 09:14").replace("\nThe current", "\n  The current")
    indented = read_log(_log({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Where is my parcel?"}]}))
    frozen = {"role": "system", "content": SYSTEM.format(time="2026-12-01 09:00") + ' {"json": {braces}}'}
    template = json.dumps(
        {
            "messages": [frozen, {"role": "user", "content": "q\n\n[STATE UPDATE] time -> {time}; at {time:hour}"}],
            "read": ["The current time is {time}."],
        }
    )
    rewritten = apply_template(template, log).requests
    assert rewritten[0].contents == (
        frozen["content"],
        "Where is my parcel?\n\n[STATE UPDATE] time -> 2026-12-01 09:14; at 2026-12-01 09:00",
    )
    assert rewritten[1] == log.requests[1]
    assert rewritten[2].contents[1] == "And the boots?\n\n[STATE UPDATE] time -> 2026-12-01 10:15; at 2026-12-01 10:00"
    assert apply_template(template, indented).requests[0].contents[1].endswith("time -> 2026-12-01 09:14; at 2026-12-01 09:00")
    with pytest.raises(RequestLogError, match=re.escape("line 1 (request 1): {time:hour}: 'soon' is not a date")):
        apply_template(template, read_log(_log(_request("soon", "q"))))


def test_a_request_with_other_roles_is_sent_as_logged_and_a_literal_word_beside_a_read_value_stays_literal():
    """A request whose lines hold the value but whose roles are not the template's (no system message) is another
    prompt: kept as logged, not a refusal of the log. In the object form, a {word} beside a read placeholder is text."""
    bare = {"messages": [{"role": "user", "content": "The current time is 2026-12-01 09:14.\nWhere is my parcel?"}]}
    log = read_log(_log(_request("2026-12-01 09:14", "Where is my parcel?"), bare))
    template = json.dumps(
        {
            "messages": [{"role": "system", "content": "Rules {as_json}. The current time is {time}."}, {"role": "user", "content": "q"}],
            "read": ["The current time is {time}."],
        }
    )
    rewritten = apply_template(template, log).requests
    assert rewritten[0].contents[0] == "Rules {as_json}. The current time is 2026-12-01 09:14."
    assert rewritten[1] == log.requests[1]


def test_several_rewrites_measure_what_each_measures_alone(lm):
    """The original's clean prefills are shared (and reused for a request the rewrite left as it was)."""
    reworded = read_log(_log(_request("2026-12-01 09:14", "Where is my parcel?"), _request("2026-12-01 09:15", "Can I return the shoes?")))
    hoisted = apply_template(TEMPLATE, read_log(ORIGINAL))
    together = measure_rewrites(lm, read_log(ORIGINAL), {"reworded": reworded, "hoisted": hoisted}, tokens=TOKENS)
    for label, rewritten in (("reworded", reworded), ("hoisted", hoisted)):
        alone = measure_rewrite(lm, read_log(ORIGINAL), rewritten, tokens=TOKENS)
        for a, b in zip(together[label].requests, alone.requests):
            assert a.fidelity.kl == pytest.approx(b.fidelity.kl, abs=1e-7)
            same_kl = dataclasses.replace(a.fidelity, kl=b.fidelity.kl)  # the rest equal, the KL within the tolerance above
            assert dataclasses.replace(a, fidelity=same_kl) == b
            assert a.fidelity.generation_agreement == b.fidelity.generation_agreement and a.fidelity.top1_agree == b.fidelity.top1_agree
    assert together["reworded"].requests[0].fidelity.kl == 0.0 and together["reworded"].requests[1].fidelity.kl > 0


def _cli(*args: str) -> dict:
    """``kvscope`` in this process: its one JSON line (exit 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([*args, "--model", "tiny-qwen2", "--tokens", str(TOKENS), "--json"])
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.mark.parametrize("repair", ["erratum", "hoist"])
def test_the_cli_measures_the_template_it_wrote_as_the_audit_measured_that_repair(tmp_path, repair):
    """``--template-out`` (with ``--template-repair``), then ``--template``: the turn it was written from is sent as the
    tokens the audit measured, and answers as the audit's repair did (the cached prefix against a clean prefill of
    the same tokens: rounding apart)."""
    grown = {"role": "assistant", "content": "It ships today."}, {"role": "user", "content": "Can I return the boots?"}
    first = _request("2026-12-01 09:14", "Where is my parcel?")
    second = _request("2026-12-01 09:15", "Where is my parcel?")
    second["messages"] += grown
    log, template = tmp_path / "log.jsonl", tmp_path / "template.json"
    log.write_text(_log(first, second))
    audited = _cli("audit", str(log), "--repairs", repair, "--template-out", str(template), "--template-repair", repair)
    measured = audited["turns"][1]["repairs"][repair]
    rewrite = _cli("audit", str(log), "--template", str(template), "--sample", "0")["rewrite"][1]
    assert rewrite["tokens_after"] == measured["reused_tokens"] + measured["computed_tokens"]
    assert rewrite["kl"] == pytest.approx(measured["kl"], abs=1e-5) and rewrite["top1_agree"] == measured["top1_agree"]
    assert rewrite["generation_agreement"] == measured["generation_agreement"]
