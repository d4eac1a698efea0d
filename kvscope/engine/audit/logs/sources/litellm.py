"""LiteLLM: the proxy's ``LiteLLM_SpendLogs`` rows (``schema.prisma``) and its callbacks' ``StandardLoggingPayload``.

A SpendLogs row keeps the prompt in ``messages`` only with ``store_prompts_in_spend_logs``, and the client's whole
body (tools included) in ``proxy_server_request``; ``session_id`` comes from ``litellm_session_id``; the provider's
usage sits in ``metadata.usage_object`` (``metadata`` may be JSON text). A callback payload holds ``messages``, the
tools in ``model_parameters``, the session in its own ``session_id``, else ``trace_id``, else its metadata
(``CALLBACK_SESSION_KEYS``; the key used is stated per request), and a float ``startTime``.

``cache_hit`` is LiteLLM's own response cache, not a prefix cache: it is never read as cached tokens. A request it
answered never reached the server, so its usage (the original response's) is not an observation: flagged, None.
"""

from __future__ import annotations

from typing import Any

from kvscope.engine.audit.logs.formats import RecordError, session_text
from kvscope.engine.audit.logs.replies import reply_of
from kvscope.engine.audit.logs.sources.common import SourceRead, epoch_seconds, parsed_json, read_request, requests_of
from kvscope.engine.audit.logs.usage import ObservedUsage, observed_usage


def is_spend_log(record: dict) -> bool:
    """A ``LiteLLM_SpendLogs`` row."""
    return "request_id" in record and "startTime" in record and ("proxy_server_request" in record or "call_type" in record)


def read_spend_log(record: dict) -> SourceRead:
    body = parsed_json(record.get("proxy_server_request"), "proxy_server_request")
    messages = parsed_json(record.get("messages"), "messages")
    if isinstance(body, dict) and body.get("messages"):
        items = read_request(body, "proxy_server_request")
    elif isinstance(messages, list) and messages:
        items = read_request({"messages": messages}, "messages")
    else:
        raise RecordError("messages", "no prompt stored: the proxy keeps it with general_settings.store_prompts_in_spend_logs: true")
    metadata = parsed_json(record.get("metadata"), "metadata")
    usage = metadata.get("usage_object") if isinstance(metadata, dict) else None
    session = record.get("session_id")
    named = (session, "session_id" if session else None)
    return SourceRead(_requests(items, "litellm_spend_logs", record, named, usage, "metadata.usage_object"))


def is_callback_payload(record: dict) -> bool:
    """A ``StandardLoggingPayload``, as a callback (or a logging integration's file) receives it."""
    return "call_type" in record and "trace_id" in record and "startTime" in record and "messages" in record


def read_callback_payload(record: dict) -> SourceRead:
    messages = parsed_json(record.get("messages"), "messages")
    if isinstance(messages, dict):  # some call types log the request object itself
        items = read_request(messages, "messages")
    elif isinstance(messages, list) and messages:
        parameters = record.get("model_parameters") if isinstance(record.get("model_parameters"), dict) else {}
        items = read_request({"messages": messages, "tools": parameters.get("tools") or []}, "messages")
    else:
        raise RecordError("messages", "no messages logged (turn off turn_off_message_logging to keep them)")
    metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
    usage, key = metadata.get("usage_object"), "metadata.usage_object"
    if usage is None and isinstance(record.get("response"), dict):
        usage, key = record["response"].get("usage"), "response.usage"
    return SourceRead(_requests(items, "litellm_callback", record, _callback_session(record, metadata), usage, key))


# Where a callback payload names its session, most trusted first: the payload's own session_id (the caller's
# litellm_session_id, or the caller's litellm_trace_id under request correlation), LiteLLM's trace_id (one per
# session unless the caller set its own), then the metadata's keys.
CALLBACK_SESSION_KEYS = ("session_id", "trace_id", "metadata.session_id", "metadata.litellm_session_id", "metadata.trace_id")


def _callback_session(record: dict, metadata: dict) -> tuple[Any, str | None]:
    """The payload's session and the key it was read from (``CALLBACK_SESSION_KEYS`` order)."""
    for key in CALLBACK_SESSION_KEYS:
        holder, name = (metadata, key.split(".", 1)[1]) if key.startswith("metadata.") else (record, key)
        if (value := session_text(holder.get(name))) is not None:
            return value, key
    return None, None


def _requests(items: list[dict], source: str, record: dict, session: tuple[Any, str | None], usage: Any, key: str) -> list[dict]:
    observed = observed_usage(usage, "openai", key)
    if str(record.get("cache_hit")).lower() == "true":
        reason = "LiteLLM's response cache answered this request, so no server saw it; its usage is not an observation"
        if observed.cached is not None or observed.written is not None:
            observed = ObservedUsage(flags=(("cache_hit", reason),))
    return requests_of(
        items,
        source,
        session=session[0],
        session_key=session[1],
        timestamp=epoch_seconds(record.get("startTime"), "startTime"),
        model=record.get("model"),
        usage=observed,
        reply=reply_of(record.get("response")),
        answer=record.get("response"),
    )
