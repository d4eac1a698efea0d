"""Request-log audits on tiny models: reuse figures against an independent count, fields found exactly, the exact
repair equal to a clean prefill and the stale ones not, each prompt-level repair's template rendering the prompt that
was measured, and a specific message for each kind of bad input."""

import json
import math

import pytest
import torch

from kvscope.engine.audit.changes.fields import diff_requests
from kvscope.engine.audit.logs.reading import parse_log, parse_prompt, read_log
from kvscope.engine.audit.logs.render import render_request
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.measure.kv_store import ComputedStates, Reference
from kvscope.engine.audit.measure.recommend import recommend
from kvscope.engine.audit.measure.repairs import fidelity
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.audit.measure.turn import audit_requests, audit_value, candidates, repaired_template, scenario_toml
from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS
from kvscope.engine.audit.prompts.repair_requests import coarse
from kvscope.engine.audit.rewrite.measure import apply_template
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import DEMOS, Scenario, escape_braces, unescape_braces

SYSTEM = (
    "You are the support agent of Northwind.\nSession started: {time}\nUser id: {user}\nAccount tier: {tier}\n"
    "Answer in one short paragraph. Never promise refunds above the tier's limit."
)


def _request(time="2026-12-01 09:14", user="u-48213", tier="gold", turns=(("user", "Where is my parcel?"),)):
    messages = [{"role": "system", "content": SYSTEM.format(time=time, user=user, tier=tier)}]
    messages += [{"role": role, "content": content} for role, content in turns]
    return {"messages": messages}


def _log(*requests) -> str:
    return "\n".join(json.dumps(request) for request in requests)


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


def _independent_prefix(a, b):
    count = 0
    while count < min(len(a), len(b)) and a[count] == b[count]:
        count += 1
    return count


def test_common_prefix_and_block_hits_match_an_independent_count(lm):
    log = _log(_request(), _request(time="2026-12-01 09:15"), _request(time="2026-12-01 09:15", tier="platinum"))
    requests = parse_log(log)
    report = audit_requests(lm, requests, measure=measure_settings(repairs=["recompute"], tokens=2))
    ids = [
        lm.tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        for r in map(json.loads, log.splitlines())
    ]
    ids = [lm.tokenizer(text, add_special_tokens=False).input_ids for text in ids]
    for turn, (a, b) in zip(report.as_dict()["turns"][1:], zip(ids, ids[1:])):
        shared = _independent_prefix(a, b)
        assert turn["tokens"] == len(b) and turn["common_prefix_tokens"] == shared
        assert turn["block_prefix_tokens"] == shared - shared % 16
        assert turn["repairs"]["recompute"]["reused_tokens"] == min(shared, len(b) - 1)


def test_the_diff_finds_exactly_the_changed_values_and_tells_growth_apart(lm):
    old = render_request(lm, parse_log(_log(_request()))[0])
    changed = _request(
        time="2026-12-01 10:02",
        user="u-9",
        tier="platinum plus",
        turns=(("user", "Where is my parcel?"), ("assistant", "It ships today."), ("user", "Thanks!")),
    )
    new = render_request(lm, parse_log(_log(changed))[0])
    diff = diff_requests(old, new, BLOCK_TOKENS)
    found = {change.name: (change.old, change.new) for change in diff.fields}
    assert found == {
        "session_started": ("2026-12-01 09:14", "2026-12-01 10:02"),
        "user_id": ("u-48213", "u-9"),
        "account_tier": ("gold", "platinum plus"),
    }
    for change in diff.fields:  # whole tokens, exactly the value's text
        assert new.text[slice(*change.char_span)] == change.new
        covered = lm.tokenizer.decode(list(new.token_ids[change.start : change.end]))
        assert change.new in covered and len(covered) - len(change.new) < 8
    assert diff.growth_start < len(new) and all(change.end <= diff.growth_start for change in diff.fields)


