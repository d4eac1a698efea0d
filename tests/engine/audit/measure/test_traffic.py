"""Traffic audits on tiny models and a tiny tokenizer with Qwen2.5's tool-calling chat template: every format read as
the OpenAI request it is equivalent to, tools rendered as apply_chat_template renders them, malformed records skipped
by name, matches and engine reuse against brute-force counts, causes named, and sampled groups measured exactly as the
per-turn audit measures them."""

import gc
import json
import random

import numpy as np
import pytest

from kvscope.engine.audit.logs.reading import parse_log, read_log
from kvscope.engine.audit.logs.render import render_batch
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic, pending_report
from kvscope.engine.audit.measure.turn import audit_requests
from kvscope.engine.audit.scan.sampling import bounded_sample, traffic_scan
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import BlockCache, CacheSettings, SlotCache
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.radix import RadixTree
from kvscope.engine.cache.budget import Cancelled
from kvscope.engine.models.tiny import tiny_model, tiny_tokenizer
from tests.shared import assert_valid_report

# Qwen2.5-Instruct's chat template (Apache-2.0): tools in the system turn, <tool_call> blocks, tool responses.
QWEN_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\'
    'n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and'
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-nam'
    'e>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
    " assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (m'
    'essage.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the repo",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        },
    },
]
SYSTEM = "You are Forge, a coding agent.\nThe current time is 2026-05-12 09:41.\nWork carefully and briefly."
AGENT_MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Where is the parser?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"pattern": "def parse"}'}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "kvscope/engine/parse.py:12: def parse(text):"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def _ids(tokenizer, request):
    rendered = render_batch(tokenizer, [request], 100_000)[0]
    assert not isinstance(rendered, Exception), rendered
    return rendered.token_ids.tolist()


def _one(tokenizer, record):
    log = read_log(json.dumps(record))
    assert not log.skipped, log.skipped
    return [_ids(tokenizer, request) for request in log.requests]


