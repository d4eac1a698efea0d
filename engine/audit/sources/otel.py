"""OpenTelemetry GenAI spans as a collector's file exporter writes them (OTLP/JSON: ``resourceSpans`` ->
``scopeSpans`` -> ``spans``, one batch a line; batches in any order).

Attributes are ``{key, value: {stringValue | intValue | doubleValue | boolValue | arrayValue | kvlistValue}}``, 64-bit
integers written as strings. A request is an inference span (``gen_ai.operation.name`` ``chat``,
``text_completion`` or ``generate_content``): ``gen_ai.system_instructions`` and ``gen_ai.input.messages`` (JSON
text, role + ``parts``: ``text``, ``tool_call``, ``tool_call_response``), ``gen_ai.tool.definitions``,
``gen_ai.conversation.id`` (the session), ``gen_ai.request.model``, ``startTimeUnixNano``, and
``gen_ai.usage.cache_read.input_tokens`` / ``cache_creation.input_tokens``; the reply in ``gen_ai.output.messages``.
Content capture is off by default: a span without input messages is skipped with that reason, never guessed. Other
spans (tools, agents, HTTP) are not requests.
"""

from __future__ import annotations

import json
from typing import Any

from engine.audit.formats import RecordError
from engine.audit.replies import Reply, finish_of
from engine.audit.sources.common import SourceRead, epoch_seconds, parsed_json, read_request, requests_of
from engine.audit.usage import observed_usage

INFERENCE = ("chat", "text_completion", "generate_content")
INPUT = "gen_ai.input.messages"
OUTPUT = "gen_ai.output.messages"
# Why a span carries no prompt, by the semantic conventions its instrumentation follows: the newer ones (spans name
# gen_ai.provider.name) put content on the span only with a capture mode, and refuse ``true``; the older ones
# (gen_ai.system) never put it on the span but emit each message as a log record, which this reader does not join.
NOT_CAPTURED = {
    "newer": (
        "not captured: content capture is off by default; these spans follow the newer GenAI conventions, whose setting "
        "takes a mode (OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY or SPAN_AND_EVENT; true is refused "
        "and falls back to no content), so this span's prompt is unknown"
    ),
    "older": (
        "no messages on this span: it follows the older GenAI conventions, which write each message as a log record "
        "(gen_ai.user.message, in resourceLogs) even with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true; "
        "KVScope reads prompts from spans, so set OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental with "
        "...CAPTURE_MESSAGE_CONTENT=SPAN_ONLY, and this span's prompt is unknown"
    ),
}


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
        raise RecordError(kind, f"a {kind[len('resource') :].lower()} batch holds no chat request (the spans do)")
    resources = record["resourceSpans"]
    if not isinstance(resources, list):
        raise RecordError("resourceSpans", f"must be a list, got {type(resources).__name__}")
    for i, resource in enumerate(resources, 1):
        scopes = (resource.get("scopeSpans") or resource.get("instrumentationLibrarySpans") or []) if isinstance(resource, dict) else []
        for j, scope in enumerate(scopes if isinstance(scopes, list) else [], 1):
            spans = scope.get("spans") if isinstance(scope, dict) else None
            for k, span in enumerate(spans if isinstance(spans, list) else [], 1):
                key = f"resourceSpans {i} scopeSpans {j} spans {k}"
                attributes = attribute_values(span.get("attributes")) if isinstance(span, dict) else {}
                if not _is_inference(attributes):
                    continue
                try:
                    read.requests += _span(span, attributes, key)
                except RecordError as error:
                    read.skipped.append(error)
    return read


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
    if attributes.get(INPUT) is None:
        raise RecordError(f"{key} {INPUT}", NOT_CAPTURED[convention(attributes)])
    messages = _messages(parsed_json(attributes[INPUT], f"{key} {INPUT}"), f"{key} {INPUT}")
    system = parsed_json(attributes.get("gen_ai.system_instructions"), f"{key} gen_ai.system_instructions")
    if system:
        messages.insert(0, {"role": "system", "content": _text(system, f"{key} gen_ai.system_instructions")})
    tools = parsed_json(attributes.get("gen_ai.tool.definitions"), f"{key} gen_ai.tool.definitions") or []
    if not isinstance(tools, list):
        raise RecordError(f"{key} gen_ai.tool.definitions", f"must be a list of tool definitions, got {type(tools).__name__}")
    items = read_request({"messages": messages, "tools": [_tool(tool) for tool in tools]}, key)
    return requests_of(
        items,
        "otel",
        session=attributes.get("gen_ai.conversation.id"),
        timestamp=epoch_seconds(span.get("startTimeUnixNano"), f"{key} startTimeUnixNano"),
        model=attributes.get("gen_ai.request.model") or attributes.get("gen_ai.response.model"),
        usage=observed_usage(attributes, "otel", f"{key} attributes"),
        reply=_reply(attributes, key),
    )


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