def test_only_appended_turns_are_growth_not_fields(lm):
    log = _log(_request(), _request(turns=(("user", "Where is my parcel?"), ("assistant", "Today."), ("user", "Thanks"))))
    report = audit_requests(lm, parse_log(log), measure=measure_settings(tokens=2))
    turn = report.as_dict()["turns"][1]
    assert turn["fields"] == [] and turn["appended_tokens"] > 0
    assert turn["repairs"]["field_only"]["applicable"] is False and "only growth" in turn["repairs"]["field_only"]["reason"]
    assert turn["repairs"]["field_only"]["kl"] is None  # the same keys for every repair
    assert turn["recommendation"]["repair"] == "recompute"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_recompute_equals_the_clean_prefill(arch):
    model = tiny_model(arch)
    log = _log(
        _request(), _request(time="2026-12-01 09:15", turns=(("user", "Where is my parcel?"), ("assistant", "Soon."), ("user", "When?")))
    )
    report = audit_requests(model, parse_log(log), measure=measure_settings(repairs=["recompute"], tokens=12))
    exact = report.turns[1].repairs["recompute"]
    assert exact.fidelity.kl < 1e-6 and exact.fidelity.top1_agree and exact.fidelity.top5_overlap == 1.0
    assert exact.fidelity.generation_agreement == 1.0 and exact.fidelity.generated_common_prefix == 12


def test_fidelity_equals_the_values_computed_from_their_definitions():
    """KL(clean ‖ state) in float64 from the definition, the top tokens, the top-5 overlap and the greedy comparison of
    two small distributions, each counted here by hand."""
    clean_logits = [3.0, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]
    state_logits = [2.0, 3.0, 1.0, 0.5, -1.0, 0.0, -2.0]

    def log_softmax(logits):
        total = math.log(sum(math.exp(x) for x in logits))
        return [x - total for x in logits]

    p, q = log_softmax(clean_logits), log_softmax(state_logits)
    expected_kl = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
    clean = Reference(torch.tensor(p), (1, 2, 3, 4), 0.0, Notebook.__new__(Notebook))
    measured = fidelity(torch.tensor(q), (1, 2, 9), clean)
    assert measured.kl == pytest.approx(expected_kl, rel=1e-5) and expected_kl > 0.1
    assert not measured.top1_agree  # token 0 against token 1
    assert measured.top5_overlap == 0.8  # {0, 1, 2, 3, 4} against {1, 0, 2, 3, 5}
    assert measured.generation_agreement == 0.5 and measured.generated_common_prefix == 2  # 2 of max(4, 3) agree


