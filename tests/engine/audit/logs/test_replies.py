"""Replies in the simulated caches: read from every format that logs them, cached as each engine caches them (whole
blocks, the last sampled token never computed, EOS against max_tokens), read off the next turn where the log has
none, and checked against brute-force counts."""

import json
import random

import numpy as np
import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.render import end_of_turn_ids
from kvscope.engine.audit.logs.replies import Reply, computed_tokens, finish_of, reply_of
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import BlockCache, CacheSettings, ServerSlots, SlotCache
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.radix import RadixCache
from kvscope.engine.audit.simulate.step import Simulation, Step, resent_reply_end
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- reading replies


@pytest.mark.parametrize(
    "response, text, finish, ids",
    [
        ({"choices": [{"message": {"role": "assistant", "content": "Hi."}, "finish_reason": "stop"}]}, "Hi.", "eos", None),
        ({"choices": [{"message": {"content": "Hi"}, "finish_reason": "length", "token_ids": [5, 6]}]}, "Hi", "length", (5, 6)),
        ({"choices": [{"text": "abc", "finish_reason": "length"}]}, "abc", "length", None),
        ({"type": "message", "content": [{"type": "text", "text": "Yo"}], "stop_reason": "max_tokens"}, "Yo", "length", None),
        ({"type": "message", "content": [{"type": "text", "text": "Yo"}], "stop_reason": "end_turn"}, "Yo", "eos", None),
        ({"output": [{"type": "message", "content": [{"type": "output_text", "text": "R"}]}], "status": "completed"}, "R", "eos", None),
        ({"content": "ll", "stop_type": "limit", "tokens": [9, 8]}, "ll", "length", (9, 8)),
        ({"role": "assistant", "content": "plain"}, "plain", "unknown", None),
        ('{"choices": [{"message": {"content": "as text"}, "finish_reason": "stop"}]}', "as text", "eos", None),
        ("just words", "just words", "unknown", None),
    ],
)
def test_a_reply_is_read_from_every_shape_a_log_records_it_in(response, text, finish, ids):
    reply = reply_of(response)
    assert (reply.text, reply.finish, reply.token_ids) == (text, finish, ids)


def test_no_reply_where_a_response_holds_none():
    for response in (None, 3, [], {}, {"choices": []}, {"usage": {"prompt_tokens": 3}}, {"choices": [{"message": {"content": None}}]}):
        assert reply_of(response) is None
    assert finish_of("tool_calls") == "eos" and finish_of("max_output_tokens") == "length" and finish_of(None) == "unknown"


def test_every_export_keeps_its_reply(tokenizer):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    answer = {"choices": [{"message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "length"}]}
    otel_attributes = [
        {"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}},
        {
            "key": "gen_ai.input.messages",
            "value": {"stringValue": json.dumps([{"role": "user", "parts": [{"type": "text", "content": "Hi"}]}])},
        },
        {
            "key": "gen_ai.output.messages",
            "value": {
                "stringValue": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "text", "content": "Hello!"}], "finish_reason": "length"}]
                )
            },
        },
    ]
    records = {
        "gateway": {"request": chat, "response": answer, "timestamp": 1},
        "litellm_callback": {
            "call_type": "completion",
            "trace_id": "t",
            "startTime": 1.0,
            "messages": chat["messages"],
            "response": answer,
        },
        "litellm_spend_logs": {
            "request_id": "r",
            "startTime": "2026-01-01T00:00:00",
            "call_type": "acompletion",
            "proxy_server_request": chat,
            "response": json.dumps(answer),
        },  # fmt: skip
        "langfuse_observations": {
            "traceId": "t",
            "type": "GENERATION",
            "input": chat["messages"],
            "output": {"role": "assistant", "content": "Hello!"},
        },
        "helicone": {"request_body": chat, "request_id": "h", "request_created_at": "2026-01-01T00:00:00Z", "response_body": answer},
        "otel": {"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": otel_attributes, "startTimeUnixNano": "1"}]}]}]},
    }
    for source, record in records.items():
        log = read_log(json.dumps(record))
        assert log.formats == {source: 1}, (source, log.skipped)
        reply = log.requests[0].reply
        assert reply is not None and reply.text == "Hello!", source
        assert reply.finish == ("unknown" if source == "langfuse_observations" else "length"), source
    sharegpt = read_log(json.dumps({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}))
    assert sharegpt.requests[0].reply.text == "Hello!"


# ---------------------------------------------------------------- what each engine keeps


