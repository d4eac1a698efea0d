"""Requests as a server receives them, as types: a request's messages, tool calls and cache breakpoints (``Request``),
a log of them in time order with what was skipped or flagged and why (``RequestLog``), and the error every reader
raises (``RequestLogError``). Reading a log is ``reading``; rendering it into tokens is ``render``."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11

from kvscope.engine.audit.logs.replies import Reply
from kvscope.engine.audit.report.records import Record
from kvscope.engine.errors import KVScopeError

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestLogError(KVScopeError):
    """A request log or prompt that cannot be audited; the message says where and why."""


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message; ``arguments`` as logged (JSON text)."""

    id: str | None
    name: str
    arguments: str

    def template_dict(self) -> dict:
        """The call as chat templates read it: arguments parsed to an object when they are JSON (as vLLM does)."""
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError:
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class Message:
    """One chat message: text content, and for agents its tool calls, the tool call it answers and a name."""

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def template_dict(self) -> dict:
        """The message as ``apply_chat_template`` reads it (only the keys it carries)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class CacheBreakpoint:
    """Where a request asked the provider to cache (Anthropic ``cache_control``): after ``chars`` characters of
    message ``message``'s content, or after the tool definitions (``message`` None)."""

    label: str
    message: int | None
    chars: int


@dataclass(frozen=True)
class Request:
    """One request of a log: chat ``messages`` (with ``tools``, each as its logged JSON text), or a completions
    ``prompt`` (exactly one of them), with the session key it carries and the format it was recorded in."""

    index: int  # 1-based, in log order
    line: int  # 1-based line of the log it starts on
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None
    tools: tuple[str, ...] = ()
    session: str | None = None
    format: str = "openai_chat"
    breakpoints: tuple[CacheBreakpoint, ...] = ()
    timestamp: float | None = None  # seconds since the epoch, where the record says when it was sent
    model: str | None = None  # the model the record names (``model``, ``request_model``, ``gen_ai.request.model``)
    observed_cached_tokens: int | None = None  # prompt tokens the server or provider reported cached; None: not reported
    observed_cache_write_tokens: int | None = None  # tokens it reported writing to its cache (Anthropic, OTel); None: not reported
    observed_prompt_tokens: int | None = None  # the prompt as the server counted it (its tokenizer's); None: not reported
    trace: str | None = None  # a Langfuse observation's trace: its session is the one the trace's record names (``join_traces``)
    flags: tuple[tuple[str, str], ...] = ()  # (key, why) of what its record says that could not be read (``Flagged``)
    reply: Reply | None = None  # what the server generated, where the log records it (``replies``)
    session_key: str | None = None  # the record's key its session was read from, where a reader chooses among several
    slot: int | None = None  # llama-server's slot the request pins (``id_slot``); None: the server chooses
    answer_marks: tuple[str, ...] = ()  # what the logged answer says of its server (``usage.answer_marks``)

    @property
    def where(self) -> str:
        return f"line {self.line} (request {self.index})"

    def with_contents(self, contents: Sequence[str]) -> Request:
        """The same request with each message's (or the prompt's) text replaced."""
        if self.messages is None:
            return dataclasses.replace(self, prompt=contents[0])
        messages = tuple(dataclasses.replace(m, content=text) for m, text in zip(self.messages, contents, strict=True))
        return dataclasses.replace(self, messages=messages)

    @property
    def contents(self) -> tuple[str, ...]:
        return (self.prompt,) if self.messages is None else tuple(m.content for m in self.messages)

    def tool_definitions(self) -> list[dict]:
        """The tools as objects, in their logged order."""
        return [json.loads(tool) for tool in self.tools]


@dataclass(frozen=True)
class Skipped(Record):
    """A record left out of the audit, named by its line and key."""

    line: int
    key: str
    reason: str

    @property
    def message(self) -> str:
        return named_problem(f"line {self.line}", self.key, self.reason)


@dataclass(frozen=True)
class Flagged(Record):
    """Something a kept request's record says that could not be read (a cached count, a time): dropped, and why."""

    request: int
    line: int
    key: str
    reason: str


ORDERS = {
    "timestamps": "by each request's own timestamp, the log's order breaking ties",
    "log": "as logged: not every request has a timestamp",
}


@dataclass(frozen=True)
class RequestLog:
    """The requests read from a log, in the order used (``ORDERS``; ``Request.index`` follows it), the records
    skipped (by name), how many requests each format or export gave, and what was flagged in kept requests."""

    requests: tuple[Request, ...]
    skipped: tuple[Skipped, ...]
    formats: dict[str, int]
    order: str = "log"
    flagged: tuple[Flagged, ...] = ()

    def reading(self) -> ReadingDict:
        """How the log was read, for reports: the order used and why, the requests without a timestamp, the flags."""
        untimed = sum(request.timestamp is None for request in self.requests)
        keys = Counter(request.session_key for request in self.requests if request.session_key)
        return reading(self.order, untimed, self.flagged, dict(keys))


class ReadingDict(TypedDict):
    """How the log was read: the order used and why, the requests without a timestamp, what was flagged, and the
    record keys the sessions were read from (with how many requests each)."""

    order: str
    order_reason: str
    untimed_requests: int
    flagged: list[Flagged]
    session_keys: dict[str, int]


def reading(order: str, untimed: int, flagged: Sequence[Flagged], session_keys: dict[str, int]) -> ReadingDict:
    """How a log was read, as reports say it (one process's ``RequestLog.reading`` and the distributed pass's alike):
    the order used (``ORDERS``) and why, the requests without a timestamp, the flags, and the requests per session key."""
    return {
        "order": order,
        "order_reason": ORDERS[order],
        "untimed_requests": untimed,
        "flagged": [item.as_dict() for item in flagged],
        "session_keys": session_keys,
    }


def named_problem(where: str, key: str, reason: str) -> str:
    """A problem in a log, named: where (line, request), the key, and why."""
    return f"{where}, {key}: {reason}" if key else f"{where} {reason}"