def test_every_repair_costs_what_the_token_ids_say_and_the_cheapest_within_the_bars_is_recommended(lm):
    log = _log(_request(), _request(time="2026-12-01 09:15"))
    report = audit_requests(lm, parse_log(log), measure=measure_settings(tokens=6, threshold=10.0, min_agreement=0.0, grain="hour"))
    turn = report.as_dict()["turns"][1]
    for name in ("recompute", "field_only", "erratum", "field_erratum", "hoist", "coarsen"):
        result = turn["repairs"][name]
        assert result["applicable"], (name, result)
        assert {
            "reused_tokens",
            "computed_tokens",
            "ttft_ms",
            "kl",
            "top1_agree",
            "generation_agreement",
            "generated_common_prefix",
        } <= set(result)
    old, new = (
        lm.tokenizer(
            lm.tokenizer.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True), add_special_tokens=False
        ).input_ids
        for r in map(json.loads, log.splitlines())
    )
    value_tokens = len(lm.tokenizer("2026-12-01 09:15", add_special_tokens=False).input_ids)
    repairs = report.turns[1].repairs
    assert {name: repairs[name].computed_tokens for name in ("recompute", "field_only", "coarsen")} == {
        "recompute": len(new) - _independent_prefix(old, new),  # everything from the first changed token
        "field_only": value_tokens + 1,  # the whole timestamp, then the last token (always run to read the next one)
        "coarsen": 1,  # 09:14 and 09:15 are both 09:00 at the hour: the whole request is cached but its last token
    }
    assert all(repairs[name].reused_tokens + repairs[name].computed_tokens == len(new) for name in ("recompute", "field_only", "coarsen"))
    assert turn["repairs"]["coarsen"]["coarse_values"] == {"session_started": "2026-12-01 09:00"}
    assert {name: result["level"] for name, result in turn["repairs"].items()} == {
        "recompute": "prompt",
        "field_only": "kv",
        "erratum": "prompt",
        "field_erratum": "kv",
        "hoist": "prompt",
        "coarsen": "prompt",
    }
    # KL ≤ 10 and no agreement bar: the bars hold wherever the top token agrees, as it does for coarsen, which computes
    # the fewest tokens a repair can (one); no KV-level repair computes fewer, so none stands beside it
    assert repairs["coarsen"].fidelity.top1_agree
    recommendation = turn["recommendation"]
    assert recommendation["repair"] == "coarsen" and recommendation["kv_alternative"] is None
    assert f"coarsen (prompt-level, any prefix cache serves it today) computes 1 of {len(new):,} tokens" in recommendation["reason"]
    # at KL 0 and full agreement only the exact reference holds (field_only's KL is above 0: the next test)
    strict = recommend(repairs, threshold=0.0, min_agreement=1.0)
    assert strict.repair == "recompute" and strict.kv_alternative is None


def test_field_only_and_erratum_are_inexact_where_recompute_is_exact(lm):
    """The stale repairs read the old value (field_only: later entries computed with it; erratum: still in the prompt),
    so their next token's distribution differs from the clean prefill's, while the reference's does not."""
    log = _log(_request(), _request(tier="platinum"))
    repairs = audit_requests(lm, parse_log(log), measure=measure_settings(repairs=["field_only", "erratum"], tokens=4)).turns[1].repairs
    assert repairs["recompute"].fidelity.kl < 1e-6
    assert repairs["field_only"].fidelity.kl > 1e-4 and repairs["erratum"].fidelity.kl > 1e-4


def test_field_only_and_erratum_flip_the_next_token_where_recompute_keeps_it(lm):
    """A constructed case on tiny-qwen2 (seed 0): two fields change, one to a long value. The clean prefill's top
    token is one that neither stale repair puts first (measured: the clean prefill leads by 0.09 nats, field_only and
    erratum prefer others by 0.14 and 0.24, far above float rounding), so a decision read from them flips."""
    log = _log(_request(), _request(user="u-11111", tier="frozen account pending review by the fraud team"))
    turn = audit_requests(lm, parse_log(log), measure=measure_settings(repairs=["field_only", "erratum"], tokens=1)).turns[1]
    assert [change.name for change in turn.fields] == ["user_id", "account_tier"]
    repairs = turn.repairs
    assert repairs["recompute"].fidelity.top1_agree and repairs["recompute"].fidelity.kl < 1e-6
    for name in ("field_only", "erratum"):
        assert not repairs[name].fidelity.top1_agree and repairs[name].fidelity.kl > 1e-3, name


def test_the_top_token_is_read_as_greedy_decoding_reads_it_when_two_tie():
    """In bfloat16 two logits can tie exactly (measured: 'Yes' and 'No' at -1.0625 on the interleaved log): the state's
    greedy tokens all agree with the clean prefill's, so its top token must not be said to change (``topk`` put the
    later of the tied first)."""
    logits = torch.randn(151_936, generator=torch.Generator().manual_seed(0))
    logits[[2753, 9454]] = 9.0
    assert torch.log_softmax(logits, -1).topk(5).indices[0].item() == 9454 and logits.argmax().item() == 2753  # topk: the later first
    before = logits.clone()
    before[9454] = 8.0
    clean = Reference(torch.log_softmax(before, -1), (2753,), 0.0, Notebook.__new__(Notebook))
    measured = fidelity(torch.log_softmax(logits, -1), (2753,), clean)
    assert measured.top1_agree and measured.generation_agreement == 1.0 and measured.kl > 0
    assert not fidelity(torch.log_softmax(before.roll(1), -1), (2752,), clean).top1_agree