def test_the_last_sampled_token_is_never_computed():
    # text tokens of a reply ended on EOS: all kept (the EOS was the last sampled); cut at max_tokens: all but the last
    assert computed_tokens([4, 5, 6], "eos", ends_on_eos=False) == [4, 5, 6]
    assert computed_tokens([4, 5, 6], "unknown", ends_on_eos=False) == [4, 5, 6]
    assert computed_tokens([4, 5, 6], "length", ends_on_eos=False) == [4, 5]
    assert computed_tokens([4, 5, 6, 1], "eos", ends_on_eos=True) == [4, 5, 6]  # a server's ids end on the EOS itself


def test_a_block_cache_keeps_whole_blocks_of_prompt_and_reply():
    prompt, reply = np.arange(10, 40, dtype=np.int32), np.arange(100, 107, dtype=np.int32)  # 30 + 7 = 37 tokens held
    cache = BlockCache(block=8)
    assert cache.insert(CacheRequest(prompt, 1, held=np.concatenate([prompt, reply]))) == 0
    assert len(cache.blocks) == 4  # 37 // 8: the partial fifth block is never cached
    follow_up = np.concatenate([prompt, reply, [7, 7, 7, 7, 7, 7, 7, 7]]).astype(np.int32)  # 45 tokens
    assert cache.insert(CacheRequest(follow_up, 2)) == 32  # four whole blocks, 37 shared
    plain = BlockCache(block=8)
    plain.insert(CacheRequest(prompt, 1))
    assert plain.insert(CacheRequest(follow_up, 2)) == 24  # prompts only: 30 shared, three whole blocks


def test_a_radix_tree_and_a_slot_reuse_the_reply_to_the_token():
    prompt, reply = np.arange(10, 40, dtype=np.int32), np.arange(100, 107, dtype=np.int32)
    held = np.concatenate([prompt, reply])
    follow_up = np.concatenate([held, [1, 2, 3]]).astype(np.int32)
    radix, slots = RadixCache(), SlotCache()
    first, second = CacheRequest(prompt, 1, "s", 1, held), CacheRequest(follow_up, 2, "s", 2)
    assert radix.insert(first) == 0 and slots.insert(first) == 0
    assert radix.insert(second) == 37 and slots.insert(second) == 37
    assert radix.match(second) == 40 and radix.matched(second) == 2
    # a prompt equal to what is held reuses all but its last token
    assert RadixCache().insert(CacheRequest(held, 1, None, 1, held)) == 0


# ---------------------------------------------------------------- logs, against brute force


def _sessions_log(seed: int, replies: bool, finish: str = "stop") -> str:
    """Interleaved chats, each turn the previous ones with their replies; replies logged beside the request or not."""
    rng = random.Random(seed)
    chats = {s: [{"role": "system", "content": f"You are agent {s}.\nBe brief."}] for s in range(4)}
    lines = []
    for turn in range(24):
        s = rng.randrange(4)
        chats[s].append({"role": "user", "content": rng.choice(["Where is it?", "Why so?", "Thanks, and then?", "Go on."])})
        answer = " ".join(rng.choice(["Sure.", "It is here.", "Because.", "Done!", "Next we go."]) for _ in range(rng.randrange(1, 6)))
        request = {"messages": list(chats[s]), "user": f"s{s}"}
        if replies:
            response = {"choices": [{"message": {"role": "assistant", "content": answer}, "finish_reason": finish}]}
            lines.append(json.dumps({"request": request, "response": response, "timestamp": turn}))
        else:
            lines.append(json.dumps(request))
        chats[s].append({"role": "assistant", "content": answer})
    return "\n".join(lines)


