"""A request log read: JSONL or a JSON array of records in any format gateways and exports record, in time order
where every request has a timestamp (``read_log``: a malformed record skipped and named; ``parse_log``: strict), and
one prompt as plain text or messages JSON (``parse_prompt``). Every error names the line, the request, the key and
the reason."""

from __future__ import annotations

import dataclasses
import json
import sys
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.engine.audit.logs.formats import AUTO, RecordError, read_record, text_of
from kvscope.engine.audit.logs.replies import Reply
from kvscope.engine.audit.logs.requests import (
    ROLES,
    CacheBreakpoint,
    Flagged,
    Message,
    Request,
    RequestLog,
    RequestLogError,
    Skipped,
    ToolCall,
    named_problem,
)
from kvscope.engine.audit.logs.sources import joined_records, read_any


def read_log(text: str, fmt: str = AUTO) -> RequestLog:
    """Every readable request of a JSONL log or a JSON array of records (plain requests in any format, or exports:
    ``kvscope.engine.audit.logs.sources``), in time order where every request has a timestamp; each malformed record, or part of
    one, skipped by name."""
    requests: list[Request] = []
    skipped: list[Skipped] = []
    sessions: dict[str, str] = {}
    for line, item in joined_records(log_records(text)):
        try:
            read = record_requests(item, fmt, len(requests) + 1, line)
        except RecordError as error:
            skipped.append(Skipped(line, error.key, error.reason))
            continue
        requests += read.requests
        skipped += read.skipped
        sessions |= read.sessions
    return finished_log(requests, skipped, sessions)


def finished_log(requests: Sequence[Request], skipped: Sequence[Skipped], sessions: Mapping[str, str]) -> RequestLog:
    """The requests read record by record made a log: each Langfuse observation given its trace's session
    (``join_traces``), put in time order (``time_ordered``), its flags listed, its formats counted; the records
    skipped kept in the order read (file by file, line by line), as the distributed pass keeps them."""
    ordered, order, _ = time_ordered(join_traces(requests, sessions))
    flagged = tuple(Flagged(request.index, request.line, key, reason) for request in ordered for key, reason in request.flags)
    formats = dict(Counter(request.format for request in ordered))
    return RequestLog(tuple(ordered), tuple(skipped), formats, order, flagged)


def join_traces(requests: Sequence[Request], sessions: Mapping[str, str]) -> list[Request]:
    """Each Langfuse observation given the session its trace's record names (``sessions``: trace -> session, from
    every record of the log), where one does; else it keeps its own session, or its trace."""
    if not sessions:
        return list(requests)
    return [dataclasses.replace(request, session=sessions[request.trace]) if request.trace in sessions else request for request in requests]


@dataclass(frozen=True)
class TimeOrder:
    """The order a report uses (``ORDERS``) for requests given in the log's order: ``order`` names it, ``untimed``
    counts the requests without a timestamp, and ``numbers`` gives each request's number (1..) in time order by its
    place in the log's order (None: the log's order is the time order)."""

    order: str
    untimed: int
    numbers: np.ndarray | None  # (requests,) int64

    def number(self, place: int) -> int:
        """The number in time order of the request at ``place`` (0-based) of the log's order."""
        return place + 1 if self.numbers is None else int(self.numbers[place])


def time_order(timestamps: Sequence[float | None] | np.ndarray) -> TimeOrder:
    """The one time order of a log, from its requests' timestamps in the log's order (seconds; None or NaN: none):
    by timestamp where every request has one, stable (the log's order breaks ties), else the log's order. Both the
    in-process reading (``time_ordered``) and the distributed pass (``distributed.token_pass.LogCount``) use it."""
    times = np.array([np.nan if time is None else time for time in timestamps], dtype=np.float64)
    untimed = int(np.isnan(times).sum())
    if not len(times) or untimed:
        return TimeOrder("log", untimed, None)
    if not bool((np.diff(times) < 0).any()):  # already in time order (ties kept as logged)
        return TimeOrder("timestamps", 0, None)
    numbers = np.empty(len(times), dtype=np.int64)
    numbers[np.argsort(times, kind="stable")] = np.arange(1, len(times) + 1)
    return TimeOrder("timestamps", 0, numbers)