def test_tools_and_tool_calls_render_as_apply_chat_template_does(tokenizer):
    expected_messages = json.loads(json.dumps(AGENT_MESSAGES))
    expected_messages[2]["tool_calls"][0]["function"]["arguments"] = {"pattern": "def parse"}  # parsed, as vLLM does
    expected = tokenizer.apply_chat_template(expected_messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    ids = _one(tokenizer, {"messages": AGENT_MESSAGES, "tools": TOOLS})[0]
    assert ids == list(expected)
    text = tokenizer.decode(ids)
    assert '"name": "search", "arguments": {"pattern": "def parse"}' in text and "<tool_response>" in text
    legacy = {"messages": AGENT_MESSAGES, "functions": [tool["function"] for tool in TOOLS]}
    assert _one(tokenizer, legacy)[0] == ids


def test_every_format_renders_as_its_openai_request(tokenizer):
    openai = _one(tokenizer, {"messages": AGENT_MESSAGES, "tools": TOOLS})[0]
    anthropic = {
        "model": "claude",
        "max_tokens": 100,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]}
            for t in TOOLS
        ],
        "messages": [
            {"role": "user", "content": "Where is the parser?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "search", "input": {"pattern": "def parse"}}]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "kvscope/engine/parse.py:12: def parse(text):"}],
            },
        ],
    }
    responses = {
        "instructions": SYSTEM,
        "tools": [{"type": "function", **t["function"]} for t in TOOLS],
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Where is the parser?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "search", "arguments": '{"pattern": "def parse"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "kvscope/engine/parse.py:12: def parse(text):"},
        ],
    }
    assert _one(tokenizer, anthropic)[0] == openai
    assert _one(tokenizer, responses)[0] == openai
    assert _one(tokenizer, {"request": {"messages": AGENT_MESSAGES, "tools": TOOLS}, "response": {}, "timestamp": 1})[0] == openai
    batch = {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": AGENT_MESSAGES, "tools": TOOLS}}
    assert _one(tokenizer, batch)[0] == openai
    sharegpt = {
        "id": "c9",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Bye"},
            {"from": "gpt", "value": "Bye"},
        ],
    }
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    second = [*first, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert _one(tokenizer, sharegpt) == [_one(tokenizer, {"messages": first})[0], _one(tokenizer, {"messages": second})[0]]
    log = read_log(json.dumps(anthropic) + "\n" + json.dumps(sharegpt))
    assert log.formats == {"anthropic": 1, "sharegpt": 2} and log.requests[1].session == "c9"
    rendered = render_batch(tokenizer, log.requests[:1], 100_000)[0]
    scan = scan_log(tokenizer, read_log(json.dumps(anthropic)))
    ((label, token),) = [(mark.label, mark.token) for mark in scan.requests[0].breakpoints]
    cached = tokenizer.decode(rendered.token_ids[:token].tolist())  # up to the token holding the block's last character
    assert label == "system block 1" and cached.rstrip().endswith("Work carefully and briefly.") and "# Tools" not in cached


def test_malformed_records_are_skipped_by_name_and_the_rest_is_audited_as_without_them(tokenizer):
    good = [
        json.dumps(
            {
                "messages": [{"role": "system", "content": SYSTEM.replace("09:41", f"09:4{i}")}, {"role": "user", "content": "Hi"}],
                "user": "s1",
            }
        )
        for i in range(3)
    ]
    bad = [
        "{not json",
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps({"model": "m"}),
        json.dumps({"input": [{"type": "reasoning"}]}),
    ]
    mixed = "\n".join([good[0], bad[0], good[1], bad[1], bad[2], bad[3], good[2]])
    log = read_log(mixed)
    assert [(s.line, s.key) for s in log.skipped] == [(2, ""), (4, "message 1"), (5, ""), (6, "input item 1 type")]
    assert "is not JSON" in log.skipped[0].reason and "unknown role 'wizard'" in log.skipped[1].reason
    assert "line 6, input item 1 type: 'reasoning' items" in log.skipped[3].message
    clean = scan_log(tokenizer, read_log("\n".join(good)))
    mixed_scan = scan_log(tokenizer, log)
    keys = ("tokens", "common_prefix_tokens", "fields", "reused_tokens", "signature")
    assert [[row.as_dict()[k] for k in keys] for row in mixed_scan.requests] == [[row.as_dict()[k] for k in keys] for row in clean.requests]
    assert len(mixed_scan.skipped) == 4 and mixed_scan.requests[1].fields == ("current_time",)
    with pytest.raises(Exception, match=r"line 2 is not JSON"):
        parse_log(mixed)


def _chat(system, *turns, tools=None, session=None):
    record = {"messages": [{"role": "system", "content": system}, *({"role": r, "content": c} for r, c in turns)]}
    if tools:
        record["tools"] = tools
    if session:
        record["user"] = session
    return json.dumps(record)


def _interleaved(seed=0, sessions=6, requests=40):
    rng = random.Random(seed)
    prompts = [
        "You are the help desk.\nThe current time is 2026-05-12 09:{m:02d}.\nBe brief.",
        "Policy: refunds within 30 days.\nSession {s}.",
    ]
    state = {s: [] for s in range(sessions)}
    lines = []
    for minute in range(requests):
        s = rng.randrange(sessions)
        if state[s] and rng.random() < 0.7:
            state[s] += [("assistant", f"Answer {len(state[s])}."), ("user", rng.choice(["And then?", "Why?", "Thanks"]))]
        elif not state[s]:
            state[s] = [("user", rng.choice(["Where is my parcel?", "Can I return it?"]))]
        system = prompts[s % 2].format(m=minute if rng.random() < 0.5 else 0, s=s)
        lines.append(_chat(system, *state[s], session=f"s{s}"))
    return "\n".join(lines)


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_matches_and_engine_reuse_equal_brute_force_counts(tokenizer):
    log = read_log(_interleaved())
    scan = scan_log(tokenizer, log, ScanSettings(CacheSettings(prompt_cache=False)))  # the brute force's llama.cpp: a slot per session
    ids = [_ids(tokenizer, request) for request in log.requests]
    sessions = [request.session for request in log.requests]
    for i, row in enumerate(scan.requests):
        shared = [_lcp(ids[j], ids[i]) for j in range(i)]
        best = max(shared, default=0)
        tied = [j for j in range(i) if shared[j] == best]
        own = [j for j in tied if sessions[j] == sessions[i]]
        expected = None if best == 0 else (own or tied)[-1] + 1
        assert (row.matched_request, row.common_prefix_tokens) == (expected, best), i
        usable = min(best, len(ids[i]) - 1)
        previous = next((ids[j] for j in range(i - 1, -1, -1) if sessions[j] == sessions[i]), [])
        expected = {"vllm": usable // 16 * 16, "sglang": usable, "llama_cpp": min(_lcp(previous, ids[i]), len(ids[i]) - 1)}
        assert row.prompts_only_reused_tokens == expected  # with replies: tests/engine/audit/logs/test_replies.py
    assert len({row.session for row in scan.requests}) == 6
    per_session = {s.session: s for s in scan.sessions()}
    assert sum(s.requests for s in per_session.values()) == 40
    assert per_session["s0"].tokens == sum(len(ids[i]) for i in range(40) if sessions[i] == "s0")


def test_the_token_pass_leaves_the_collector_as_it_found_it(tokenizer):
    # scan_log freezes what it keeps (``settling_heap``) while it runs, and unfreezes it: nothing stays out of reach
    gc.collect()
    frozen = gc.get_freeze_count()
    seen = []
    scan_log(tokenizer, read_log(_interleaved()), progress=lambda done, total: seen.append(gc.get_freeze_count()))
    assert max(seen) > frozen and gc.get_freeze_count() == 0


def test_radix_budget_evicts_least_recently_used_leaves():
    cache = RadixTree(budget_tokens=10)
    sequences = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9], [10, 11, 12], [1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 9]]
    reused = [cache.insert(np.array(seq, dtype=np.int32), n, None, n) for n, seq in enumerate(sequences, 1)]
    assert reused == [0, 3, 0, 3, 3]  # [4,5,6] went first (request 1), then [7,8,9] (2), then [10,11,12] (3)
    assert list(cache.evicted) == [(1, 3), (2, 3), (3, 3)] and cache.tokens == 9


