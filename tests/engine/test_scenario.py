"""Scenario files: parsing, validation errors and exact token spans."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvscope.engine.models.tiny import tiny_tokenizer
from kvscope.engine.scenario import (
    Field,
    RenderedPrompt,
    Scenario,
    ScenarioError,
    Span,
    bundled_scenarios,
    context_text,
    escape_braces,
    render,
    toml_string,
    unescape_braces,
)

EXAMPLE = '''
name = "Refund gate"
description = "The refund decision depends on the order status."
system = "You are a careful support agent."        # optional
context = """
SESSION
order_status: {order_status}
POLICY
Refunds are approved only when order_status is pending.
"""
question = "Should the refund be approved? Answer yes or no."

[fields.order_status]
old = "shipped"
new = "pending"
values = ["shipped", "pending", "delivered"]        # optional, more values for probes

[answers]                                           # label -> surface strings scored as continuations
yes = ["yes", "Yes"]
no = ["no", "No"]

[expect]                                            # optional: value -> label a competent model gives
shipped = "no"
pending = "yes"
'''

TWO_FIELDS = '''
name = "Two fields"
context = """{tier} customer. Status:{status} and {{literal}} braces, {not a placeholder}."""
question = "Approve?"
[fields.tier]
old = "gold"
new = "bronze"
[fields.status]
old = "shipped"
new = "pending"
values = ["out for delivery to the warehouse in Zürich", "x"]
[answers]
yes = "yes"
no = ["no"]
'''

# Values of different token counts, to check that the text around a field never changes.
SHORT, LONG = "x", "out for delivery to the warehouse in Zürich"


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def _error(text: str) -> str:
    with pytest.raises(ScenarioError) as info:
        Scenario.from_toml(text)
    return str(info.value)


@pytest.fixture(params=[True, False], ids=["chat", "plain"])
def tokenizer(request):
    return tiny_tokenizer(chat_template=request.param)


def test_parse_example() -> None:
    s = Scenario.from_toml(EXAMPLE, source="x.toml")
    assert s.name == "Refund gate"
    assert s.description == "The refund decision depends on the order status."
    assert s.system == "You are a careful support agent."
    assert s.context.startswith("SESSION\norder_status: {order_status}\n") and s.context.endswith("pending.")
    assert s.question == "Should the refund be approved? Answer yes or no."
    assert s.fields == {"order_status": Field("order_status", "shipped", "pending", ("shipped", "pending", "delivered"))}
    assert s.answers == {"yes": ("yes", "Yes"), "no": ("no", "No")}
    assert s.expect == {"shipped": "no", "pending": "yes"}
    assert s.source == "x.toml"
    assert s.field() is s.field("order_status")
    assert s.values_with() == {"order_status": "shipped"}
    assert s.values_with(order_status="pending") == {"order_status": "pending"}


def test_defaults_and_order() -> None:
    s = Scenario.from_toml(TWO_FIELDS)
    assert s.description == "" and s.system is None and s.expect == {} and s.source is None
    assert list(s.fields) == ["tier", "status"] and s.field().name == "tier"
    assert s.fields["tier"].values == ("gold", "bronze")
    assert s.fields["status"].values == ("shipped", "pending", LONG, SHORT)
    assert s.answers == {"yes": ("yes",), "no": ("no",)}


def test_load_and_missing_file(tmp_path) -> None:
    path = tmp_path / "gate.toml"
    path.write_text(EXAMPLE)
    assert Scenario.load(path).source == str(path)
    with pytest.raises(ScenarioError, match="cannot read scenario file"):
        Scenario.load(tmp_path / "missing.toml")


def test_toml_syntax_error_names_line(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "x"\nquestion = "unterminated\n')
    with pytest.raises(ScenarioError, match=r"bad\.toml: TOML syntax error.*line 2"):
        Scenario.load(path)


@pytest.mark.parametrize("key", ["name", "context", "question", "fields", "answers"])
def test_missing_required_key(key: str) -> None:
    document = {
        "name": 'name = "Refund gate"\n',
        "context": 'context = """\nSESSION',
        "question": 'question = "Should the refund be approved? Answer yes or no."\n',
    }
    text = EXAMPLE
    if key in document:
        start = text.index(document[key])
        end = text.index('"""\n', start + 12) + 4 if key == "context" else start + len(document[key])
        text = text[:start] + text[end:]
    else:
        start = text.index(f"[{key}")
        end = text.index("\n[", start + 1) + 1
        text = text[:start] + text[end:]
    assert f"missing required key {key!r}" in _error(text)