def time_ordered(requests: Sequence[Request]) -> tuple[list[Request], str, dict[int, int]]:
    """The requests in the order a report uses (``time_order``: by their own timestamps where every request has one,
    stable, else as logged); renumbered 1.. in that order, with old index -> new."""
    order = time_order([request.timestamp for request in requests])
    renumbered = {request.index: order.number(place) for place, request in enumerate(requests)}
    ordered = sorted(requests, key=lambda request: renumbered[request.index])
    return [dataclasses.replace(request, index=renumbered[request.index]) for request in ordered], order.order, renumbered


@dataclass(frozen=True)
class RecordRead:
    """The requests one record of a log holds, the parts of it skipped, and the sessions it names for Langfuse traces."""

    requests: list[Request]
    skipped: list[Skipped]
    sessions: dict[str, str]  # trace -> session


def record_requests(item: Any, fmt: str, first_index: int, line: int) -> RecordRead:
    """The requests one record of a log holds (``item``: the parsed JSON, or why it could not be read), numbered from
    ``first_index`` in the record's order (exports too, each record on its own: a Langfuse observation's session is
    its trace until ``join_traces``), and the parts of it skipped; raises ``RecordError`` (key, reason) for a
    malformed record."""
    if isinstance(item, RecordError):
        raise item
    if isinstance(item, json.JSONDecodeError):
        raise RecordError("", f"is not JSON: {item.msg} (column {item.colno})")
    part = read_any(item, fmt)
    skipped = [Skipped(line, error.key, error.reason) for error in part.skipped]
    requests = []
    for request in part.requests:
        try:
            requests.append(_request(request, first_index + len(requests), line))
        except RecordError as error:
            skipped.append(Skipped(line, error.key, error.reason))
    return RecordRead(requests, skipped, dict(part.sessions))


def parse_log(text: str, fmt: str = AUTO) -> list[Request]:
    """Every request of a log, strictly: the first malformed record fails it, named by line, request and key."""
    log = read_log(text, fmt)
    if log.skipped:
        first = log.skipped[0]
        index = sum(request.line < first.line for request in log.requests) + 1
        where = f"line {first.line}" if first.reason.startswith("is not JSON") else f"line {first.line} (request {index})"
        raise RequestLogError(named_problem(where, first.key, first.reason))
    return list(log.requests)


def parse_prompt(text: str) -> Request:
    """One prompt: messages JSON (a request object or a list of messages), else plain text as one user message."""
    stripped = text.strip()
    if not stripped:
        raise RequestLogError("the prompt is empty")
    if stripped[0] in "[{":
        try:
            item = json.loads(stripped)
        except json.JSONDecodeError:
            item = None
        if isinstance(item, list | dict):
            try:
                return _request(read_record({"messages": item} if isinstance(item, list) else item)[0], 1, 1)
            except RecordError as error:
                raise RequestLogError(named_problem("line 1 (request 1)", error.key, error.reason)) from None
    return Request(1, 1, (Message("user", text),))


def log_records(text: str) -> list[tuple[int, Any]]:
    """(line, parsed record or its JSON error) for each record of a JSONL log, a JSON array, or one JSON object."""
    stripped = text.strip()
    if not stripped:
        raise RequestLogError("the log is empty: paste one JSON request per line, or a JSON array of requests")
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise RequestLogError(f"line {error.lineno} is not JSON: {error.msg} (column {error.colno})") from None
        return list(zip(_array_item_lines(stripped, len(items)), items))
    if stripped.startswith("{") and "\n" in stripped:  # one JSON object written over many lines (an API's page)
        try:
            return [(text[: text.index("{")].count("\n") + 1, json.loads(stripped))]
        except json.JSONDecodeError:
            pass  # JSONL: one record a line
    records = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append((line_number, json.loads(line)))
            except json.JSONDecodeError as error:
                records.append((line_number, error))
    return records


