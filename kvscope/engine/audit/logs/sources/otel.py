"""OpenTelemetry GenAI spans as a collector's file exporter writes them (OTLP/JSON: ``resourceSpans`` ->
``scopeSpans`` -> ``spans``, one batch a line; batches in any order).

Attributes are ``{key, value: {stringValue | intValue | doubleValue | boolValue | arrayValue | kvlistValue}}``, 64-bit
integers written as strings. A request is an inference span (``gen_ai.operation.name`` ``chat``,
``text_completion`` or ``generate_content``): ``gen_ai.system_instructions`` and ``gen_ai.input.messages`` (JSON
text, role + ``parts``: ``text``, ``tool_call``, ``tool_call_response``), ``gen_ai.tool.definitions``,
``gen_ai.conversation.id`` (the session), ``gen_ai.request.model``, ``startTimeUnixNano``, and
``gen_ai.usage.cache_read.input_tokens`` / ``cache_creation.input_tokens``; the reply in ``gen_ai.output.messages``.
Content capture is off by default: a span without input messages is skipped with that reason, never guessed. Other
spans (tools, agents, HTTP) are not requests. Langfuse's SDK (3.x and later) exports its own attributes instead: a
span whose ``langfuse.observation.type`` is ``generation`` is a request too, read by ``sources.langfuse``
(``langfuse.observation.input`` / ``.output`` / ``.usage_details``, the session in ``session.id``).

What other lines of the export say about a span is joined to it first (``joined``, over the whole file): the older
conventions' message log records (``resourceLogs`` -> ``scopeLogs`` -> ``logRecords``, an event a message:
``gen_ai.system.message``, ``gen_ai.user.message``, ``gen_ai.assistant.message``, ``gen_ai.tool.message``, the reply a
``gen_ai.choice``; linked by ``traceId`` / ``spanId``), and the conversation id of the nearest ancestor span that
names one (an agent's ``invoke_agent`` span: linked by ``parentSpanId``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.audit.logs.formats import RecordError, session_text
from kvscope.engine.audit.logs.replies import Reply, finish_of
from kvscope.engine.audit.logs.sources import langfuse
from kvscope.engine.audit.logs.sources.common import SourceRead, epoch_seconds, parsed_json, read_request, requests_of
from kvscope.engine.audit.logs.usage import observed_usage

INFERENCE = ("chat", "text_completion", "generate_content")
INPUT = "gen_ai.input.messages"
OUTPUT = "gen_ai.output.messages"
# Why a span carries no prompt, by the semantic conventions its instrumentation follows: the newer ones (spans name
# gen_ai.provider.name) put content on the span only with a capture mode, and refuse ``true``; the older ones
# (gen_ai.system) never put it on the span but emit each message as a log record, joined here where the export holds
# them (a collector writing logs and traces into one file).
NOT_CAPTURED = {
    "newer": (
        "not captured: content capture is off by default; these spans follow the newer GenAI conventions, whose setting "
        "takes a mode (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY or SPAN_AND_EVENT; true is refused "
        "and falls back to no content), so this span's prompt is unknown"
    ),
    "older": (
        "no messages on this span: it follows the older GenAI conventions, which write each message as a log record "
        "(gen_ai.user.message, in resourceLogs), with content only when OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true; "
        "this export holds none for this span: export the logs pipeline into the same file (or set "
        "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental with ...CAPTURE_MESSAGE_CONTENT=SPAN_ONLY), and this "
        "span's prompt is unknown"
    ),
    "older-without-content": (
        "content capture is off: this span's message log records (older GenAI conventions) hold no content; set "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true, and this span's prompt is unknown"
    ),
}
CONVERSATION = "gen_ai.conversation.id"
ANCESTOR_CONVERSATION = f"{CONVERSATION} of an ancestor span"  # the session key reported when a parent span named it
# The older conventions' events: a message each (its role, where the body names none), and the reply.
MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
CHOICE_EVENT = "gen_ai.choice"
JOINED = "kvscopeJoined"  # what ``joined`` adds to a span (and a logs batch): not an OTLP key

BATCHES = ("resourceSpans", "resourceLogs", "resourceMetrics")  # what a collector's file exporter writes, a batch a line


def is_batch(record: dict) -> bool:
    """An OTLP/JSON batch of traces, logs or metrics (one collector file may hold all three)."""
    return any(key in record for key in BATCHES)


def read_batch(record: dict) -> SourceRead:
    read = SourceRead()
    if "resourceSpans" not in record:
        kind = next((key for key in BATCHES if key in record), None)
        if kind is None:
            reason = "missing: this record is not an OTLP/JSON batch (resourceSpans, resourceLogs or resourceMetrics)"
            raise RecordError("resourceSpans", reason)
        if record.get(JOINED):
            raise RecordError(kind, f"a logs batch: its {record[JOINED]} GenAI message records were read with their spans")
        raise RecordError(kind, f"a {kind[len('resource') :].lower()} batch holds no chat request (the spans do)")
    if not isinstance(record["resourceSpans"], list):
        raise RecordError("resourceSpans", f"must be a list, got {type(record['resourceSpans']).__name__}")
    for key, span in _spans(record):
        attributes = attribute_values(span.get("attributes"))
        if langfuse.is_generation_span(attributes):
            reader = langfuse.read_generation_span
        elif _is_inference(attributes):
            reader = _span
        else:
            continue
        try:
            read.requests += reader(span, attributes, key)
        except RecordError as error:
            read.skipped.append(error)
    return read


def _spans(record: dict) -> Iterable[tuple[str, dict]]:
    """(where, span) of every span of a traces batch (the older ``instrumentationLibrarySpans`` too)."""
    resources = record.get("resourceSpans")
    for i, resource in enumerate(resources if isinstance(resources, list) else [], 1):
        scopes = (resource.get("scopeSpans") or resource.get("instrumentationLibrarySpans") or []) if isinstance(resource, dict) else []
        for j, scope in enumerate(scopes if isinstance(scopes, list) else [], 1):
            spans = scope.get("spans") if isinstance(scope, dict) else None
            for k, span in enumerate(spans if isinstance(spans, list) else [], 1):
                if isinstance(span, dict):
                    yield f"resourceSpans {i} scopeSpans {j} spans {k}", span


def _log_records(record: dict) -> Iterable[dict]:
    """Every log record of a logs batch."""
    resources = record.get("resourceLogs")
    for resource in resources if isinstance(resources, list) else []:
        scopes = (resource.get("scopeLogs") or resource.get("instrumentationLibraryLogs") or []) if isinstance(resource, dict) else []
        for scope in scopes if isinstance(scopes, list) else []:
            items = scope.get("logRecords") if isinstance(scope, dict) else None
            yield from (item for item in (items if isinstance(items, list) else []) if isinstance(item, dict))


@dataclass
class _Links:
    """What an export says about its spans across lines: each span's parent, the conversation ids spans name, and
    the message events logged for each span (in file order). Spans are keyed by (traceId, spanId)."""

    spans: set[tuple[str, str]] = field(default_factory=set)
    parents: dict[tuple[str, str], str] = field(default_factory=dict)
    conversations: dict[tuple[str, str], str] = field(default_factory=dict)
    events: dict[tuple[str, str], list[tuple[str, Any]]] = field(default_factory=dict)

    def conversation(self, span: tuple[str, str]) -> tuple[str, str] | None:
        """The conversation id of the nearest ancestor of ``span`` that names one, and that ancestor's span id."""
        seen, parent = {span}, self.parents.get(span)
        while parent and (span[0], parent) not in seen:
            key = (span[0], parent)
            if key in self.conversations:
                return self.conversations[key], parent
            seen.add(key)
            parent = self.parents.get(key)
        return None