def test_empty_context_and_unknown_key() -> None:
    start = EXAMPLE.index('context = """')
    end = EXAMPLE.index('"""\n', start + 12) + 4
    assert "'context' is empty" in _error(EXAMPLE[:start] + 'context = """\n  \n"""\n' + EXAMPLE[end:])
    assert "unknown key 'contxt'" in _error(_edit(EXAMPLE, "context =", "contxt ="))
    assert "'question' must be a string" in _error(
        _edit(EXAMPLE, 'question = "Should the refund be approved? Answer yes or no."', "question = 3")
    )


def test_field_placeholder_errors() -> None:
    missing = _edit(EXAMPLE, "order_status: {order_status}", "order_status: shipped")
    assert "field 'order_status' is declared but {order_status} is not in the context" in _error(missing)
    undeclared = _edit(EXAMPLE, "POLICY\n", "POLICY {region}\n")
    assert "{region}" in _error(undeclared) and "no field 'region'" in _error(undeclared)
    repeated = _edit(EXAMPLE, "when order_status is", "when {order_status} is")
    assert "{order_status} occurs 2 times" in _error(repeated)
    in_question = _edit(EXAMPLE, "Should the refund", "Is {order_status} ok? Should the refund")
    assert "{order_status} appears in 'question'" in _error(in_question)
    assert "not an identifier" in _error(_edit(EXAMPLE, "[fields.order_status]", '[fields."order status"]'))


@pytest.mark.parametrize(
    "old, new, needle",
    [
        ('old = "shipped"', 'old = "ship{ped"', "'ship{ped' must not contain"),
        ('new = "pending"', 'new = "pen}ding"', "'pen}ding' must not contain"),
        ('old = "shipped"', 'old = ""', "must not be empty"),
        ('new = "pending"', "new = 3", "3 must be a string"),
        ('"delivered"]', '"deli{very}"]', "'deli{very}' must not contain"),
        ('"delivered"]', '""]', "must not be empty"),
        ('"delivered"]', "true]", "True must be a string"),
        ('new = "pending"', 'new = "shipped"', "'new' must differ from 'old'"),
        ('new = "pending"\n', "", "field 'order_status': missing required key 'new'"),
        ('new = "pending"', 'new = "pending"\ndefault = "x"', "unknown key 'default'"),
    ],
)
def test_field_value_errors(old: str, new: str, needle: str) -> None:
    message = _error(_edit(EXAMPLE, old, new))
    assert "order_status" in message and needle in message


def test_answer_and_expect_errors() -> None:
    one_label = _edit(EXAMPLE, 'no = ["no", "No"]\n', "")
    assert "at least two labels" in _error(_edit(one_label, 'shipped = "no"\n', ""))
    assert "label 'no'" in _error(_edit(EXAMPLE, 'no = ["no", "No"]', "no = []"))
    assert "label 'no'" in _error(_edit(EXAMPLE, 'no = ["no", "No"]', 'no = ["no", " "]'))
    assert "'yes' is listed under both" in _error(_edit(EXAMPLE, 'no = ["no", "No"]', 'no = ["no", "yes"]'))
    bad_label = _error(_edit(EXAMPLE, 'pending = "yes"', 'pending = "maybe"'))
    assert "unknown answer label 'maybe'" in bad_label and "yes, no" in bad_label
    assert "value 'lost'" in _error(_edit(EXAMPLE, 'pending = "yes"', 'lost = "yes"'))


def test_unknown_field_override() -> None:
    s = Scenario.from_toml(EXAMPLE)
    with pytest.raises(ScenarioError, match="unknown field 'status'.*order_status"):
        s.values_with(status="pending")
    with pytest.raises(ScenarioError, match="unknown field 'status'"):
        render(s, tiny_tokenizer(), {"status": "pending"})
    with pytest.raises(ScenarioError, match="unknown field 'status'"):
        s.field("status")
    with pytest.raises(ScenarioError, match="must not contain"):
        render(s, tiny_tokenizer(), {"order_status": "{x}"})