def test_coarse_grains():
    assert coarse("2026-12-01 09:14", "date") == "2026-12-01"
    assert coarse("2026-12-01T09:14:33Z", "hour") == "2026-12-01 09:00"
    assert coarse("2026-12-01 9:14", "minute") == "2026-12-01 09:14"


@pytest.mark.parametrize(
    "value, hour",
    [
        ("2026-12-01", "2026-12-01"),
        ("2026-12-01 9:14", "2026-12-01 09:00"),
        ("2026-12-01T09:14:33Z", "2026-12-01 09:00"),
        ("2026-12-01T23:59:59.250+02:00", "2026-12-01 23:00"),
        ("2026-12-01 09:14:33-0500", "2026-12-01 09:00"),
    ],
)
def test_one_date_time_pattern_is_found_widened_and_coarsened_alike(lm, value, hour):
    """The diff widens a change to the whole date-time, the volatile-span finder marks all of it, and ``coarsen``
    reads it: one pattern (``kvscope.engine.audit.changes.fields.DATETIME``), so the three agree on every form."""
    assert coarse(value, "hour") == hour
    old = render_request(lm, parse_log(_log(_request(time="1999-01-01")))[0])
    new = render_request(lm, parse_log(_log(_request(time=value)))[0])
    (change,) = diff_requests(old, new, BLOCK_TOKENS).fields
    assert (change.old, change.new) == ("1999-01-01", value)
    kinds = {candidate.text: candidate.kind for candidate in candidates(lm, new.request)[1]}
    assert kinds[value] == "datetime"


def test_the_scenario_of_a_log_with_hostile_text_reads_back_as_written(lm):
    """Quotes, backslashes, control characters (DEL is not allowed raw in a TOML string), braces and non-ASCII text in
    the prompt and the labels: the scenario written from the audit parses back to the same text."""
    hostile = 'say "hi" \\ back\tslash \x7f del \x07 bell {x} }} {{ é 中'
    system = "Rules: " + hostile + "\nAccount tier: {tier}"
    log = _log(
        *(
            {"messages": [{"role": "system", "content": system.replace("{tier}", tier)}, {"role": "user", "content": hostile}]}
            for tier in ("gold", "platinum")
        )
    )
    report = audit_requests(lm, parse_log(log), measure=measure_settings(repairs=["recompute"], tokens=1))
    labels = ('y"es\\', "n\x7fo {no}")
    scenario = Scenario.from_toml(scenario_toml(report, labels))
    assert scenario.context == escape_braces("Rules: " + hostile + "\nAccount tier: ") + "{account_tier}"
    assert unescape_braces(scenario.question) == hostile.strip()
    assert scenario.answers == {label: (label,) for label in labels}
    assert (scenario.field().old, scenario.field().new) == ("gold", "platinum")
    assert scenario.description == "Built from a request log: account_tier 'gold' -> 'platinum'"


def _greedy(lm, request, tokens):
    return ComputedStates(lm, tokens).read_prompt(request.ids).generated


def test_the_audit_and_the_edit_stop_where_the_generation_config_ends_a_turn():
    """A chat model's generation config can end a turn at tokens the tokenizer does not call EOS: the audit's greedy
    tokens and the edit's chain of thought both stop there (one list for both, ``LoadedModel.stop_ids``)."""
    plain = tiny_model("qwen2")
    request = render_request(plain, parse_log(_log(_request()))[0])
    free = _greedy(plain, request, 8)
    stop = free[3]
    assert stop not in free[:3] and stop != plain.tokenizer.eos_token_id and plain.tokenizer.eos_token_id not in free
    ended = tiny_model("qwen2")
    ended.model.generation_config.eos_token_id = [ended.tokenizer.eos_token_id, stop]
    assert _greedy(ended, request, 8) == free[:3]
    scenario = Scenario.load(DEMOS / "scenarios" / "refund_gate.toml")
    experiment = EditExperiment(plain, scenario)
    assert experiment.cot_decision(experiment.stale.notebook)[1] != ""
    ended.model.generation_config.eos_token_id = list(range(len(ended.tokenizer)))  # every token ends the turn
    del ended.stop_ids  # read again (a cached property)
    ending = EditExperiment(ended, scenario)
    assert ending.cot_decision(ending.stale.notebook)[1] == "" and _greedy(ended, request, 8) == ()