def test_block_budget_evicts_least_recently_used_blocks_tail_first():
    cache = BlockCache(block=4, budget_blocks=3)
    sequences = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 1], [20, 21, 22, 23, 24], [1, 2, 3, 4, 5, 6, 7, 8, 0]]
    reused = [cache.insert(CacheRequest(np.array(seq, dtype=np.int32), n)) for n, seq in enumerate(sequences, 1)]
    assert reused == [0, 4, 0, 4]  # request 4 finds its first block but not its second (evicted by request 3)
    assert list(cache.evicted) == [(1, 1), (2, 1)]  # request 1's tail block, then request 2's
    assert BlockCache(block=4).insert(CacheRequest(np.arange(8, dtype=np.int32), 1)) == 0


def test_llama_cpp_slots_reuse_the_prefix_and_shifted_chunks():
    for minimum, expected in ((3, 6), (5, 2)):
        slots = SlotCache(cache_reuse=minimum)
        slots.insert(CacheRequest(np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32), 1, "a"))
        assert slots.insert(CacheRequest(np.array([1, 2, 5, 6, 7, 8, 10], dtype=np.int32), 2, "a")) == expected
    shared = SlotCache(slots=1)
    shared.insert(CacheRequest(np.array([1, 2, 3], dtype=np.int32), 1, "a"))
    assert shared.insert(CacheRequest(np.array([1, 2, 4], dtype=np.int32), 2, "b")) == 2  # b takes over a's slot and its tokens
    assert shared.insert(CacheRequest(np.array([1, 2, 3], dtype=np.int32), 3, "a")) == 2


CLOCK = (
    "You are the help desk.\nThe current time is 2026-05-12 09:{m}.\nRequest id: {rid}\nTurn: {turn}\nNonce: {nonce}\n"
    "Be  brief{space}please."
)


def _base(**values):
    fields = {"m": "41", "rid": "3f2a9c1e-0d4b-4c1e-9a7b-2b6c8d9e0f11", "turn": "7", "nonce": "a81f9c2d77e4", "space": " "}
    return CLOCK.format(**{**fields, **values})