def _brute_force(tokenizer, scan, held_after):
    """Per request: vLLM (block 16), SGLang and llama.cpp reuse against every earlier request's held tokens."""
    rows, rendered = scan.requests, scan.rendered
    out = []
    for i, row in enumerate(rows):
        ids = rendered[row.request].token_ids.tolist()
        earlier = [held_after(rows[j].request, i) for j in range(i)]
        best = max((_lcp(h, ids) for h in earlier), default=0)
        usable = min(best, len(ids) - 1)
        same = [held_after(rows[j].request, i) for j in range(i) if rows[j].session == row.session]
        slot = min(_lcp(same[-1], ids), len(ids) - 1) if same else 0
        out.append({"vllm": min(best, len(ids) - 1) // 16 * 16, "sglang": usable, "llama_cpp": slot})
    return out


def test_logged_replies_are_cached_as_servers_cache_them(tokenizer):
    # the brute force's llama.cpp is a slot per session (the mode a client that pins each session to a slot meets)
    scan = scan_log(tokenizer, read_log(_sessions_log(1, replies=True)), ScanSettings(CacheSettings(prompt_cache=False)))
    assert scan.totals().replies == {"logged": 24, "next_turn": 0, "none": 0}
    expected = _brute_force(tokenizer, scan, lambda request, now: scan.rendered[request].held.tolist())
    assert [row.reused_tokens for row in scan.requests] == expected
    gained = sum(r.reused_tokens["sglang"] - r.prompts_only_reused_tokens["sglang"] for r in scan.requests)
    assert gained > 0  # every follow-up turn reuses its previous reply


def test_a_log_without_replies_reads_them_off_the_next_turn_and_gives_both_ways(tokenizer):
    with_replies = scan_log(tokenizer, read_log(_sessions_log(2, replies=True)))
    without = scan_log(tokenizer, read_log(_sessions_log(2, replies=False)))
    counts = without.totals().replies
    assert counts["logged"] == 0 and counts["next_turn"] + counts["none"] == 24 and counts["none"] == 4  # each session's last
    # the replies the next turns resend are the logged ones, so the simulation is the same
    assert [r.reused_tokens for r in without.requests] == [r.reused_tokens for r in with_replies.requests]
    plain = without.totals().prompts_only.reused_tokens
    assert all(plain[engine] < without.totals().reused_tokens[engine] for engine in plain)
    ids = [without.rendered[row.request].token_ids.tolist() for row in without.requests]
    best = [max((_lcp(ids[j], ids[i]) for j in range(i)), default=0) for i in range(len(ids))]
    assert [r.prompts_only_reused_tokens["sglang"] for r in without.requests] == [min(b, len(x) - 1) for b, x in zip(best, ids)]


def test_a_reply_cut_at_max_tokens_keeps_one_token_less(tokenizer):
    eos = scan_log(tokenizer, read_log(_sessions_log(3, replies=True, finish="stop")))
    cut = scan_log(tokenizer, read_log(_sessions_log(3, replies=True, finish="length")))
    for a, b in zip(eos.requests, cut.requests):
        assert len(eos.rendered[a.request].reply_ids) == len(cut.rendered[b.request].reply_ids) + 1
    follow_ups = [
        (a, b) for a, b in zip(eos.requests, cut.requests) if a.reused_tokens["llama_cpp"] > a.prompts_only_reused_tokens["llama_cpp"]
    ]
    assert follow_ups and all(a.reused_tokens["llama_cpp"] == b.reused_tokens["llama_cpp"] + 1 for a, b in follow_ups)


def test_returned_token_ids_are_what_the_server_computed(tokenizer):
    request = {"messages": [{"role": "user", "content": "Hi"}]}
    ends = sorted(end_of_turn_ids(tokenizer))
    response = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "token_ids": [40, 41, 42, ends[0]]}]}
    log = read_log(json.dumps({"request": request, "response": response}))
    scan = scan_log(tokenizer, log)
    assert scan.rendered[1].reply_ids.tolist() == [40, 41, 42]