def test_the_scenario_and_template_reproduce_the_edit(lm):
    log = _log(_request(), _request(tier="platinum"))
    report = audit_requests(lm, parse_log(log), measure=measure_settings(repairs=["recompute"], tokens=2))
    scenario = Scenario.from_toml(scenario_toml(report))
    field = scenario.field()
    assert (field.name, field.old, field.new) == ("account_tier", "gold", "platinum")
    assert "Account tier: {account_tier}" in scenario.context and scenario.question == "Where is my parcel?"
    assert EditExperiment(lm, scenario).report(["field_only", "erratum"]).as_dict()["new"] == "platinum"
    template = json.loads(repaired_template(report))
    assert "Account tier: {account_tier}" in template[0]["content"] and template[-1]["content"] == "Where is my parcel?"


INDENTED = 'You are the agent.\n    Session started: {time}\nUser id: {user}\nAnswer briefly; reply as {{"answer": ...}}.'


def _indented(time: str, user: str = "u-1") -> dict:
    system = INDENTED.format(time=time, user=user)
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Where is it?"}]}


@pytest.mark.parametrize(
    "user, expected", [("u-1", {"recompute", "erratum", "hoist", "coarsen"}), ("u-22", {"recompute", "erratum", "hoist"})]
)
def test_each_prompt_level_template_applied_to_the_log_sends_the_measured_tokens(lm, user, expected):
    """What is written is what was measured: each template, applied to the log as ``--template`` applies it, sends the
    audited request as the very token ids the audit measured for that repair. The indented volatile line is read
    where it stands and moved stripped; a second field is moved with it; the literal braces stay as they are; the
    erratum's template keeps the older value and reads each request's own from its line."""
    log = _log(_indented("2026-12-01 09:14"), _indented("2026-12-01 10:15", user))
    report = audit_requests(lm, parse_log(log), measure=measure_settings(tokens=1, grain="hour"))
    turn = report.turns[1]
    checked = set()
    for name in ("recompute", "erratum", "hoist", "coarsen"):
        measured = turn.repairs[name]
        if not measured.applicable:  # coarsen: a user id has no hour
            continue
        rewritten = apply_template(repaired_template(report, name), read_log(log)).requests
        assert render_request(lm, rewritten[1]).ids == measured.prompt_ids, name
        checked.add(name)
    assert checked == expected
    hoisted = json.loads(repaired_template(report, "hoist"))
    assert "Session started" not in hoisted[0]["content"] and '{"answer": ...}' in hoisted[0]["content"]
    moved = "Session started: {session_started}" + ("\nUser id: {user_id}" if user != "u-1" else "")
    assert hoisted[-1]["content"] == "Where is it?\n\n" + moved
    erratum = json.loads(repaired_template(report, "erratum"))
    assert "    Session started: 2026-12-01 09:14" in erratum["messages"][0]["content"]  # the older value, kept
    assert erratum["read"][0] == "Session started: {session_started}"
    assert repaired_template(report) == repaired_template(report, turn.recommendation.repair)
    with pytest.raises(RequestLogError, match="field_only is KV-level, needs a cache-editing engine"):
        repaired_template(report, "field_only")


