"""The exports the real client libraries wrote (``benchmarks/interop/client_exports.py``: openai instrumented by
opentelemetry-instrumentation-openai-v2 2.3b0 and 2.4b0, LiteLLM's callback, Langfuse's SDK 3.x and 5.x (its OTLP
spans) and Helicone's manual logger (its posted logs), against llama-server) read as a user uploads them, each request checked
against what the server itself received and answered: the order, the messages, the session, the reply, the token
counts (the embedded model's tokenizer is the served GGUF's), the cached count where the export carries one, and the
tier change the support session makes at its third turn."""

import json

import pytest

from benchmarks.interop.client_exports import CLIENTS, EXPORTS, SESSIONS
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.replies import finish_of
from kvscope.engine.audit.logs.shards import read_logs
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.models.loading import load_tokenizer

# The session key each export carries: none in the older conventions (the instrumentation writes no conversation id),
# the conversation id of the invoke_agent span around each chat span in the newer, LiteLLM's ``trace_id`` (LiteLLM
# 1.110 writes the caller's litellm_session_id there and leaves ``session_id`` empty), the ``session.id`` Langfuse's
# propagate_attributes writes on each generation span, and the Helicone-Session-Id header of each posted log.
SESSION_KEYS = {
    "otel-2.3b0": {},
    "otel-2.4b0": {"gen_ai.conversation.id of an ancestor span": 12},
    "litellm": {"trace_id": 12},
    "langfuse": {"session.id": 12},
    "langfuse-5": {"session.id": 12},
    "helicone": {"Helicone-Session-Id": 12},
}
# Langfuse's spans arrive as an OTLP/JSON batch, read by the OpenTelemetry source
FORMATS = {
    "otel-2.3b0": "otel",
    "otel-2.4b0": "otel",
    "litellm": "litellm_callback",
    "langfuse": "otel",
    "langfuse-5": "otel",
    "helicone": "helicone",
}
LANGFUSE = ("langfuse", "langfuse-5")  # the SDK 3.15 and 5.x: the same attributes (5.x adds langfuse.internal.is_app_root)
# The exports that keep the answer's usage whole, the cached count included: LiteLLM's usage_object, Langfuse's
# usage_details (the OpenAI usage its integration received) and Helicone's providerResponse. openai-v2's chat spans
# carry only the input and output counts, so their cached count is None (not reported).
CACHED_COUNT_LOGGED = {"litellm", *LANGFUSE, "helicone"}
TURNS = len(SESSIONS[0]["users"])
# the server's defaults met by a client that names no slot: 4 slots with one KV cache and the RAM prompt cache
LLAMA_DEFAULTS = ScanSettings(CacheSettings(block=1, prompt_cache=True), "llama_cpp")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded").tokenizer


def _answers(client: str) -> dict:
    return json.loads((EXPORTS / f"{client}.answers.json").read_text())


def _scan(tokenizer, client: str):
    return scan_log(tokenizer, read_log((EXPORTS / f"{client}.jsonl").read_text()), LLAMA_DEFAULTS)


def _true_session(position: int) -> str:
    """The session of the request at ``position`` (0-based): the turns were sent interleaved."""
    return SESSIONS[position % len(SESSIONS)]["id"]


def test_every_client_has_its_stored_export_and_the_servers_answers():
    for client in CLIENTS:
        answers = _answers(client)
        assert answers["client"] == client and answers["sessions"] == [session["id"] for session in SESSIONS]
        assert len(answers["calls"]) == len(SESSIONS) * TURNS and (EXPORTS / f"{client}.jsonl").stat().st_size > 0
        assert "llama-server" in answers["server"]["server"] and answers["pins"]


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_each_request_reads_as_the_server_received_and_answered_it(client):
    log, calls = read_log((EXPORTS / f"{client}.jsonl").read_text()), _answers(client)["calls"]
    assert log.formats == {FORMATS[client]: len(calls)} and not log.flagged
    assert log.reading()["session_keys"] == SESSION_KEYS[client]
    for position, (request, call) in enumerate(zip(log.requests, calls, strict=True)):
        sent = call["request"]["messages"]
        assert [(m.role, m.content) for m in request.messages] == [(m["role"], m["content"]) for m in sent], position
        assert request.session == (_true_session(position) if SESSION_KEYS[client] else None)
        assert request.reply.text == call["response"]["choices"][0]["message"]["content"]
        usage = call["response"]["usage"]
        assert request.observed_prompt_tokens == usage["prompt_tokens"]
        expected_cached = usage["prompt_tokens_details"]["cached_tokens"] if client in CACHED_COUNT_LOGGED else None
        assert request.observed_cached_tokens == expected_cached


