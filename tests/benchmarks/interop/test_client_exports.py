"""The exports the real client libraries wrote (``benchmarks/interop/client_exports.py``: openai instrumented by
opentelemetry-instrumentation-openai-v2 2.3b0 and 2.4b0, and LiteLLM's callback, against llama-server) read as a user
uploads them, each request checked against what the server itself received and answered: the order, the messages,
the session, the reply, the token counts (the embedded model's tokenizer is the served GGUF's), the cached count
where the export carries one, and the tier change the support session makes at its third turn."""

import json

import pytest

from benchmarks.interop.client_exports import CLIENTS, EXPORTS, SESSIONS
from engine.audit.caches import CacheSettings
from engine.audit.requests import read_log
from engine.audit.scan import scan_log
from engine.audit.shards import read_logs
from engine.models.loading import load_tokenizer

# The session key each export carries: none in the older conventions (the instrumentation writes no conversation id),
# the conversation id of the invoke_agent span around each chat span in the newer, and LiteLLM's ``trace_id`` (LiteLLM
# 1.110 writes the caller's litellm_session_id there and leaves ``session_id`` empty).
SESSION_KEYS = {"otel-2.3b0": {}, "otel-2.4b0": {"gen_ai.conversation.id of an ancestor span": 12}, "litellm": {"trace_id": 12}}
FORMATS = {"otel-2.3b0": "otel", "otel-2.4b0": "otel", "litellm": "litellm_callback"}
TURNS = len(SESSIONS[0]["users"])
# the server's defaults met by a client that names no slot: 4 slots with one KV cache and the RAM prompt cache
LLAMA_DEFAULTS = CacheSettings(block=1, prompt_cache=True)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("embedded").tokenizer


def _answers(client: str) -> dict:
    return json.loads((EXPORTS / f"{client}.answers.json").read_text())


def _scan(tokenizer, client: str):
    return scan_log(tokenizer, read_log((EXPORTS / f"{client}.jsonl").read_text()), LLAMA_DEFAULTS, observed_engine="llama_cpp")


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
        # LiteLLM logs the answer's usage whole; openai-v2's chat spans carry no cached count (only input and output)
        expected_cached = usage["prompt_tokens_details"]["cached_tokens"] if client == "litellm" else None
        assert request.observed_cached_tokens == expected_cached


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
