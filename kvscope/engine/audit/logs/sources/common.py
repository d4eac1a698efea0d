"""What every export reader shares: the result of reading one record, timestamps, JSON held as text, and the request
a record holds read as ``kvscope.engine.audit.logs.formats`` reads a plain request."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from kvscope.engine.audit.logs.formats import RecordError, read_record, session_text
from kvscope.engine.audit.logs.replies import Reply
from kvscope.engine.audit.logs.usage import ObservedUsage, answer_marks


@dataclass
class SourceRead:
    """One record of an export read: its requests (``formats.read_record``'s dicts plus ``timestamp``, ``model``,
    the observed counts and ``flags``), the parts of it left out (each a ``RecordError`` naming its key and why),
    and the sessions it names for requests read elsewhere (a Langfuse trace id -> its ``sessionId``)."""

    requests: list[dict] = field(default_factory=list)
    skipped: list[RecordError] = field(default_factory=list)
    sessions: dict[str, str] = field(default_factory=dict)


def parsed_json(value: Any, key: str) -> Any:
    """A JSON value that an export may hold as text (a database's JSON column, an OTel string attribute)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise RecordError(key, f"holds text that is not JSON ({error.msg}, column {error.colno})") from None


def epoch_seconds(value: Any, key: str) -> tuple[float | None, list[tuple[str, str]]]:
    """Seconds since the epoch of a logged time (ISO 8601 text, without a zone read as UTC; or a number of seconds,
    milliseconds, microseconds or nanoseconds, told apart by size), and a flag where it is not a time."""
    if value is None:
        return None, []
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        for limit, scale in ((1e17, 1e9), (1e14, 1e6), (1e11, 1e3)):  # nanoseconds, microseconds, milliseconds
            if abs(value) >= limit:
                return value / scale, []
        return float(value), []
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip().replace(" ", "T", 1))
        except ValueError:
            return None, [(key, f"{value!r} is not an ISO 8601 time; the request has no timestamp")]
        return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp(), []
    return None, [(key, f"is a {type(value).__name__}, not a time; the request has no timestamp")]


def read_request(request: Any, key: str) -> list[dict]:
    """The request a record holds (OpenAI chat, Anthropic, Responses, ...; an object or its JSON text) read as a
    plain log line is read; errors name the key it sits at."""
    request = parsed_json(request, key)
    try:
        items = read_record(request)
    except RecordError as error:
        raise RecordError(f"{key} {error.key}" if error.key else key, error.reason) from None
    model = request.get("model") if isinstance(request, dict) else None
    return [{**item, "model": model} for item in items] if isinstance(model, str) else items


def requests_of(
    items: list[dict],
    source: str,
    *,
    session: Any = None,
    timestamp: tuple[float | None, list[tuple[str, str]]] = (None, []),
    model: Any = None,
    usage: ObservedUsage = ObservedUsage(),
    reply: Reply | None = None,
    session_key: str | None = None,
    answer: Any = None,
) -> list[dict]:
    """``read_request``'s items as the source's requests: its name as their format, and what the record says beside
    the request (a session it names wins over one in the request body; the reply the server generated; ``answer``: the
    server's answer as logged, whose marks name the server, ``usage.answer_marks``)."""
    when, time_flags = timestamp
    observed = usage.fields()
    extra = {
        "format": source,
        "timestamp": when,
        "model": model if isinstance(model, str) and model else None,
        **observed,
        "flags": [*time_flags, *observed["flags"]],
        **({"reply": reply} if reply is not None else {}),
        **({"answer_marks": marks} if (marks := answer_marks(answer)) else {}),
        **({"session_key": session_key} if session_key and session is not None else {}),
    }
    named = session_text(session)
    return [{**item, **extra, "session": named or item.get("session"), "model": extra["model"] or item.get("model")} for item in items]
