"""The request formats gateways record, each read as the OpenAI chat (or completions) request it is equivalent to: one
entry per format in ``REQUEST_FORMATS`` (what each reads as: docs/audit.md, "Request formats").

A record is first unwrapped from its envelope (a gateway record ``{"request": {...}, "response": ..., "timestamp"}``
or an OpenAI batch input line ``{"custom_id", "body"}``), then read by its format, detected from its keys or named.
The result is a plain ``dict`` in the OpenAI chat shape, plus ``session`` (the session key a record carries, if any),
``slot`` (llama-server's ``id_slot``, where the client pins one) and ``breakpoints`` (``(label, message, characters
into its content)``, where the user asked the provider to cache). Errors raise ``RecordError`` naming the key and why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvscope.engine.audit.logs.replies import Reply
from kvscope.engine.errors import KVScopeError

AUTO = "auto"
# Where a session key sits: the record's own keys, then its metadata (OpenAI ``user``, Anthropic ``metadata.user_id``).
SESSION_KEYS = ("session_id", "session", "conversation_id", "thread_id", "user", "user_id")
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
_TEXT_PARTS = ("text", "input_text", "output_text")


class RecordError(KVScopeError):
    """One record that cannot be read; ``key`` names the key at fault."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key = key
        self.reason = reason


def unwrap(record: Any) -> tuple[dict, str | None]:
    """The request inside a gateway record or a batch line (the record itself otherwise), and the session key the
    envelope carries."""
    if not isinstance(record, dict):
        raise RecordError("", f"is a JSON {type(record).__name__}, not a request object")
    for key in ("request", "body"):
        inner = record.get(key)
        if key in record and _is_envelope(record, key):
            if isinstance(inner, str):
                try:
                    inner = json.loads(inner)
                except json.JSONDecodeError as error:
                    raise RecordError(key, f"holds text that is not JSON ({error.msg})") from None
            if not isinstance(inner, dict):
                raise RecordError(key, f"must be a request object, got {type(inner).__name__}")
            return inner, session_key(record)
    return record, None


def _is_envelope(record: dict, key: str) -> bool:
    if key == "body":
        return "custom_id" in record or "url" in record
    return not any(name in record for name in ("messages", "prompt", "input", "conversations"))


def session_key(record: dict) -> str | None:
    """The session a record names: one of ``SESSION_KEYS``, on the record or in its ``metadata``."""
    for holder in (record, record.get("metadata") if isinstance(record.get("metadata"), dict) else {}):
        for key in SESSION_KEYS:
            if (session := session_text(holder.get(key))) is not None:
                return session
    return None


def session_text(value: Any) -> str | None:
    """A logged session id as text: a non-empty string or an integer (not a bool); None for anything else."""
    return str(value) if isinstance(value, str | int) and not isinstance(value, bool) and str(value) else None


def detect(request: dict) -> str:
    """The format of one (unwrapped) request, from its keys: the first entry of ``REQUEST_FORMATS`` whose ``matches`` it."""
    for entry in REQUEST_FORMATS.values():
        if entry.matches(request):
            return entry.name
    raise RecordError("", "has no 'messages' (chat), 'prompt' (completions), 'input' (Responses) or 'conversations' (ShareGPT)")


def _looks_anthropic(request: dict) -> bool:
    if isinstance(request.get("system"), str | list) or "anthropic_version" in request:
        return True
    tools = request.get("tools") if isinstance(request.get("tools"), list) else []
    if any(isinstance(tool, dict) and "input_schema" in tool for tool in tools):
        return True
    messages = request.get("messages") if isinstance(request.get("messages"), list) else []
    blocks = [part for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for part in m["content"]]
    return any(isinstance(b, dict) and (b.get("type") in ("tool_use", "tool_result") or "cache_control" in b) for b in blocks)


