"""Observability exports read as the requests they record: one bundled export per source (demos/logs/exports, the same
10 requests of 3 sessions written from each source's public schema), all giving the same tokens, sessions, simulated
reuse and observed cached tokens as the plain OpenAI JSONL; time order from the requests' own timestamps; bad input
skipped or flagged by line, key and reason, never stopping the log."""

import copy
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.shards import plan_shards, read_logs
from kvscope.engine.audit.logs.sources import EXPORT_SOURCES
from kvscope.engine.audit.logs.sources.otel import NOT_CAPTURED
from kvscope.engine.audit.logs.usage import observed_usage, response_usage
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE

EXPORTS = Path(__file__).resolve().parents[4] / "demos" / "logs" / "exports"
START = datetime(2026, 5, 12, 9, 0, tzinfo=timezone.utc).timestamp()
# The bundled log, written by hand: each request's session, seconds after START, and the cached tokens its server
# reported (None: the record holds no count).
SESSIONS = ["s-alpha", "s-gamma", "s-alpha", "s-beta", "s-gamma", "s-alpha", "s-beta", "s-gamma", "s-alpha", "s-beta"]
SECONDS = [0, 5, 9, 12, 20, 26, 31, 40, 44, 50]
CACHED = [None, 0, 384, 384, 256, 448, 0, 448, 512, None]
FILES = {
    "gateway": "gateway.jsonl",
    "litellm_spend_logs": "litellm_spend_logs.jsonl",
    "litellm_callback": "litellm_callback.jsonl",
    "langfuse_trace": "langfuse_traces.json",
    "langfuse_observations": "langfuse_observations.jsonl",
    "helicone": "helicone.json",
    "otel": "otel.jsonl",
}


def _text(name: str) -> str:
    return (EXPORTS / name).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def test_every_source_has_a_bundled_export():
    assert set(FILES) == set(EXPORT_SOURCES)


@pytest.mark.parametrize("source", sorted(FILES))
def test_each_source_reads_its_bundled_export_in_time_order(source):
    log = read_log(_text(FILES[source]))
    assert log.formats == {source: 10} and not log.skipped and not log.flagged
    assert log.order == "timestamps"
    assert [r.index for r in log.requests] == list(range(1, 11))
    assert [r.session for r in log.requests] == SESSIONS
    assert [r.timestamp - START for r in log.requests] == pytest.approx(SECONDS, abs=1e-3)
    assert [r.observed_cached_tokens for r in log.requests] == CACHED
    assert [r.observed_cache_write_tokens for r in log.requests] == [None] * 10
    assert {r.model for r in log.requests} == {"gpt-4o-mini"}
    assert [len(r.messages) for r in log.requests] == [2, 2, 4, 2, 4, 6, 4, 6, 8, 6]
    assert [len(r.tools) for r in log.requests] == [1] * 10


