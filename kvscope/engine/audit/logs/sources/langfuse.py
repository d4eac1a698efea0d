"""Langfuse: traces with their observations nested (``GET /api/public/traces/{id}``), flat observation rows
(``GET /api/public/observations``, or the UI's export), each with ``traceId``, and the OpenTelemetry spans its SDK
(3.x and later) exports to ``/api/public/otel/v1/traces`` (read inside an OTLP/JSON batch by ``sources.otel``).

A request is a ``GENERATION`` observation: its ``input`` is the message list, or ``{"messages", "tools"}`` when tools
were passed (Langfuse's OpenAI integration); ``startTime``, ``model``; ``usageDetails.input_cached_tokens`` (its
``input`` already excludes them); the reply in ``output`` (an assistant message, or its text). Other observation
types (spans, events, tools) are not requests. The session is the trace's ``sessionId``: on the trace itself, or from
a trace row elsewhere in the log for a flat observation; a trace without one is its own session (its id).

On the SDK's spans the same observation is a span whose ``langfuse.observation.type`` is ``generation``:
``langfuse.observation.input`` and ``.output`` (JSON text, shaped as above), ``langfuse.observation.model.name``,
``langfuse.observation.usage_details`` (JSON text: the provider's usage as the integration received it, OpenAI's
``prompt_tokens_details.cached_tokens`` included; Langfuse's server flattens it into ``input_*`` keys later),
``langfuse.observation.model.parameters`` and ``startTimeUnixNano``. The session is the span's ``session.id``
(``propagate_attributes(session_id=...)`` writes it on every span it covers; ``langfuse.session.id`` is read too).
The SDK 3.15 and 5.2 write these alike; 5.x adds ``langfuse.internal.is_app_root`` (a bool), which is not read.

Neither shape keeps the reply's finish reason: a reply whose output tokens reached the request's ``max_tokens`` (in the
model parameters) is read as cut there, the others as ended on the end-of-turn token (``replies.FINISHES``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvscope.engine.audit.logs.formats import RecordError
from kvscope.engine.audit.logs.replies import Reply, reply_of
from kvscope.engine.audit.logs.sources.common import SourceRead, epoch_seconds, parsed_json, read_request, requests_of
from kvscope.engine.audit.logs.usage import observed_usage

GENERATION = "GENERATION"
# The observation attributes the SDK writes on its OpenTelemetry spans (its ``LangfuseOtelSpanAttributes``).
SPAN_TYPE = "langfuse.observation.type"
SPAN_INPUT = "langfuse.observation.input"
SPAN_OUTPUT = "langfuse.observation.output"
SPAN_MODEL = "langfuse.observation.model.name"
SPAN_USAGE = "langfuse.observation.usage_details"
SPAN_PARAMETERS = "langfuse.observation.model.parameters"
SPAN_SESSIONS = ("session.id", "langfuse.session.id")


def is_trace(record: dict) -> bool:
    """A trace: its ``observations`` (objects, or ids in a list export), or a trace row naming a ``sessionId``."""
    return "traceId" not in record and ("observations" in record or "sessionId" in record)


def read_trace(record: dict) -> SourceRead:
    trace, session = record.get("id"), record.get("sessionId")
    read = SourceRead(sessions={str(trace): str(session)} if trace is not None and session is not None else {})
    observations = record.get("observations") or []
    if not isinstance(observations, list):
        raise RecordError("observations", f"must be a list, got {type(observations).__name__}")
    for number, observation in enumerate(observations, 1):
        if isinstance(observation, dict) and observation.get("type") == GENERATION:
            try:
                read.requests += _generation(observation, "langfuse_trace", f"observations {number}", session or trace)
            except RecordError as error:
                read.skipped.append(error)
    return read


def is_observation(record: dict) -> bool:
    """A flat observation row."""
    return "traceId" in record and "type" in record


def read_observation(record: dict) -> SourceRead:
    if record.get("type") != GENERATION:
        return SourceRead()
    requests = _generation(record, "langfuse_observations", "", record.get("sessionId"))
    trace = record.get("traceId")
    return SourceRead([{**request, "trace": str(trace)} for request in requests] if trace is not None else requests)


def is_generation_span(attributes: dict) -> bool:
    """An OpenTelemetry span (its attributes as plain values) that the SDK wrote for a generation."""
    kind = attributes.get(SPAN_TYPE)
    return isinstance(kind, str) and kind.upper() == GENERATION


def read_generation_span(span: dict, attributes: dict, key: str) -> list[dict]:
    """The request of one of the SDK's generation spans (module docstring), counted as ``otel``: the batch's source.
    Usage or model parameters that are not JSON leave the counts unreported (flagged) and the finish unknown."""
    usage, usage_flags = _json_attribute(attributes, SPAN_USAGE, key)
    parameters, _ = _json_attribute(attributes, SPAN_PARAMETERS, key)
    shape = "openai" if isinstance(usage, dict) and "prompt_tokens" in usage else "langfuse"
    observed = observed_usage(usage, shape, f"{key} {SPAN_USAGE}")
    session_key = next((name for name in SPAN_SESSIONS if attributes.get(name) is not None), None)
    return requests_of(
        _request_items(parsed_json(attributes.get(SPAN_INPUT), f"{key} {SPAN_INPUT}"), f"{key} {SPAN_INPUT}"),
        "otel",
        session=attributes.get(session_key) if session_key else None,
        session_key=session_key,
        timestamp=epoch_seconds(span.get("startTimeUnixNano"), f"{key} startTimeUnixNano"),
        model=attributes.get(SPAN_MODEL),
        usage=replace(observed, flags=(*observed.flags, *usage_flags)),
        reply=_with_finish(reply_of(attributes.get(SPAN_OUTPUT)), parameters, usage),
    )


def _json_attribute(attributes: dict, name: str, key: str) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """An attribute holding JSON text, parsed; None and a flag where it is not JSON."""
    try:
        return parsed_json(attributes.get(name), f"{key} {name}"), ()
    except RecordError as error:
        return None, ((error.key, f"{error.reason}; read as not reported"),)


def _generation(observation: dict, source: str, key: str, session: Any) -> list[dict]:
    at = f"{key} " if key else ""
    return requests_of(
        _request_items(observation.get("input"), f"{at}input"),
        source,
        session=session,
        timestamp=epoch_seconds(observation.get("startTime"), f"{at}startTime"),
        model=observation.get("model"),
        usage=observed_usage(observation.get("usageDetails"), "langfuse", f"{at}usageDetails"),
        reply=_with_finish(reply_of(observation.get("output")), observation.get("modelParameters"), observation.get("usageDetails")),
    )


def _request_items(given: Any, key: str) -> list[dict]:
    """A generation's input (a message list, or ``{"messages", "tools"}``) read as a request."""
    if isinstance(given, list):
        request = {"messages": given}
    elif isinstance(given, dict) and "messages" in given:
        request = {"messages": given["messages"], "tools": given.get("tools") or []}
    else:
        kind = "nothing" if given is None else f"a {type(given).__name__}"
        raise RecordError(key, f"holds {kind}, not messages (a list, or an object with messages and tools)")
    return read_request(request, key)


def _with_finish(reply: Reply | None, parameters: Any, usage: Any) -> Reply | None:
    """The reply, its finish read from the counts where its output names none: Langfuse keeps the assistant message
    without its finish reason, so a reply whose output tokens (``completion_tokens``, or Langfuse's ``output``) reached
    the request's ``max_tokens`` (or ``max_completion_tokens``) was cut there, as OpenAI defines ``length``."""
    if reply is None or reply.finish != "unknown" or not isinstance(parameters, dict) or not isinstance(usage, dict):
        return reply
    limit = parameters.get("max_completion_tokens", parameters.get("max_tokens"))
    produced = usage.get("completion_tokens", usage.get("output"))
    counts = all(isinstance(value, int) and not isinstance(value, bool) for value in (limit, produced))
    return replace(reply, finish="length") if counts and produced >= limit else reply