@pytest.mark.parametrize(
    "change, cause, field",
    [
        ({"m": "42"}, "clock", "current_time"),
        ({"rid": "77aa9c1e-0d4b-4c1e-9a7b-2b6c8d9e0f99"}, "id", "request_id"),
        ({"turn": "8"}, "counter", "turn"),
        ({"nonce": "0be4ff19c3a2"}, "nonce", "nonce"),
        ({"space": "  "}, "whitespace", None),
    ],
)
def test_a_changed_value_is_named_by_its_kind_and_its_context(tokenizer, change, cause, field):
    scan = scan_log(tokenizer, read_log(_chat(_base(), ("user", "Hi")) + "\n" + _chat(_base(**change), ("user", "Hi"))))
    causes = scan.requests[1].causes
    assert causes[0].name == cause and (field is None or causes[0].field == field)
    shared = scan.requests[1].common_prefix_tokens
    assert causes[-1].name == ("short_prefix" if shared < 16 else "block_straddle") or shared % 16 == 0
    if shared >= 16 and shared % 16:
        assert causes[-1].tokens == shared % 16


def test_tools_and_key_order_are_cache_breaks_not_fields(tokenizer):
    base = _chat(SYSTEM, ("user", '{"order": 7, "status": "shipped"}'), tools=TOOLS)
    cases = {
        _chat(SYSTEM, ("user", '{"status": "shipped", "order": 7}'), tools=TOOLS): "key_order",
        _chat(SYSTEM, ("user", '{"order": 7, "status": "shipped"}'), tools=TOOLS[::-1]): "tools_reordered",
        _chat(SYSTEM, ("user", '{"order": 7, "status": "shipped"}'), tools=TOOLS[:1]): "tools_changed",
    }
    for line, cause in cases.items():
        row = scan_log(tokenizer, read_log(base + "\n" + line)).requests[1]
        assert row.causes[0].name == cause and not (cause.startswith("tools") and row.fields), (cause, row)
    removed = scan_log(tokenizer, read_log(base + "\n" + next(iter(list(cases)[2:])))).requests[1].causes[0]
    assert removed.detail == "tools: removed search"


def test_sampling_covers_every_group_and_a_group_measured_in_full_equals_the_per_turn_audit():
    lm = tiny_model("qwen2")
    system = "You are the help desk.\nSession started: 2026-05-12 09:{m}\nBe brief."
    lines = [
        _chat(system.format(m="41"), ("user", "Where is my parcel?")),
        _chat(system.format(m="42"), ("user", "Where is my parcel?")),
        _chat(system.format(m="43"), ("user", "Where is my parcel?")),
        _chat(system.format(m="43"), ("user", "Where is my parcel?"), ("assistant", "Soon."), ("user", "When?")),
    ]
    text = "\n".join(lines)
    measure = measure_settings(["recompute", "field_only", "erratum"], tokens=4)
    full = audit_traffic(lm, read_log(text), sample=10, measure=measure)
    today = audit_requests(lm, parse_log(text), measure=measure)
    timing = ("ttft_ms", "ttft_ratio", "full_ttft_ms")
    for turn, expected in zip([full.turns[i] for i in sorted(full.turns)], today.turns[1:]):
        got, want = turn.as_dict(), expected.as_dict()
        assert got["fields"] == want["fields"] and got["recommendation"]["repair"] == want["recommendation"]["repair"]
        for name, result in got["repairs"].items():
            other = want["repairs"][name]
            assert {k: v for k, v in result.items() if k not in (*timing, "kl")} == {
                k: v for k, v in other.items() if k not in (*timing, "kl")
            }
            assert result["kl"] == pytest.approx(other["kl"], abs=1e-5)
    sampled = audit_traffic(lm, read_log(text), sample=1, measure=measure)
    data = sampled.as_dict()
    groups = {g["signature"]: g for g in data["groups"]}
    assert set(groups) == {"new_prefix", "block_straddle + clock:session_started", "growth"} or all(
        g["measured"] or g["measurable"] == 0 for g in groups.values()
    )
    assert all(len(g["measured"]) == min(1, g["measurable"]) for g in groups.values())
    assert sum(g["count"] for g in groups.values()) == 4 and data["sampled"] is True
    clock = next(g for g in groups.values() if "clock:session_started" in g["signature"])
    assert clock["count"] == 2 and clock["fidelity"]["recompute"]["worst_kl"] < 1e-5