def test_the_exports_are_out_of_order_as_their_tools_write_them():
    """Helicone lists the newest first, the OTLP batches are shuffled, one Langfuse trace holds a whole session and
    the SpendLogs rows are written as calls end: each file's own order is not the time order."""
    helicone = json.loads(_text("helicone.json"))["data"]
    assert [row["request_created_at"] for row in helicone] == sorted((row["request_created_at"] for row in helicone), reverse=True)
    spans = [span for line in _text("otel.jsonl").splitlines() for span in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    starts = [int(span["startTimeUnixNano"]) for span in spans]
    assert starts != sorted(starts) and len(spans) == 11  # ten chat spans and one execute_tool span
    traces = json.loads(_text("langfuse_traces.json"))
    assert [t["sessionId"] for t in traces] == ["s-gamma", "s-alpha", "s-beta"]
    spend = [json.loads(line)["startTime"] for line in _text("litellm_spend_logs.jsonl").splitlines()]
    assert spend != sorted(spend)
    log = read_log(_text("helicone.json"))
    assert [r.line for r in log.requests] == [1] * 10  # one JSON page, written over many lines


def test_every_export_gives_the_same_tokens_sessions_reuse_and_observed_numbers(tokenizer):
    plain = scan_log(tokenizer, read_log(_text("openai.jsonl")))
    expected_ids = [ids.token_ids.tolist() for ids in plain.rendered.values()]
    keys = ("session", "tokens", "matched_request", "common_prefix_tokens", "reused_tokens", "signature")
    expected = [[row.as_dict()[k] for k in keys] for row in plain.requests]
    assert plain.totals().reused_tokens["vllm"] > 0 and len({row.session for row in plain.requests}) == 3
    for source, name in FILES.items():
        log = read_log(_text(name))
        scan = scan_log(tokenizer, log)
        assert [item.token_ids.tolist() for item in scan.rendered.values()] == expected_ids, source
        assert [[row.as_dict()[k] for k in keys] for row in scan.requests] == expected, source
        totals, reference = scan.totals().as_dict(), plain.totals().as_dict()
        assert {k: v for k, v in totals.items() if k != "replies"} == {k: v for k, v in reference.items() if k != "replies"}, source
        assert totals["replies"]["logged"] + totals["replies"]["next_turn"] >= reference["replies"]["next_turn"], source
        assert [r.observed_cached_tokens for r in log.requests] == CACHED, source
        assert scan.reading["order"] == "timestamps" and scan.reading["untimed_requests"] == 0


def test_a_plain_log_keeps_its_order_and_says_so():
    log = read_log(_text("openai.jsonl"))
    assert log.order == "log" and log.reading()["untimed_requests"] == 10
    assert log.formats == {"openai_chat": 10} and [r.session for r in log.requests] == SESSIONS


def _gateway_lines() -> list[dict]:
    return [json.loads(line) for line in _text("gateway.jsonl").splitlines()]


def test_ties_keep_the_log_order_and_a_partly_timed_log_is_read_as_logged():
    records = _gateway_lines()[:4]
    for record in records:
        record["timestamp"] = START  # all at once: the log's order decides
    reversed_log = read_log("\n".join(json.dumps(r) for r in reversed(records)))
    assert reversed_log.order == "timestamps" and [r.line for r in reversed_log.requests] == [1, 2, 3, 4]
    assert [r.session for r in reversed_log.requests] == SESSIONS[:4][::-1]
    partly = _gateway_lines()[:4][::-1]
    del partly[1]["timestamp"]
    log = read_log("\n".join(json.dumps(r) for r in partly))
    assert log.order == "log" and log.reading()["untimed_requests"] == 1
    assert [r.line for r in log.requests] == [1, 2, 3, 4] and [r.index for r in log.requests] == [1, 2, 3, 4]


def test_index_follows_the_time_order_and_matches_name_the_earlier_request(tokenizer):
    lines = _text("gateway.jsonl").splitlines()[::-1]  # newest first
    scan = scan_log(tokenizer, read_log("\n".join(lines)))
    assert [row.line for row in scan.requests] == list(range(10, 0, -1))
    assert [row.request for row in scan.requests] == list(range(1, 11))
    matched = [row.matched_request for row in scan.requests]
    assert all(m is None or m < row.request for m, row in zip(matched, scan.requests))
    assert matched[2] == 1 and matched[5] == 3  # s-alpha's turns extend its previous request


def _otel_batch() -> dict:
    return json.loads(_text("otel.jsonl").splitlines()[0])


def _set(span: dict, key: str, value: dict | None) -> None:
    span["attributes"] = [a for a in span["attributes"] if a["key"] != key] + ([{"key": key, "value": value}] if value else [])


def test_a_span_that_cannot_be_read_is_skipped_by_name_and_its_batch_read():
    batch = _otel_batch()
    spans = batch["resourceSpans"][0]["scopeSpans"][0]["spans"]
    chats = [k for k, span in enumerate(spans, 1) if span["name"].startswith("chat")]
    _set(spans[chats[0] - 1], "gen_ai.input.messages", {"stringValue": "[{'role': 'user'"})
    _set(spans[chats[1] - 1], "gen_ai.input.messages", None)  # content capture off
    log = read_log(json.dumps({"note": "x", "messages": [{"role": "user", "content": "hi"}]}) + "\n" + json.dumps(batch))
    assert len(log.requests) == 1 + len(chats) - 2 and log.formats["otel"] == len(chats) - 2
    first, second = log.skipped
    assert (first.line, first.key) == (2, f"resourceSpans 1 scopeSpans 1 spans {chats[0]} gen_ai.input.messages")
    assert "holds text that is not JSON" in first.reason
    where = f"resourceSpans 1 scopeSpans 1 spans {chats[1]} gen_ai.input.messages"
    assert (second.line, second.key, second.reason) == (2, where, NOT_CAPTURED["newer"])
    assert "SPAN_ONLY" in second.reason and "=true" not in second.reason.replace("; true is refused", "")
    _set(spans[chats[1] - 1], "gen_ai.system", {"stringValue": "openai"})  # the older conventions: messages in log records
    _set(spans[chats[1] - 1], "gen_ai.provider.name", None)
    older = read_log(json.dumps(batch)).skipped[-1]
    assert older.reason == NOT_CAPTURED["older"] and "log record" in older.reason


def test_a_helicone_row_without_its_body_is_skipped_and_the_page_read():
    page = json.loads(_text("helicone.json"))
    page["data"][3]["request_body"] = None
    del page["data"][5]["request_body"]
    page["data"][5]["signed_body_url"] = "https://example.invalid/body"
    log = read_log(json.dumps(page))
    assert len(log.requests) == 8 and [(s.key, s.line) for s in log.skipped] == [("data 4 request_body", 1), ("data 6 request_body", 1)]
    assert "missing" in log.skipped[0].reason and "signed_body_url" in log.skipped[1].reason


@pytest.mark.parametrize(
    ("cached", "why"),
    [
        (-3, "is negative (-3)"),
        ("384", "is '384', not an integer"),
        (384.5, "is 384.5, not an integer"),
        (999, "more than the record's own prompt of 470"),
    ],
)
def test_a_cached_count_that_cannot_be_one_is_flagged_and_the_request_kept(cached, why):
    records = _gateway_lines()
    records[2]["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] = cached
    log = read_log("\n".join(json.dumps(r) for r in records))
    assert len(log.requests) == 10 and not log.skipped
    assert [r.observed_cached_tokens for r in log.requests] == [*CACHED[:2], None, *CACHED[3:]]
    (flag,) = log.flagged
    assert (flag.request, flag.line, flag.key) == (3, 3, "response.usage.prompt_tokens_details.cached_tokens") and why in flag.reason


def test_an_otel_count_written_as_text_that_is_not_a_number_is_flagged():
    batch = _otel_batch()
    span = next(s for s in batch["resourceSpans"][0]["scopeSpans"][0]["spans"] if s["name"].startswith("chat"))
    _set(span, "gen_ai.usage.cache_read.input_tokens", {"intValue": "many"})
    log = read_log(json.dumps(batch))
    (flag,) = log.flagged
    assert flag.key == "resourceSpans 1 scopeSpans 1 spans 1 attributes.gen_ai.usage.cache_read.input_tokens" and "'many'" in flag.reason
    assert log.requests[flag.request - 1].observed_cached_tokens is None and len(log.requests) == 3  # the batch's chat spans


def test_a_time_that_cannot_be_read_is_flagged_and_the_log_kept_in_its_order():
    records = _gateway_lines()
    records[4]["timestamp"] = "yesterday"
    log = read_log("\n".join(json.dumps(r) for r in records))
    assert log.order == "log" and len(log.requests) == 10
    (flag,) = log.flagged
    assert (flag.request, flag.key) == (5, "timestamp") and "'yesterday' is not an ISO 8601 time" in flag.reason


def test_litellm_cache_hit_is_its_response_cache_not_cached_tokens():
    rows = [json.loads(line) for line in _text("litellm_spend_logs.jsonl").splitlines()]
    served = next(row for row in rows if row["metadata"]["usage_object"].get("prompt_tokens_details"))
    hit = copy.deepcopy(served) | {"cache_hit": "True"}
    log = read_log(json.dumps(hit))
    assert log.requests[0].observed_cached_tokens is None
    ((_, _, key, reason),) = [(f.request, f.line, f.key, f.reason) for f in log.flagged]
    assert key == "cache_hit" and "response cache" in reason
    missed = copy.deepcopy(served) | {"cache_hit": "True", "metadata": {"usage_object": {"prompt_tokens": 10}}}
    assert not read_log(json.dumps(missed)).flagged  # nothing to discount


def test_usage_shapes_count_once_and_keep_null_apart_from_zero():
    counts = {"input_tokens": 20, "cache_read_input_tokens": 300, "cache_creation_input_tokens": 50}
    assert observed_usage(counts, "anthropic").cached == 300
    anthropic, shape = response_usage({"usage": counts})
    assert shape == "anthropic" and observed_usage(anthropic, shape).written == 50
    assert response_usage({"id": "gen-1", "native_tokens_prompt": 900, "native_tokens_cached": 768})[1] == "openrouter"
    assert observed_usage(*response_usage({"native_tokens_prompt": 900, "native_tokens_cached": 768})).cached == 768
    langfuse = observed_usage({"input": 36, "input_cached_tokens": 384, "output": 5}, "langfuse")
    assert (langfuse.cached, langfuse.flags) == (384, ())  # its input excludes the cached tokens: 420 in all, not 36
    assert observed_usage({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": None}}, "openai").cached is None
    assert observed_usage({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}}, "openai").cached == 0
    litellm_anthropic = {"prompt_tokens": 400, "cache_read_input_tokens": 256, "cache_creation_input_tokens": 64}
    assert observed_usage(litellm_anthropic, "openai") == observed_usage(litellm_anthropic, "openai").__class__(256, 64, (), 400)
    assert langfuse.prompt == 420 and observed_usage({"prompt_tokens": "x"}, "openai").prompt is None  # the record's own count
    helicone = {"provider": "ANTHROPIC", "prompt_tokens": 20, "prompt_cache_read_tokens": 300, "prompt_cache_write_tokens": 50}
    assert (observed_usage(helicone, "helicone").cached, observed_usage(helicone, "helicone").flags) == (300, ())


def test_a_source_can_be_named_and_a_record_of_another_is_refused_by_name():
    log = read_log(_text("helicone.json"), "helicone")
    assert log.formats == {"helicone": 10}
    wrong = read_log(_text("gateway.jsonl").splitlines()[0], "helicone")
    assert not wrong.requests and wrong.skipped[0].key == "request_body"
    unknown = read_log(_text("gateway.jsonl"), "splunk")
    assert not unknown.requests and len(unknown.skipped) == 10 and "unknown format 'splunk'" in unknown.skipped[0].reason


def test_the_report_json_says_the_order_and_the_flags(tokenizer):
    records = _gateway_lines()
    records[0]["response"]["usage"]["prompt_tokens_details"] = {"cached_tokens": -1}
    scan = scan_log(tokenizer, read_log("\n".join(json.dumps(r) for r in records)))
    assert scan.reading["order"] == "timestamps" and scan.reading["order_reason"].startswith("by each request's own timestamp")
    key, reason = "response.usage.prompt_tokens_details.cached_tokens", "is negative (-1); read as not reported"
    assert scan.reading["flagged"] == [{"request": 1, "line": 1, "key": key, "reason": reason}]


def test_a_litellm_payload_names_its_session_by_its_own_session_id_then_trace_id_then_metadata():
    payload = json.loads(_text("litellm_callback.jsonl").splitlines()[0])
    own = payload | {"session_id": "caller-session", "trace_id": "caller-trace-id"}  # request correlation on
    log = read_log(json.dumps(own))
    assert log.requests[0].session == "caller-session" and log.reading()["session_keys"] == {"session_id": 1}
    traced = {key: value for key, value in own.items() if key != "session_id"}
    assert read_log(json.dumps(traced)).requests[0].session == "caller-trace-id"
    tagged = {key: value for key, value in traced.items() if key != "trace_id"} | {"metadata": {"session_id": "from-metadata"}}
    tagged_log = read_log(json.dumps(tagged), "litellm_callback")
    assert tagged_log.requests[0].session == "from-metadata" and tagged_log.reading()["session_keys"] == {"metadata.session_id": 1}


def _attribute(key: str, value) -> dict:
    kind = "intValue" if isinstance(value, int) else "stringValue"
    return {"key": key, "value": {kind: str(value) if kind == "intValue" else value}}


def _kvlist(body: dict) -> dict:
    """A log record body as OTLP/JSON writes it (a kvlistValue; lists as arrayValue)."""

    def value(item):
        if isinstance(item, dict):
            return {"kvlistValue": {"values": [{"key": k, "value": value(v)} for k, v in item.items()]}}
        if isinstance(item, list):
            return {"arrayValue": {"values": [value(v) for v in item]}}
        return {"stringValue": item}

    return value(body)


def _older_conventions(lines: list[str]) -> list[str]:
    """The bundled OTel export as the older GenAI conventions write it (openai-v2 up to 2.3b0): each chat span names
    ``gen_ai.system`` and holds no messages; each message is a log record of its span, in resourceLogs lines of their
    own (two batches, after the spans), the reply a ``gen_ai.choice``; a metrics line beside them."""
    spans_lines, records = [], []
    for line in lines:
        batch = json.loads(line)
        for span in batch["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            if not span["name"].startswith("chat"):
                continue
            values = {a["key"]: a["value"] for a in span["attributes"]}
            request = read_log(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})).requests[0]
            for message in request.messages:
                body = {"content": message.content}
                if message.tool_calls:
                    body["tool_calls"] = [
                        call.as_dict() if hasattr(call, "as_dict") else call for call in message.template_dict()["tool_calls"]
                    ]
                if message.tool_call_id:
                    body["id"] = message.tool_call_id
                event = {"user": "gen_ai.user.message", "system": "gen_ai.system.message", "assistant": "gen_ai.assistant.message"}
                name = event.get(message.role, "gen_ai.tool.message")
                records.append({"eventName": name, "traceId": span["traceId"], "spanId": span["spanId"], "body": _kvlist(body)})
            if request.reply is not None:
                choice = {
                    "index": "0",
                    "finish_reason": request.reply.finish,
                    "message": {"role": "assistant", "content": request.reply.text},
                }
                records.append(
                    {"eventName": "gen_ai.choice", "traceId": span["traceId"], "spanId": span["spanId"], "body": _kvlist(choice)}
                )
            kept = ("gen_ai.input.messages", "gen_ai.system_instructions", "gen_ai.output.messages", "gen_ai.provider.name")
            span["attributes"] = [a for a in span["attributes"] if a["key"] not in kept] + [_attribute("gen_ai.system", "openai")]
            assert "gen_ai.usage.input_tokens" in values
        spans_lines.append(json.dumps(batch))
    half = len(records) // 2
    logs = [
        {"resourceLogs": [{"scopeLogs": [{"scope": {"name": "opentelemetry.instrumentation.openai_v2"}, "logRecords": part}]}]}
        for part in (records[:half], records[half:])
    ]
    metrics = {"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "gen_ai.client.token.usage"}]}]}]}
    return [*spans_lines, *(json.dumps(batch) for batch in logs), json.dumps(metrics)]


def _expected(log) -> list:
    return [(r.session, [m.template_dict() for m in r.messages], r.reply and r.reply.text, r.observed_cached_tokens) for r in log.requests]


def test_the_older_conventions_messages_are_joined_from_their_log_records(tmp_path):
    lines = _text("otel.jsonl").splitlines()
    newer = read_log("\n".join(lines))
    older_lines = _older_conventions(lines)
    older = read_log("\n".join(older_lines))
    assert older.formats == {"otel": 10} and _expected(older) == _expected(newer)
    assert [(s.line, s.key) for s in older.skipped] == [(4, "resourceLogs"), (5, "resourceLogs"), (6, "resourceMetrics")]
    assert "GenAI message records were read with their spans" in older.skipped[0].reason
    # across shards (the distributed pass's reading): the file is one shard, read whole, and reads the same
    path = tmp_path / "collector.jsonl"
    path.write_text("\n".join(older_lines) + "\n")
    (shard,) = plan_shards([path], lines_per_shard=1)
    assert shard.linked and shard.lines == 6
    assert _expected(read_logs([path])) == _expected(newer)


def test_older_conventions_without_content_say_to_turn_capture_on():
    lines = _older_conventions(_text("otel.jsonl").splitlines())
    for at in (3, 4):
        batch = json.loads(lines[at])
        for record in batch["resourceLogs"][0]["scopeLogs"][0]["logRecords"]:
            if record["eventName"] != "gen_ai.choice":
                record["body"] = _kvlist({})  # what the instrumentation logs with content capture off
        lines[at] = json.dumps(batch)
    log = read_log("\n".join(lines))
    assert not log.requests and len(log.skipped) == 10 + 3
    assert all(s.reason == NOT_CAPTURED["older-without-content"] for s in log.skipped[:10])


def test_a_conversation_id_on_an_ancestor_span_is_the_session():
    """The newer conventions as openai-v2 2.4b0 writes them under an agent: the chat span names no conversation; its
    parent ``invoke_agent`` span (another line, same trace) does, and its grandparent names another that loses."""
    batch = _otel_batch()
    spans = batch["resourceSpans"][0]["scopeSpans"][0]["spans"]
    chat = next(s for s in spans if s["name"].startswith("chat"))
    session = next(a["value"]["stringValue"] for a in chat["attributes"] if a["key"] == "gen_ai.conversation.id")
    _set(chat, "gen_ai.conversation.id", None)
    chat["parentSpanId"] = "a1a1a1a1a1a1a1a1"
    agent = {
        "traceId": chat["traceId"],
        "spanId": "a1a1a1a1a1a1a1a1",
        "parentSpanId": "b2b2b2b2b2b2b2b2",
        "name": "invoke_agent harbor",
        "attributes": [_attribute("gen_ai.operation.name", "invoke_agent"), _attribute("gen_ai.conversation.id", session)],
    }
    root = {
        "traceId": chat["traceId"],
        "spanId": "b2b2b2b2b2b2b2b2",
        "name": "workflow",
        "attributes": [_attribute("gen_ai.conversation.id", "other")],
    }
    lines = [json.dumps(batch), json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [agent, root]}]}]})]
    log = read_log("\n".join(lines))
    (request,) = [r for r in log.requests if r.session_key == "gen_ai.conversation.id of an ancestor span"]
    assert request.session == session and request.timestamp == int(chat["startTimeUnixNano"]) / 1e9
    assert log.reading()["session_keys"] == {
        "gen_ai.conversation.id": len(log.requests) - 1,
        "gen_ai.conversation.id of an ancestor span": 1,
    }
    chat["parentSpanId"] = "c3c3c3c3c3c3c3c3"  # a parent not in the export: no session, none guessed
    unlinked = read_log("\n".join([json.dumps(batch), lines[1]]))
    assert sum(r.session is None for r in unlinked.requests) == 1