@pytest.mark.parametrize("name", ["support_agent", "traffic/interleaved_agents"])
def test_the_bundled_logs_templates_applied_send_the_measured_tokens(lm, name):
    """The traffic audit (what ``kvscope audit LOG --template-out`` writes from): each prompt-level repair's template,
    applied to the whole log, sends the turn it was written from as the tokens measured; in the interleaved log the
    template of one agent's prompt leaves the other agent's requests as logged."""
    log = read_log((DEMOS / "logs" / f"{name}.jsonl").read_text(encoding="utf-8"))
    report = audit_traffic(
        lm, log, measure=measure_settings(repairs=["erratum", "hoist", "coarsen"], tokens=1, grain="date")
    ).measured_report()
    turn = report.last_with_fields()
    written = {}
    for repair, measured in turn.repairs.items():
        if not measured.applicable:  # coarsen: an account tier has no date
            continue
        rewritten = apply_template(repaired_template(report, repair), log).requests
        (request,) = [r for r in rewritten if r.index == turn.request]
        assert render_request(lm, request).ids == measured.prompt_ids, repair
        written[repair] = [r.index for r, old in zip(rewritten, log.requests) if r != old]
    assert set(written) == {"recompute", "erratum", "hoist"} and written["recompute"] == []
    sessions = {request.index: request.session for request in log.requests}
    assert written["hoist"] == written["erratum"] == [i for i in sessions if sessions[i] == sessions[turn.request]]


def test_one_prompt_offers_volatile_spans_and_audits_a_new_value(lm):
    request = parse_prompt(json.dumps(_request()["messages"]))
    _, found = candidates(lm, request)
    kinds = {candidate.text: candidate.kind for candidate in found}
    assert kinds["2026-12-01 09:14"] == "datetime" and kinds["u-48213"] == "id" and kinds["gold"] == "value"
    content = request.contents[0]
    start = content.index("gold")
    report = audit_value(lm, request, (start, start + 4), "silver", message=0, measure=measure_settings(repairs=["field_only"], tokens=2))
    assert [change.as_dict()["new"] for change in report.turns[1].fields] == ["silver"]
    assert parse_prompt("Plain text with 2026-12-01 in it").messages[0].role == "user"


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}\n{not json', "line 2 is not JSON"),
        ('{"model": "x"}', r"line 1 \(request 1\) has no 'messages'"),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}',
            "line 1 (request 1), message 2: unknown role 'wizard'",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
            "message 1, part 1: a 'image_url' content part is not text",
        ),
        ("", "the log is empty"),
    ],
)
def test_malformed_logs_get_a_specific_message(text, message):
    with pytest.raises(RequestLogError, match=message if "\\" in message else message.replace("(", r"\(").replace(")", r"\)")):
        parse_log(text)


def test_requests_that_cannot_be_compared_are_refused_by_name(lm):
    unrelated = _log({"prompt": "alpha"}, {"prompt": "zeta"})
    with pytest.raises(RequestLogError, match=r"line 2 \(request 2\) shares no prefix with line 1 \(request 1\)"):
        audit_requests(lm, parse_log(unrelated), measure=measure_settings(tokens=1))
    role_changed = _log(
        _request(),
        {
            "messages": [
                {"role": "developer", "content": SYSTEM.format(time="2026-12-01 09:14", user="u-48213", tier="gold")},
                {"role": "user", "content": "Where is my parcel?"},
            ]
        },
    )
    with pytest.raises(RequestLogError, match="change the chat template's own tokens"):
        audit_requests(lm, parse_log(role_changed), measure=measure_settings(tokens=1))
    with pytest.raises(RequestLogError, match=r"line 1 \(request 1\) is \d+ tokens, longer than the context limit of 20"):
        audit_requests(lm, parse_log(_log(_request(), _request())), measure=measure_settings(tokens=1, context_limit=20))
    with pytest.raises(RequestLogError, match="unknown repair 'magic'"):
        audit_requests(lm, parse_log(_log(_request(), _request())), measure=measure_settings(repairs=["magic"]))