def read_record(record: Any, fmt: str = AUTO) -> list[dict]:
    """One log record as OpenAI-shaped requests (one, or one per assistant turn for ShareGPT)."""
    request, envelope_session = unwrap(record)
    name = detect(request) if fmt == AUTO else fmt
    if name not in FORMATS:
        raise RecordError("", f"unknown format {name!r}; choose {AUTO} or one of {', '.join(FORMATS)}")
    read = REQUEST_FORMATS[name].read
    session = envelope_session or session_key(request)
    slot = request.get("id_slot")  # llama-server's slot, where the client pins one
    pinned = {"slot": slot} if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0 else {}
    return [{**item, "format": name, "session": item.get("session") or session, **pinned} for item in read(request)]


def _openai_chat(request: dict) -> list[dict]:
    if "messages" not in request:
        raise RecordError("messages", "missing (this record is not an OpenAI chat request)")
    tools = request.get("tools")
    if tools is None and request.get("functions") is not None:
        tools = [{"type": "function", "function": f} for f in _list(request, "functions")]
    return [{"messages": request["messages"], "tools": tools or []}]


def _openai_completions(request: dict) -> list[dict]:
    if not isinstance(request.get("prompt"), str):
        raise RecordError("prompt", f"must be a string, got {type(request.get('prompt')).__name__}")
    return [{"prompt": request["prompt"]}]


def _list(holder: dict, key: str) -> list:
    value = holder.get(key)
    if not isinstance(value, list):
        raise RecordError(key, f"must be a list, got {type(value).__name__}")
    return value


def text_of(content: Any, key: str) -> str:
    """A string, or the text parts of a list of content parts, joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RecordError(key, f"must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for number, part in enumerate(content, 1):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RecordError(f"{key}, part {number}", f"a {kind!r} content part is not text; KVScope audits text only")
        texts.append(part["text"])
    return "".join(texts)


def _function_tool(tool: Any, key: str) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise RecordError(key, "a function tool needs a 'name'")
    function = {"name": tool["name"]}
    for source, target in (("description", "description"), ("parameters", "parameters"), ("input_schema", "parameters")):
        if source in tool:
            function[target] = tool[source]
    return {"type": "function", "function": function}


def _responses(request: dict) -> list[dict]:
    messages: list[dict] = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": text_of(request["instructions"], "instructions")})
    items = request.get("input")
    items = [{"role": "user", "content": items}] if isinstance(items, str) else _list(request, "input")
    for number, item in enumerate(items, 1):
        key = f"input item {number}"
        if not isinstance(item, dict):
            raise RecordError(key, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": text_of(item.get("content"), f"{key} content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text_of(item.get("output"), f"{key} output")})
        else:
            raise RecordError(
                f"{key} type", f"{kind!r} items have no chat-template rendering (message, function_call, function_call_output)"
            )
    tools = []
    for number, tool in enumerate(request.get("tools") or [], 1):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RecordError(f"tools {number}", f"a built-in {kind!r} tool has no chat-template rendering")
        tools.append(_function_tool(tool, f"tools {number}"))
    return [{"messages": messages, "tools": tools}]


def _anthropic(request: dict) -> list[dict]:
    messages: list[dict] = []
    breakpoints: list[tuple[str, int | None, int]] = []
    system = request.get("system")
    if system:
        text, marks = _anthropic_blocks_text(system, "system")
        messages.append({"role": "system", "content": text})
        breakpoints += [(f"system block {block}", 0, at) for block, at in marks]
    for number, message in enumerate(_list(request, "messages"), 1):
        key = f"messages {number}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            role = message.get("role") if isinstance(message, dict) else None
            raise RecordError(f"{key} role", f"Anthropic messages are user or assistant, got {role!r}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RecordError(f"{key} content", f"must be a string or a list of blocks, got {type(content).__name__}")
        breakpoints += _anthropic_turn(message["role"], blocks, key, messages)
    tools = []
    for number, tool in enumerate(request.get("tools") or [], 1):
        tools.append(_function_tool(tool, f"tools {number}"))
        if isinstance(tool, dict) and "cache_control" in tool:
            breakpoints.append((f"tools {number}", None, 0))
    return [{"messages": messages, "tools": tools, "breakpoints": breakpoints}]


def _anthropic_blocks_text(content: Any, key: str) -> tuple[str, list[tuple[int, int]]]:
    """Text blocks joined, and (block, characters so far) after each block carrying ``cache_control``."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise RecordError(key, f"must be a string or a list of text blocks, got {type(content).__name__}")
    text, marks = "", []
    for number, block in enumerate(content, 1):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise RecordError(f"{key} block {number}", f"a {kind!r} block is not text")
        text += block["text"]
        if "cache_control" in block:
            marks.append((number, len(text)))
    return text, marks