def test_a_cancelled_model_pass_keeps_the_whole_token_pass_and_says_so():
    lm = tiny_model("qwen2")
    system = "You are the help desk.\nSession started: 2026-05-12 09:{m}\nBe brief."
    text = "\n".join(_chat(system.format(m=m), ("user", "Where is my parcel?")) for m in ("41", "42", "43"))
    whole = audit_traffic(lm, read_log(text), sample=0)

    def cancelled(work, measure, tick):
        tick()  # one step done, then the person cancels
        raise Cancelled("audit cancelled")

    report = audit_traffic(lm, read_log(text), sample=2, measure_turns=cancelled)
    data, expected = report.as_dict(), whole.as_dict()
    assert report.turns == {} and data["turns"] == expected["turns"] and data["requests"] == expected["requests"]
    assert data["engines"] == expected["engines"]
    reasons = [{**group, "reason": None} for group in data["groups"]], [{**group, "reason": None} for group in expected["groups"]]
    assert reasons[0] == reasons[1]  # the same groups; only why none was measured differs
    cancelled_reason = "not measured: the model pass was cancelled"
    assert [cancelled_reason if group["reason"] == "not measured: --sample 0" else group["reason"] for group in expected["groups"]] == [
        group["reason"] for group in data["groups"]
    ]
    assert cancelled_reason in [group["reason"] for group in data["groups"]]
    steps = 2 * (len(report.measure.repairs) + 1)  # two turns to measure, each unrepaired and with every repair
    said = f"the model pass was cancelled after 1 of {steps} steps (0 of 2 turns measured, not kept): the token pass is whole"
    assert data["cancelled"] == said
    assert "cancelled" not in expected


def test_the_token_pass_shown_while_the_model_pass_runs_is_the_audits_own():
    lm = tiny_model("qwen2")
    system = "You are the help desk.\nSession started: 2026-05-12 09:{m}\nBe brief."
    text = "\n".join(_chat(system.format(m=m), ("user", "Where is my parcel?")) for m in ("41", "42", "43", "44"))
    measure = measure_settings(["recompute", "field_only"], tokens=2)
    scan = traffic_scan(lm, read_log(text))
    assert [row.as_dict() for row in scan.requests] == [row.as_dict() for row in scan_log(lm.tokenizer, read_log(text)).requests]
    pending = pending_report(lm, scan, 2, measure).as_dict()
    given = audit_traffic(lm, read_log(text), sample=2, scan=scan, measure=measure).as_dict()
    made = audit_traffic(lm, read_log(text), sample=2, measure=measure).as_dict()
    timing = ("ttft_ms", "ttft_ratio", "full_ttft_ms", "recommendation", "recommended")  # measured times, and what they decide

    def untimed(value):
        if isinstance(value, dict):
            return {k: untimed(v) for k, v in value.items() if k not in timing}
        return [untimed(v) for v in value] if isinstance(value, list) else value

    assert untimed(given) == untimed(made)  # a token pass given is the one the audit would make
    assert pending["requests"] == made["requests"] and pending["engines"] == made["engines"] and pending["causes"] == made["causes"]
    measured = sum(len(group["measured"]) for group in made["groups"])
    assert measured == 2 and pending["pending"] == (
        f"the token pass is whole; the model pass is measuring 2 turns of {len(made['groups'])} change signature"
        f"{'s' if len(made['groups']) != 1 else ''} with 2 repairs each"
    )
    assert all(group["measured"] == [] for group in pending["groups"]) and "pending" not in made
    assert "being measured: the model pass is running" in [group["reason"] for group in pending["groups"]]
    assert_valid_report(pending)  # the published schema names it
    assert [bounded_sample(scan, 3, most) for most in (None, 3, 2, 1, 0)] == [3, 3, 2, 1, 0]
