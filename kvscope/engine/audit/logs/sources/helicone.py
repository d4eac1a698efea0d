"""Helicone: request rows from its REST query API (``POST /v1/request/query``, whose ``data`` lists them newest first),
and the log its SDKs post to its worker without the proxy (``/oai/v1/log``, ``/anthropic/v1/log``, ``/custom/v1/log``).

A row: ``request_body`` holds the request as sent to the provider (OpenAI or Anthropic); a large one may sit behind
``signed_body_url`` instead, and a row without a body is skipped by name. ``request_created_at``; the session is
``request_properties["Helicone-Session-Id"]``; ``request_model``; the provider's cache counts in
``prompt_cache_read_tokens`` / ``prompt_cache_write_tokens`` beside ``prompt_tokens``; the reply in ``response_body``.

A posted log (``helicone-helpers``' ``HeliconeManualLogger``, and Helicone's other async loggers): the request in
``providerRequest.json``; the Helicone headers in ``providerRequest.meta`` (the session: ``Helicone-Session-Id``,
matched without regard to case); the provider's answer in ``providerResponse.json`` (or ``textBody`` holding JSON),
whose usage gives the cached count (``prompt_tokens_details.cached_tokens``, or Anthropic's) and whose first choice is
the reply; the time in ``timing.startTime`` (``seconds`` and ``milliseconds``). The Python logger sends ``meta`` empty
and its headers on the log request itself, which Helicone's worker merges into ``meta``: a capture of those posts
keeps the session only where it does the same.
"""

from __future__ import annotations

from typing import Any

from kvscope.engine.audit.logs.formats import RecordError
from kvscope.engine.audit.logs.replies import reply_of
from kvscope.engine.audit.logs.sources.common import SourceRead, epoch_seconds, parsed_json, read_request, requests_of
from kvscope.engine.audit.logs.usage import observed_usage, response_usage

SESSION_PROPERTY = "Helicone-Session-Id"


def is_record(record: dict) -> bool:
    """A Helicone request row, or a log posted to its worker."""
    return is_row(record) or is_log(record)


def read_record(record: dict) -> SourceRead:
    return read_log(record) if is_log(record) else read_row(record)


def is_row(record: dict) -> bool:
    """A Helicone request row."""
    return "request_body" in record or ("request_created_at" in record and "request_id" in record)


def read_row(record: dict) -> SourceRead:
    if record.get("request_body") is None:
        url = " (this row points to signed_body_url: fetch the body from it)" if record.get("signed_body_url") else ""
        raise RecordError("request_body", f"missing, so the request cannot be read{url}")
    items = read_request(record["request_body"], "request_body")
    properties = record.get("request_properties") if isinstance(record.get("request_properties"), dict) else {}
    return SourceRead(
        requests_of(
            items,
            "helicone",
            session=properties.get(SESSION_PROPERTY),
            timestamp=epoch_seconds(record.get("request_created_at"), "request_created_at"),
            model=record.get("request_model") or record.get("response_model"),
            usage=observed_usage(record, "helicone", ""),
            reply=reply_of(record.get("response_body")),
            answer=record.get("response_body"),
        )
    )


def is_log(record: dict) -> bool:
    """A log posted to Helicone's worker: the provider's request and response side by side."""
    return "providerRequest" in record and "providerResponse" in record


def read_log(record: dict) -> SourceRead:
    sent = record.get("providerRequest")
    if not isinstance(sent, dict) or "json" not in sent:
        raise RecordError("providerRequest.json", "missing, so the request cannot be read")
    items = read_request(sent["json"], "providerRequest.json")
    response = _response(record.get("providerResponse"))
    usage, shape = response_usage(response)
    return SourceRead(
        requests_of(
            items,
            "helicone",
            session=_header(sent.get("meta"), SESSION_PROPERTY),
            session_key=SESSION_PROPERTY,
            timestamp=_start(record.get("timing")),
            model=next((item["model"] for item in items if item.get("model")), (response or {}).get("model")),
            usage=observed_usage(usage, shape, "providerResponse.json.usage"),
            reply=reply_of(response),
            answer=response,
        )
    )


def _response(answered: Any) -> dict | None:
    """The provider's answer: ``json``, else ``textBody`` where it holds JSON. A text body that is not JSON (a stream's
    chunks, an error) gives no usage and no reply; the request is kept."""
    answered = answered if isinstance(answered, dict) else {}
    body = answered.get("json") or answered.get("textBody")
    try:
        response = parsed_json(body, "providerResponse.textBody")
    except RecordError:
        return None
    return response if isinstance(response, dict) else None


def _header(headers: Any, name: str) -> Any:
    """A header's value in a headers object, its name matched without regard to case (None: not there)."""
    items = headers.items() if isinstance(headers, dict) else ()
    return next((value for key, value in items if isinstance(key, str) and key.lower() == name.lower()), None)


def _start(timing: Any) -> tuple[float | None, list[tuple[str, str]]]:
    """A posted log's start time: ``timing.startTime`` as whole seconds and milliseconds."""
    start = timing.get("startTime") if isinstance(timing, dict) else None
    if start is None:
        return None, []
    parts = (start.get("seconds"), start.get("milliseconds", 0)) if isinstance(start, dict) else (None, None)
    if not all(isinstance(part, int | float) and not isinstance(part, bool) for part in parts):
        return None, [("timing.startTime", f"{start!r} is not seconds and milliseconds; the request has no timestamp")]
    return epoch_seconds(parts[0] + parts[1] / 1000, "timing.startTime")
