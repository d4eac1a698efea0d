"""Helicone: request rows from its REST query API (``POST /v1/request/query``, whose ``data`` lists them newest first).

``request_body`` holds the request as sent to the provider (OpenAI or Anthropic); a large one may sit behind
``signed_body_url`` instead, and a row without a body is skipped by name. ``request_created_at``; the session is
``request_properties["Helicone-Session-Id"]``; ``request_model``; the provider's cache counts in
``prompt_cache_read_tokens`` / ``prompt_cache_write_tokens`` beside ``prompt_tokens``; the reply in ``response_body``.
"""

from __future__ import annotations

from engine.audit.formats import RecordError
from engine.audit.replies import reply_of
from engine.audit.sources.common import SourceRead, epoch_seconds, read_request, requests_of
from engine.audit.usage import observed_usage

SESSION_PROPERTY = "Helicone-Session-Id"


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
        )
    )