def _anthropic_turn(role: str, blocks: list, key: str, messages: list[dict]) -> list[tuple[str, int | None, int]]:
    """One Anthropic message's blocks appended to ``messages`` as OpenAI messages; the breakpoints it marks."""
    breakpoints, text, calls = [], "", []

    def flush() -> None:
        nonlocal text
        if text or (role == "assistant" and calls):
            messages.append({"role": role, "content": text, **({"tool_calls": list(calls)} if calls else {})})
        text = ""
        calls.clear()

    for number, block in enumerate(blocks, 1):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        where = f"{key} block {number}"
        if kind == "text" and isinstance(block.get("text"), str):
            text += block["text"]
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append({"id": block.get("id"), "type": "function", "function": {"name": block.get("name"), "arguments": arguments}})
        elif kind == "tool_result" and role == "user":
            flush()
            result, _ = _anthropic_blocks_text(block.get("content") or "", f"{where} content")
            messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            if "cache_control" in block:
                breakpoints.append((where, len(messages) - 1, len(result)))
            continue
        else:
            raise RecordError(where, f"a {kind!r} block in a {role} message is not text, tool_use or tool_result")
        if "cache_control" in block:
            breakpoints.append((where, len(messages), len(text)))
    flush()
    return breakpoints


def _sharegpt(request: dict) -> list[dict]:
    turns = _list(request, "conversations")
    messages, requests = [], []
    for number, turn in enumerate(turns, 1):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in _SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise RecordError(f"conversations {number}", f"needs 'from' (one of {', '.join(_SHAREGPT_ROLES)}) and a 'value' string")
        role = _SHAREGPT_ROLES[speaker]
        if role == "assistant" and messages:
            requests.append({"messages": list(messages), "tools": [], "reply": Reply(turn["value"])})
        messages.append({"role": role, "content": turn["value"]})
    if not requests:
        requests.append({"messages": messages, "tools": []})
    session = request.get("id") or request.get("conversation_id")
    return [{**item, "session": None if session is None else str(session)} for item in requests]


@dataclass(frozen=True)
class RequestFormat:
    """One request format: its name, its line, whether an unwrapped request is in it (``matches``: its keys; tried in
    ``REQUEST_FORMATS``' order), and its reader (OpenAI-shaped requests out)."""

    name: str
    description: str
    matches: Callable[[dict], bool]
    read: Callable[[dict], list[dict]]


REQUEST_FORMATS = {  # in the order ``detect`` tries them; adding a format is adding an entry here
    entry.name: entry
    for entry in (
        RequestFormat(
            "sharegpt", "ShareGPT conversations (from / value): one request per assistant turn", lambda r: "conversations" in r, _sharegpt
        ),
        RequestFormat(
            "anthropic",
            "Anthropic Messages: system, content blocks, tool_use / tool_result, tools, cache_control",
            lambda r: "messages" in r and _looks_anthropic(r),
            _anthropic,
        ),
        RequestFormat(
            "openai_chat",
            "OpenAI chat completions: messages, tools, assistant tool_calls, tool messages",
            lambda r: "messages" in r,
            _openai_chat,
        ),
        RequestFormat("openai_responses", "OpenAI Responses API: instructions, input items, tools", lambda r: "input" in r, _responses),
        RequestFormat(
            "openai_completions",
            "OpenAI completions: a prompt string, no chat template",
            lambda r: isinstance(r.get("prompt"), str),
            _openai_completions,
        ),
    )
}
FORMATS = {name: entry.description for name, entry in REQUEST_FORMATS.items()}  # the --format choices, each in a line