def joined(records: Iterable[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """An export's records with what other lines say about their spans (module docstring): each inference span
    without messages given its logged message events, and each one without a conversation id its nearest ancestor's
    (under ``JOINED``); a logs batch whose messages were joined marked with their count. Other records unchanged."""
    records = list(records)
    links = _links(record for _, record in records)
    if not links.events and not links.parents:
        return records
    return [(line, _joined(record, links) if isinstance(record, dict) else record) for line, record in records]


def _links(records: Iterable[Any]) -> _Links:
    links = _Links()
    for record in records:
        if not isinstance(record, dict):
            continue
        for _, span in _spans(record):
            key = _span_key(span)
            links.spans.add(key)
            if isinstance(span.get("parentSpanId"), str) and span["parentSpanId"]:
                links.parents[key] = span["parentSpanId"]
            if (conversation := session_text(attribute_values(span.get("attributes")).get(CONVERSATION))) is not None:
                links.conversations[key] = conversation
        for item in _log_records(record):
            if (name := _event_name(item)) is not None:
                links.events.setdefault(_span_key(item), []).append((name, _value(item.get("body"))))
    return links


def _span_key(item: dict) -> tuple[str, str]:
    """The (traceId, spanId) a span is, or a log record belongs to."""
    return str(item.get("traceId")), str(item.get("spanId"))


def _event_name(item: dict) -> str | None:
    """A log record's GenAI message or choice event (``eventName``, or an older SDK's ``event.name`` attribute)."""
    name = item.get("eventName") or attribute_values(item.get("attributes")).get("event.name")
    return name if name in MESSAGE_EVENTS or name == CHOICE_EVENT else None


def _joined(record: dict, links: _Links) -> dict:
    if "resourceLogs" in record:
        count = sum(_event_name(item) is not None and _span_key(item) in links.spans for item in _log_records(record))
        return {**record, JOINED: count} if count else record
    if "resourceSpans" not in record:
        return record
    extras = []  # per span, in ``_spans`` order: what other lines add to it
    for _, span in _spans(record):
        key, attributes = _span_key(span), attribute_values(span.get("attributes"))
        extra: dict[str, Any] = {}
        if attributes.get(INPUT) is None and key in links.events:
            extra |= _from_events(links.events[key])
        if attributes.get(CONVERSATION) is None and (found := links.conversation(key)):
            extra["conversation"] = found[0]
        extras.append(extra)
    if not any(extras):
        return record
    record = json.loads(json.dumps(record))  # a copy: the caller's records stay as read
    for (_, span), extra in zip(_spans(record), extras):
        if extra:
            span[JOINED] = extra
    return record


def _from_events(events: list[tuple[str, Any]]) -> dict[str, Any]:
    """A span's logged message events as OpenAI chat messages (``None`` content where capture was off) and its first
    choice as the reply."""
    messages, reply = [], None
    for name, body in events:
        body = body if isinstance(body, dict) else {}
        if name == CHOICE_EVENT:
            if reply is None and body.get("index", 0) in (0, None):
                message = body.get("message") if isinstance(body.get("message"), dict) else {}
                reply = {**message, "finish_reason": body.get("finish_reason")}
            continue
        message: dict[str, Any] = {"role": body.get("role") or MESSAGE_EVENTS[name], "content": _event_text(body.get("content"))}
        if isinstance(body.get("tool_calls"), list) and body["tool_calls"]:
            message["tool_calls"] = [_event_call(call) for call in body["tool_calls"]]
        if name == "gen_ai.tool.message":
            message["tool_call_id"] = body.get("id")
        messages.append(message)
    return {"messages": messages, **({"reply": reply} if reply is not None else {})}


def _event_text(content: Any) -> str | None:
    """An event's content: text, or the text of a list of parts; None where it holds none (capture off)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", part.get("content", ""))) if isinstance(part, dict) else str(part) for part in content)
    return json.dumps(content, ensure_ascii=False)


def _event_call(call: Any) -> dict:
    """A tool call of an assistant message event as an OpenAI tool call (arguments as JSON text)."""
    call = call if isinstance(call, dict) else {}
    function = call.get("function") if isinstance(call.get("function"), dict) else {}
    arguments = function.get("arguments")
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
    return {"id": call.get("id"), "type": "function", "function": {"name": function.get("name"), "arguments": arguments}}


def attribute_values(attributes: Any) -> dict[str, Any]:
    """OTLP/JSON attributes as plain values (``intValue`` text as an int where it is one)."""
    if not isinstance(attributes, list):
        return {}
    return {item["key"]: _value(item.get("value")) for item in attributes if isinstance(item, dict) and isinstance(item.get("key"), str)}


def _value(value: Any) -> Any:
    if not isinstance(value, dict) or not value:
        return None
    kind, raw = next(iter(value.items()))
    if kind == "intValue":
        try:
            return int(raw)
        except (TypeError, ValueError):
            return raw  # kept as logged: a count that is not an integer is flagged where it is read
    if kind == "arrayValue":
        return [_value(item) for item in (raw or {}).get("values", [])]
    if kind == "kvlistValue":
        return attribute_values((raw or {}).get("values"))
    return raw


def _is_inference(attributes: dict) -> bool:
    operation = attributes.get("gen_ai.operation.name")
    return operation in INFERENCE or (operation is None and (INPUT in attributes or "gen_ai.request.model" in attributes))


def _span(span: dict, attributes: dict, key: str) -> list[dict]:
    joined = span.get(JOINED) if isinstance(span.get(JOINED), dict) else {}
    if attributes.get(INPUT) is None and not joined.get("messages"):
        raise RecordError(f"{key} {INPUT}", NOT_CAPTURED[convention(attributes)])
    if attributes.get(INPUT) is None:
        if any(message["content"] is None and message["role"] in ("system", "user") for message in joined["messages"]):
            raise RecordError(f"{key} {INPUT}", NOT_CAPTURED["older-without-content"])
        messages = [{**message, "content": message["content"] or ""} for message in joined["messages"]]
    else:
        messages = _messages(parsed_json(attributes[INPUT], f"{key} {INPUT}"), f"{key} {INPUT}")
    system = parsed_json(attributes.get("gen_ai.system_instructions"), f"{key} gen_ai.system_instructions")
    if system:
        messages.insert(0, {"role": "system", "content": _text(system, f"{key} gen_ai.system_instructions")})
    tools = parsed_json(attributes.get("gen_ai.tool.definitions"), f"{key} gen_ai.tool.definitions") or []
    if not isinstance(tools, list):
        raise RecordError(f"{key} gen_ai.tool.definitions", f"must be a list of tool definitions, got {type(tools).__name__}")
    items = read_request({"messages": messages, "tools": [_tool(tool) for tool in tools]}, key)
    own = attributes.get(CONVERSATION)
    return requests_of(
        items,
        "otel",
        session=own if own is not None else joined.get("conversation"),
        session_key=CONVERSATION if own is not None else ANCESTOR_CONVERSATION,
        timestamp=epoch_seconds(span.get("startTimeUnixNano"), f"{key} startTimeUnixNano"),
        model=attributes.get("gen_ai.request.model") or attributes.get("gen_ai.response.model"),
        usage=observed_usage(attributes, "otel", f"{key} attributes"),
        reply=_reply(attributes, key) or _event_reply(joined.get("reply")),
    )


def _event_reply(choice: dict | None) -> Reply | None:
    """The reply of a logged ``gen_ai.choice`` event (joined to its span), if it holds any content."""
    if not choice or (choice.get("content") is None and not choice.get("tool_calls")):
        return None
    calls = choice.get("tool_calls")
    calls = tuple(_event_call(call) for call in calls) if isinstance(calls, list) else ()
    return Reply(_event_text(choice.get("content")) or "", calls, None, finish_of(choice.get("finish_reason")))


def _reply(attributes: dict, key: str) -> Reply | None:
    """The span's first output message (``gen_ai.output.messages``), its finish from the message or from
    ``gen_ai.response.finish_reasons``; None where the span holds no output (or one that cannot be read)."""
    try:
        output = parsed_json(attributes.get(OUTPUT), f"{key} {OUTPUT}")
        messages = _messages(output, f"{key} {OUTPUT}") if output else []
    except RecordError:
        return None
    if not messages or messages[0].get("role") != "assistant":
        return None
    reasons = attributes.get("gen_ai.response.finish_reasons")
    first = output[0].get("finish_reason") if isinstance(output[0], dict) else None
    finish = finish_of(first or (reasons[0] if isinstance(reasons, list) and reasons else reasons))
    return Reply(messages[0]["content"], tuple(messages[0].get("tool_calls", ())), None, finish)


def convention(attributes: dict) -> str:
    """The GenAI semantic conventions a span follows (``NOT_CAPTURED``'s keys): the older ones name ``gen_ai.system``,
    the newer ones ``gen_ai.provider.name``."""
    return "older" if "gen_ai.system" in attributes and "gen_ai.provider.name" not in attributes else "newer"


def _messages(messages: Any, key: str) -> list[dict]:
    """Role + parts messages as OpenAI chat messages: text parts joined, tool calls on the assistant message, each
    tool call response its own tool message."""
    if not isinstance(messages, list):
        raise RecordError(key, f"must be a list of messages, got {type(messages).__name__}")
    out: list[dict] = []
    for number, message in enumerate(messages, 1):
        where = f"{key} {number}"
        parts = message.get("parts") if isinstance(message, dict) else None
        if not isinstance(parts, list):
            raise RecordError(where, "a message needs a role and a list of parts")
        texts, calls, results = [], [], []
        for index, part in enumerate(parts, 1):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "text" and isinstance(part.get("content"), str):
                texts.append(part["content"])
            elif kind == "tool_call":
                arguments = part.get("arguments")
                arguments = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
                calls.append({"id": part.get("id"), "type": "function", "function": {"name": part.get("name"), "arguments": arguments}})
            elif kind == "tool_call_response":
                results.append({"role": "tool", "tool_call_id": part.get("id"), "content": _response_text(part.get("response"))})
            else:
                reason = f"a {kind!r} part is not text, tool_call or tool_call_response; KVScope audits text"
                raise RecordError(f"{where} part {index}", reason)
        if results:
            out += results
        if texts or calls or not results:
            out.append({"role": message.get("role"), "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def _text(parts: Any, key: str) -> str:
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "text" for p in parts):
        raise RecordError(key, "must be a list of text parts")
    return "".join(str(part.get("content", "")) for part in parts)


def _response_text(response: Any) -> str:
    if isinstance(response, str):
        return response
    if isinstance(response, list) and response and all(isinstance(p, dict) and p.get("type") == "text" for p in response):
        return "".join(str(part.get("content", "")) for part in response)
    return json.dumps(response, ensure_ascii=False)


def _tool(tool: Any) -> Any:
    """A definition in the semantic conventions' flat form as an OpenAI tool (one already nested is kept)."""
    if not isinstance(tool, dict) or "function" in tool:
        return tool
    return {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters") if key in tool}}