@pytest.mark.parametrize("client", [*LANGFUSE, "helicone"])
def test_the_sdk_payloads_read_by_their_named_format_with_each_reply_ending_as_the_server_said(client):
    """Helicone keeps the server's finish reason. Langfuse keeps none: a reply whose completion count reached max_tokens
    reads as cut there, the others as unknown (taken as ended on the end-of-turn token)."""
    text, calls = (EXPORTS / f"{client}.jsonl").read_text(), _answers(client)["calls"]
    named = read_log(text, FORMATS[client])
    assert [(r.session, r.messages, r.reply) for r in named.requests] == [(r.session, r.messages, r.reply) for r in read_log(text).requests]
    finishes = [finish_of(call["response"]["choices"][0]["finish_reason"]) for call in calls]
    if client in LANGFUSE:
        finishes = [finish if finish == "length" else "unknown" for finish in finishes]
    assert [r.reply.finish for r in named.requests] == finishes and "length" in finishes


def _first_record(client: str) -> dict:
    return json.loads((EXPORTS / f"{client}.jsonl").read_text().splitlines()[0])


@pytest.mark.parametrize("client", LANGFUSE)
def test_a_langfuse_span_whose_usage_is_not_json_keeps_its_request_and_flags_the_counts(client):
    batch = _first_record(client)
    (span,) = batch["resourceSpans"][0]["scopeSpans"][0]["spans"]
    for attribute in span["attributes"]:
        if attribute["key"] == "langfuse.observation.usage_details":
            attribute["value"] = {"stringValue": "{prompt_tokens: 45"}
    (request,) = read_log(json.dumps(batch)).requests
    assert request.session == "support-4417" and request.observed_cached_tokens is None and request.observed_prompt_tokens is None
    ((key, why),) = request.flags
    assert key.endswith("langfuse.observation.usage_details") and "not JSON" in why


def test_a_helicone_log_names_its_session_in_any_case_flags_a_start_it_cannot_read_and_keeps_a_text_answer():
    record = _first_record("helicone")
    record["providerRequest"]["meta"] = {"helicone-session-id": "support-4417"}
    record["timing"]["startTime"] = "soon"
    (request,) = read_log(json.dumps(record)).requests
    assert request.session == "support-4417" and request.timestamp is None
    assert [key for key, _ in request.flags] == ["timing.startTime"]
    record["providerRequest"]["meta"] = {}  # as the Python logger sends it, the session on the log request's headers
    assert read_log(json.dumps(record)).requests[0].session is None
    record["providerResponse"] |= {"json": {}, "textBody": "upstream timed out"}  # the logger's shape for a text answer
    (request,) = read_log(json.dumps(record)).requests
    assert request.reply is None and request.observed_cached_tokens is None and len(request.messages) == 2


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_the_token_pass_counts_the_servers_tokens_matches_each_session_and_finds_the_tier_change(tokenizer, client):
    scan, calls = _scan(tokenizer, client), _answers(client)["calls"]
    assert [len(scan.rendered[row.request]) for row in scan.requests] == [call["response"]["usage"]["prompt_tokens"] for call in calls]
    sessions = len(SESSIONS)
    for position, row in enumerate(scan.requests):  # each later turn continues its own session's previous turn
        assert row.matched_request == (position - sessions + 1 if position >= sessions else (position or None)), row
    tier_turn = 2 * sessions + 1  # the support session's third turn: its system prompt says silver, not gold
    changed = {row.request: row.fields for row in scan.requests if row.fields and row.request > sessions}
    assert changed == {tier_turn: ("customer_tier",)}
    (cause,) = [cause for cause in scan.requests[tier_turn - 1].causes if cause.field == "customer_tier"]
    assert cause.name == "value" and "'gold' -> 'silver'" in cause.detail


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_the_simulated_server_reuses_what_the_server_reported_on_every_request(tokenizer, client):
    """The simulation of llama-server's defaults against each answer's own cached count, the export's or not."""
    scan, calls = _scan(tokenizer, client), _answers(client)["calls"]
    reported = [call["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for call in calls]
    assert [row.reused_tokens["llama_cpp"] for row in scan.requests] == reported


def test_the_older_conventions_messages_come_from_log_records_and_metrics_are_counted_skips():
    log = read_log((EXPORTS / "otel-2.3b0.jsonl").read_text())
    reasons = [skip.reason for skip in log.skipped]
    assert reasons and all("read with their spans" in reason or reason.startswith("a metrics batch") for reason in reasons)
    assert any(reason.startswith("a metrics batch") for reason in reasons)
    assert not any("content capture" in reason for reason in reasons)


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_the_sharded_reading_gives_the_same_requests(client):
    path = EXPORTS / f"{client}.jsonl"
    whole, sharded = read_log(path.read_text()), read_logs([path])
    assert [(r.session, r.messages, r.reply, r.observed_cached_tokens) for r in sharded.requests] == [
        (r.session, r.messages, r.reply, r.observed_cached_tokens) for r in whole.requests
    ]
