"""Exports of observability tools and proxies, each read as the requests it records, beside what the server cached.

One reader per source, each in its own module, all registered in ``EXPORT_SOURCES`` (as ``kvscope.engine.audit.logs.formats`` registers
the request formats). A record is matched against the sources in the table's order; one that is none of them is a
plain request, read by ``formats``. Every request a source reads is counted under the source's name in ``formats``,
carries ``timestamp``, ``model`` and the observed cached / cache-write tokens (``kvscope.engine.audit.logs.usage``), and flags
(a count or a time that could not be read, with why). A page of an export's API (``{"data": [...]}``, as Helicone's
and Langfuse's APIs return them) is read row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvscope.engine.audit.logs.formats import AUTO, FORMATS, RecordError, read_record
from kvscope.engine.audit.logs.sources import gateway, helicone, langfuse, litellm, otel
from kvscope.engine.audit.logs.sources.common import SourceRead


@dataclass(frozen=True)
class Source:
    """One export: its name (the ``formats`` key and ``--format`` value), what it is, and how a record is recognised
    and read."""

    name: str
    description: str
    detects: Callable[[dict], bool]
    read: Callable[[dict], SourceRead]


EXPORT_SOURCES = {
    source.name: source
    for source in (
        Source("otel", "OpenTelemetry GenAI or Langfuse SDK spans, OTLP/JSON as a file exporter writes it", otel.is_batch, otel.read_batch),
        Source("langfuse_trace", "Langfuse traces with their observations nested", langfuse.is_trace, langfuse.read_trace),
        Source("langfuse_observations", "Langfuse observations, a row each", langfuse.is_observation, langfuse.read_observation),
        Source("helicone", "Helicone request rows (its query API), or the logs its SDKs post", helicone.is_record, helicone.read_record),
        Source("litellm_spend_logs", "LiteLLM proxy LiteLLM_SpendLogs rows", litellm.is_spend_log, litellm.read_spend_log),
        Source("litellm_callback", "LiteLLM StandardLoggingPayload", litellm.is_callback_payload, litellm.read_callback_payload),
        Source("gateway", "a request with its response (and time) beside it", gateway.is_record, gateway.read_gateway),
    )
}
_PAGE_KEYS = {"data", "meta", "error", "pagination"}


def read_any(record: Any, fmt: str = AUTO) -> SourceRead:
    """One log record read by its source (detected, or named by ``fmt``), else as a plain request of its format."""
    if fmt not in (AUTO, *FORMATS, *EXPORT_SOURCES):
        raise RecordError("", f"unknown format {fmt!r}; choose {AUTO} or one of {', '.join([*FORMATS, *EXPORT_SOURCES])}")
    if isinstance(record, dict) and isinstance(record.get("data"), list) and set(record) <= _PAGE_KEYS:
        return _page(record["data"], fmt)
    source = EXPORT_SOURCES.get(fmt) or (detected(record) if fmt == AUTO else None)
    if source is None:
        items = read_record(record, fmt)
        model = record.get("model") if isinstance(record, dict) else None
        return SourceRead([{**item, "model": model} for item in items] if isinstance(model, str) else items)
    if not isinstance(record, dict):
        raise RecordError("", f"is a JSON {type(record).__name__}, not a {source.description} record")
    return source.read(record)


def joined_records(records: Iterable[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """A log's (line, record) pairs with what other lines say about each record joined to it: OpenTelemetry spans
    given the messages of their log records and the conversation id of an ancestor span (``otel.joined``)."""
    return otel.joined(records)


def detected(record: Any) -> Source | None:
    """The first source whose records look like this one, or None for a plain request."""
    if not isinstance(record, dict):
        return None
    return next((source for source in EXPORT_SOURCES.values() if source.detects(record)), None)


def _page(rows: list, fmt: str) -> SourceRead:
    """Each row of an API page read; a row's errors name it (``data 3``)."""
    read = SourceRead()
    for number, row in enumerate(rows, 1):
        try:
            part = read_any(row, fmt)
        except RecordError as error:
            read.skipped.append(RecordError(f"data {number} {error.key}".strip(), error.reason))
            continue
        read.requests += part.requests
        read.skipped += [RecordError(f"data {number} {error.key}".strip(), error.reason) for error in part.skipped]
        read.sessions |= part.sessions
    return read