def _array_item_lines(text: str, count: int) -> list[int]:
    """The line each top-level array item starts on (for messages that name a line)."""
    decoder, lines, position = json.JSONDecoder(), [], text.index("[") + 1
    for _ in range(count):
        while text[position] in " \t\r\n,":
            position += 1
        lines.append(text.count("\n", 0, position) + 1)
        _, position = decoder.raw_decode(text, position)
    return lines


# What a reader may add beside the request it read: when it was sent, the model named, and what the server cached.
_OBSERVED_KEYS = (
    *("timestamp", "model", "observed_cached_tokens", "observed_cache_write_tokens", "observed_prompt_tokens", "session_key"),
    *("slot", "answer_marks"),  # the slot a request pins (llama-server's ``id_slot``), what its answer says of its server
)


def _request(item: dict, index: int, line: int) -> Request:
    """A Request from one OpenAI-shaped request (``formats.read_record``'s output)."""
    trace = item.get("trace")
    common = {"session": item.get("session") or trace, "format": item.get("format", "openai_chat"), "trace": trace}
    common |= {key: item[key] for key in _OBSERVED_KEYS if item.get(key) is not None}
    common["flags"] = tuple((key, reason) for key, reason in item.get("flags", ()))
    if isinstance(item.get("reply"), Reply):
        common["reply"] = item["reply"]
    if "prompt" in item:
        return Request(index, line, prompt=item["prompt"], **common)
    messages = item["messages"]
    if not isinstance(messages, list) or not messages:
        raise RecordError("messages", "must be a non-empty list")
    parsed = tuple(read_message(message, number) for number, message in enumerate(messages, 1))
    tools = item.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecordError("tools", "must be a list of tool objects")
    breakpoints = tuple(CacheBreakpoint(*mark) for mark in item.get("breakpoints", ()))
    encoded = tuple(sys.intern(json.dumps(tool, ensure_ascii=False)) for tool in tools)  # one copy of a text every request repeats
    return Request(index, line, parsed, tools=encoded, breakpoints=breakpoints, **common)


# One object per distinct message alive: each turn of a session resends every earlier message, so a log of N turns
# would otherwise hold N copies of its first (the generated agent log: 56 MB read for 10,000 requests, 39 MB so).
_MESSAGES: weakref.WeakValueDictionary[Message, Message] = weakref.WeakValueDictionary()


def read_message(message: Any, number: int) -> Message:
    """Message ``number`` of a request (OpenAI's chat shape), every problem named by its key; an equal message read
    before and still alive is returned as that one object (messages are immutable)."""
    at = f"message {number}"
    if not isinstance(message, dict):
        raise RecordError(at, "is not an object")
    role = message.get("role")
    if role == "function":  # the legacy functions API: a tool result named by its function
        role = "tool"
    if role not in ROLES:
        raise RecordError(at, f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = sys.intern(text_of(message.get("content"), at))  # a session's requests resend its messages: one copy each
    calls = message.get("tool_calls") or ([{"function": message["function_call"]}] if message.get("function_call") else [])
    if not isinstance(calls, list):
        raise RecordError(f"{at} tool_calls", f"must be a list, got {type(calls).__name__}")
    name = message.get("name")
    call_id = message.get("tool_call_id")
    read = Message(
        role,
        content,
        name if isinstance(name, str) else None,
        tuple(_tool_call(call, f"{at} tool_calls {k}") for k, call in enumerate(calls, 1)),
        call_id if isinstance(call_id, str) else None,
    )
    return _MESSAGES.setdefault(read, read)


def _tool_call(call: Any, at: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError(at, "a tool call needs a function with a 'name'")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call.get("id") if isinstance(call.get("id"), str) else None, function["name"], arguments)
