"""Langfuse: traces with their observations nested (``GET /api/public/traces/{id}``), and flat observation rows
(``GET /api/public/observations``, or the UI's export), each with ``traceId``.

A request is a ``GENERATION`` observation: its ``input`` is the message list, or ``{"messages", "tools"}`` when tools
were passed (Langfuse's OpenAI integration); ``startTime``, ``model``; ``usageDetails.input_cached_tokens`` (its
``input`` already excludes them); the reply in ``output`` (an assistant message, or its text). Other observation
types (spans, events, tools) are not requests. The session is the trace's ``sessionId``: on the trace itself, or from
a trace row elsewhere in the log for a flat observation; a trace without one is its own session (its id).
"""

from __future__ import annotations

from typing import Any

from engine.audit.formats import RecordError
from engine.audit.replies import reply_of
from engine.audit.sources.common import SourceRead, epoch_seconds, read_request, requests_of
from engine.audit.usage import observed_usage

GENERATION = "GENERATION"


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


def _generation(observation: dict, source: str, key: str, session: Any) -> list[dict]:
    at = f"{key} " if key else ""
    given = observation.get("input")
    if isinstance(given, list):
        request = {"messages": given}
    elif isinstance(given, dict) and "messages" in given:
        request = {"messages": given["messages"], "tools": given.get("tools") or []}
    else:
        kind = "nothing" if given is None else f"a {type(given).__name__}"
        raise RecordError(f"{at}input", f"holds {kind}, not messages (a list, or an object with messages and tools)")
    items = read_request(request, f"{at}input")
    return requests_of(
        items,
        source,
        session=session,
        timestamp=epoch_seconds(observation.get("startTime"), f"{at}startTime"),
        model=observation.get("model"),
        usage=observed_usage(observation.get("usageDetails"), "langfuse", f"{at}usageDetails"),
        reply=reply_of(observation.get("output")),
    )