def test_answer_that_tokenizes_to_nothing() -> None:
    backend = Tokenizer(models.BPE())  # no unk token and no byte fallback: unknown characters vanish
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator([EXAMPLE], trainers.BpeTrainer(vocab_size=120, show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    s = Scenario.from_toml(_edit(EXAMPLE, 'no = ["no", "No"]', 'no = ["no", "☃"]'))
    with pytest.raises(ScenarioError, match="answer '☃' \\(label 'no'\\) tokenizes to nothing"):
        render(s, tokenizer)


def test_max_tokens(tokenizer) -> None:
    s = Scenario.from_toml(EXAMPLE)
    rendered = render(s, tokenizer)
    longest_answer = max(len(ids) for surfaces in rendered.answer_ids.values() for ids in surfaces)
    total = len(rendered.context_ids) + len(rendered.decode_ids) + longest_answer
    assert render(s, tokenizer, max_tokens=total).values == {"order_status": "shipped"}
    with pytest.raises(ScenarioError) as info:
        render(s, tokenizer, max_tokens=total - 1)
    message = str(info.value)
    assert f"{total} tokens, over the limit of {total - 1}" in message
    assert f"context {len(rendered.context_ids)}" in message and "the context is the longest part" in message


def _check_spans(s: Scenario, tokenizer, name: str, values: list[str]) -> None:
    rendered = [render(s, tokenizer, {name: v}) for v in values]
    for value, r in zip(values, rendered, strict=True):
        span = r.field_spans[name]
        assert isinstance(span, Span) and len(span) > 0
        field_text = tokenizer.decode(r.context_ids[span.start : span.end])
        assert field_text.strip() == value
        assert r.context_segments[span.start : span.end] == (f"field:{name}",) * len(span)
        assert r.context_segments.count(f"field:{name}") == len(span)
        assert len(r.context_segments) == len(r.context_ids)
    lengths = {len(r.field_spans[name]) for r in rendered}
    assert len(lengths) > 1, "test values must have different token counts"
    first = rendered[0]
    for r in rendered[1:]:
        span, ref = r.field_spans[name], first.field_spans[name]
        assert r.context_ids[: span.start] == first.context_ids[: ref.start]
        assert r.context_ids[span.end :] == first.context_ids[ref.end :]
        assert r.context_segments[span.end :] == first.context_segments[ref.end :]
        assert r.decode_ids == first.decode_ids and r.answer_ids == first.answer_ids


def test_spans_exact_across_values(tokenizer) -> None:
    s = Scenario.from_toml(EXAMPLE)
    _check_spans(s, tokenizer, "order_status", ["shipped", "pending", LONG, SHORT])
    r = render(s, tokenizer)
    span = r.field_spans["order_status"]
    assert tokenizer.decode(r.context_ids[span.start : span.end]) == " shipped"  # the leading space moves in
    assert tokenizer.decode(r.context_ids[: span.start]).endswith("order_status:")


def test_two_fields_and_literal_braces(tokenizer) -> None:
    s = Scenario.from_toml(TWO_FIELDS)
    _check_spans(s, tokenizer, "status", ["shipped", LONG, SHORT])
    _check_spans(s, tokenizer, "tier", ["gold", "platinum and diamond", SHORT])
    r = render(s, tokenizer, {"status": "pending"})
    assert r.values == {"tier": "gold", "status": "pending"}
    tier, status = r.field_spans["tier"], r.field_spans["status"]
    assert tokenizer.decode(r.context_ids[tier.start : tier.end]) == "gold"  # no space before: none moves
    assert tokenizer.decode(r.context_ids[status.start : status.end]) == "pending"
    text = tokenizer.decode(r.context_ids, skip_special_tokens=True)
    assert "gold customer. Status:pending and {literal} braces, {not a placeholder}." in text


def test_chat_layout() -> None:
    tokenizer = tiny_tokenizer()
    s = Scenario.from_toml(EXAMPLE)
    r = render(s, tokenizer)
    assert isinstance(r, RenderedPrompt)
    context = tokenizer.decode(r.context_ids)
    assert context == (
        "<|bos|><|im_start|>system\nYou are a careful support agent.<|im_end|>\n<|im_start|>user\n"
        + s.context.replace("{order_status}", "shipped")
        + "\n\n"
    )
    assert context.count("<|bos|>") == 1
    assert tokenizer.decode(r.decode_ids) == s.question + "<|im_end|>\n<|im_start|>assistant\n"
    assert r.answer_ids["yes"] == (
        tuple(tokenizer("yes", add_special_tokens=False).input_ids),
        tuple(tokenizer("Yes", add_special_tokens=False).input_ids),
    )
    assert set(r.context_segments) == {"template", "context", "field:order_status"}
    first_context = r.context_segments.index("context")
    assert tokenizer.decode(r.context_ids[:first_context]).endswith("<|im_start|>user\n")
    last_context = len(r.context_segments) - r.context_segments[::-1].index("context")
    assert set(r.context_segments[last_context:]) == {"template"}
    assert tokenizer.decode(r.context_ids[last_context:]) == "\n\n"


def test_plain_layout() -> None:
    tokenizer = tiny_tokenizer(chat_template=False)
    s = Scenario.from_toml(EXAMPLE)
    r = render(s, tokenizer)
    assert r.context_ids[0] == tokenizer.bos_token_id and r.context_ids[1] != tokenizer.bos_token_id
    assert tokenizer.decode(r.context_ids) == (
        "<|bos|>You are a careful support agent.\n\n" + s.context.replace("{order_status}", "shipped") + "\n\n"
    )
    assert tokenizer.decode(r.decode_ids) == s.question + "\nAnswer:"
    assert r.answer_ids["no"][0] == tuple(tokenizer(" no", add_special_tokens=False).input_ids)
    no_system = render(Scenario.from_toml(TWO_FIELDS), tokenizer)
    assert tokenizer.decode(no_system.context_ids).startswith("<|bos|>gold customer.")


def test_bundled_scenarios_parse_and_render(tokenizer) -> None:
    bundled = bundled_scenarios()
    assert {"refund_gate", "access_control", "request_id_control"} <= set(bundled)
    for stem, path in bundled.items():
        s = Scenario.load(path)
        assert s.source == str(path) and (s.expect or s.skills), stem  # composition demos may omit [expect]
        for value in s.field().values:
            r = render(s, tokenizer, {s.field().name: value}, max_tokens=4096)
            assert tokenizer.decode(r.decode_ids).startswith(s.question)
            span = r.field_spans[s.field().name]
            assert tokenizer.decode(r.context_ids[span.start : span.end]).strip() == value
            assert span.start < len(r.context_ids) // 2, f"{stem}: the field should come early, before the rule"
        labels = set(s.expect.values())
        assert labels <= set(s.answers)


def test_control_scenario_expects_no_change() -> None:
    s = Scenario.load(bundled_scenarios()["request_id_control"])
    field = s.field()
    assert s.expect[field.old] == s.expect[field.new]
    gate = Scenario.load(bundled_scenarios()["refund_gate"])
    assert gate.expect[gate.field().old] != gate.expect[gate.field().new]


def test_context_text_fills_values_and_skill_texts() -> None:
    refund = Scenario.load(bundled_scenarios()["refund_gate"])
    text = context_text(refund, {"refund_eligible": "true"})
    assert text.startswith("SESSION\nrefund_eligible: true\norder_id: 48213") and "{" not in text
    assert "refund_eligible: false" in context_text(refund)  # old values by default
    keystone = Scenario.load(bundled_scenarios()["keystone_safety"])
    filled = context_text(keystone, {"safety_mode": "ready"})
    assert "{skill:" not in filled and "safety_mode: ready" in filled
    assert keystone.skills["safety_gate"].text.split("{")[0] in filled  # the skill's own text, its placeholders filled


HOSTILE = [
    'quote " and backslash \\ and a trailing backslash \\',
    'triple quotes """ and \'\'\' and a [fields.fake] table header\nold = "x"',
    "control characters \x00\x01\x08\x0b\x0c\x1b\x1f and DEL \x7f, tab\tand CR\r\nline",
    "unicode: é, 中文, emoji 🤖, combining e\u0301, RTL \u202e, BOM \ufeff, U+2028 \u2028",
    "TOML look-alikes: key = 'value' # comment \\u0041 \\n",
]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_toml_string_reads_back_through_tomllib(hostile: str) -> None:
    import tomllib

    assert tomllib.loads(f"value = {toml_string(hostile)}")["value"] == hostile


@pytest.mark.parametrize("hostile", HOSTILE)
def test_scenario_to_toml_round_trips_hostile_text(hostile: str) -> None:
    written = Scenario(
        name=f"name {hostile}".strip(),
        description=f"about {hostile}".strip(),
        system=f"system {hostile}".strip(),
        context=f"{escape_braces(hostile)} {{status}} then {{{{literal}}}} braces.\n\nRule after the field.",
        question=f"{escape_braces(hostile)} Approve?".strip(),
        fields={"status": Field("status", f"old {hostile}".replace("{", "(").replace("}", ")"), "new", ("old", "new", "other"))},
        answers={"yes": ("yes", f"Yes {hostile}".strip()), "no": ("no",)},
        expect={"new": "yes"},
    )
    written = Scenario.from_toml(written.to_toml())  # stripping and defaults as a file has them
    read = Scenario.from_toml(written.to_toml())
    assert read == written
    assert read.fields["status"].old.startswith("old ") and hostile.strip() in read.answers["yes"][1]


def test_bundled_scenarios_round_trip_through_to_toml() -> None:
    for path in bundled_scenarios().values():
        scenario = Scenario.load(path)
        assert dataclasses.replace(Scenario.from_toml(scenario.to_toml()), source=scenario.source) == scenario, path.stem


def test_escape_braces_is_undone_by_unescape_and_survives_rendering(tokenizer) -> None:
    text = 'JSON {"a": {"b": 1}} and a {field} look-alike'
    assert unescape_braces(escape_braces(text)) == text
    scenario = Scenario.from_toml(
        f'name = "x"\ncontext = {toml_string(escape_braces(text) + " {status}")}\nquestion = "q"\n'
        '[fields.status]\nold = "a"\nnew = "b"\n[answers]\nyes = ["yes"]\nno = ["no"]\n'
    )
    assert context_text(scenario) == text + " a"