def test_a_template_that_rewrites_the_reply_is_named_with_the_tokens_it_costs(tokenizer):
    request = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "user": "a"}
    generated = "<think>greet</think>Hello there."
    first = {"request": request, "response": {"choices": [{"message": {"content": generated}, "finish_reason": "stop"}]}}
    resent = dict(
        request, messages=[*request["messages"], {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Bye"}]
    )
    scan = scan_log(tokenizer, read_log(json.dumps(first) + "\n" + json.dumps(resent)))
    causes = {cause.name: cause for cause in scan.requests[1].causes}
    assert "reply_rerendered" in causes
    held = scan.rendered[1].held
    kept = _lcp(held.tolist(), scan.rendered[2].token_ids.tolist())
    assert causes["reply_rerendered"].tokens == len(held) - kept > 0


def test_a_resent_reply_runs_to_the_first_end_of_turn_token():
    ends = np.array([1])
    assert resent_reply_end(np.array([5, 6]), np.array([5, 6, 7, 8, 1, 9]), ends) == 4
    assert resent_reply_end(np.array([5, 6]), np.array([5, 7, 7, 1]), ends) is None  # does not continue the prompt
    assert resent_reply_end(np.array([5, 6]), np.array([5, 6, 1]), ends) is None  # no reply between
    assert resent_reply_end(np.array([5, 6]), np.array([5, 6, 7]), ends) is None  # no end of turn


def test_a_fleet_replica_holds_the_reply_of_the_request_it_served():
    simulation = Simulation(CacheSettings(block=4), fleet=[(2, "session")], end_ids=[1])
    a = np.array([10, 11, 12, 13, 14], dtype=np.int32)
    empty = np.zeros(0, dtype=np.int32)
    simulation.step(Step(a, empty, 1, "s"))
    b = np.array([10, 11, 12, 13, 14, 20, 21, 22, 1, 30, 31], dtype=np.int32)  # a, the reply 20 21 22, EOS, more
    result = simulation.step(Step(b, empty, 2, "s"))
    assert result.reused == {"vllm": 8, "sglang": 8, "llama_cpp": 8} and result.prompts_only == {"vllm": 4, "sglang": 5, "llama_cpp": 5}
    assert simulation.fleets[0].result().reused_tokens == {"vllm": 8, "sglang": 8, "llama_cpp": 8}
    assert simulation.reply_from == {1: (2, 3)}


def test_a_reply_object_is_the_message_the_next_turn_sends():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert Reply("t", (call,)).as_message() == {"role": "assistant", "content": "t", "tool_calls": [call]}


# ---------------------------------------------------------------- llama-server's defaults: slot choice and RAM cache


def test_llama_servers_ram_cache_restores_a_session_another_took_the_slot_from():
    # the server's defaults (4 slots, one KV cache): a request that starts clears every other idle slot into the RAM
    # cache, and a later turn of that session is restored from it (it keeps all of itself, and beats the slot's share)
    system = np.arange(100, 110, dtype=np.int32)
    a = np.concatenate([system, np.arange(200, 240)]).astype(np.int32)  # 50 tokens
    b = np.concatenate([system, np.arange(300, 340)]).astype(np.int32)
    slots = ServerSlots()
    assert slots.insert(CacheRequest(a, 1, held=np.concatenate([a, [7, 7]]).astype(np.int32))) == 0
    assert slots.insert(CacheRequest(b, 2)) == 10  # 10 of 50 shared, above a tenth: a's slot, which would lose 42 of its 52
    assert [len(entry) for entry in slots.ram.entries()] == [52]  # a and its reply were saved before the slot was reused
    a2 = np.concatenate([a, [7, 7, 9, 9, 9]]).astype(np.int32)
    assert slots.insert(CacheRequest(a2, 3)) == 52  # restored: a2 shares all 52 of the saved entry
    assert [len(entry) for entry in slots.ram.entries()] == [50]  # b was saved in its turn, a's entry left the cache


def test_llama_servers_slot_choice_needs_more_than_a_tenth_shared():
    slots = ServerSlots(slots=2)  # -np 2: two slots, not unified, so idle slots are saved but kept
    a, b = np.arange(10, 60, dtype=np.int32), np.arange(500, 550, dtype=np.int32)
    slots.insert(CacheRequest(a, 1))  # both never used: the later slot wins the tie (slot 1)
    assert slots.insert(CacheRequest(b, 2)) == 0  # nothing shared: the least recently used slot, the never-used slot 0
    assert [len(tokens) for tokens in slots.tokens] == [50, 50]
    a2 = np.concatenate([a, [1, 2]]).astype(np.int32)
    assert slots.insert(CacheRequest(a2, 3)) == 50 and slots.used == [2, 3]  # its own slot 1, chosen by similarity


def test_the_prompt_cache_setting_feeds_the_llama_cpp_engine():
    settings = CacheSettings(prompt_cache=True)
    engines = Simulation(settings).engines
    assert isinstance(engines["llama_cpp"], ServerSlots) and settings.as_dict()["prompt_cache"] is True


def test_a_llama_server_completion_gives_its_reply_ids_and_its_cached_count(tokenizer):
    answer = {"content": "abc", "tokens": [40, 41, 42], "stop_type": "limit", "timings": {"cache_n": 5, "prompt_n": 7}}
    log = read_log(json.dumps({"request": {"messages": [{"role": "user", "content": "Hi"}]}, "response": answer, "timestamp": 1}))
    request = log.requests[0]
    assert (request.observed_cached_tokens, request.observed_prompt_tokens) == (5, 12)
    assert request.reply.token_ids == (40, 41, 42) and request.reply.finish == "length"
    assert scan_log(tokenizer, log).rendered[1].reply_ids.tolist() == [40, 41]  # the last sampled token is not in the slot
