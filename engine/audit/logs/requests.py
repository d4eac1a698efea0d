"""Requests as a server receives them: a request log in any format gateways record (``formats``) or one prompt,
read as OpenAI chat (or completions) requests, and rendered with the loaded model's own chat template (tools, tool
calls and tool results included) into the tokens a server would cache. A log's texts are tokenized line by line,
each distinct line once, where that gives the same tokens as the whole text (``TextEncoder``).

Accepted: JSONL (one record a line) or a JSON array of records, of plain requests or of observability exports
(``engine.audit.logs.sources``: LiteLLM, Langfuse, Helicone, OpenTelemetry, gateway records), which also say when each
request was sent and what the server cached. Requests are put in time order where every one has a timestamp (the
log's order breaking ties), else kept in the log's order; ``RequestLog.order`` says which, and ``Request.index``
follows it. ``read_log`` skips a malformed record (or one span or observation of it) and names it (line, key,
reason) while the rest is read, and flags a kept request's unreadable cached count or time (``Flagged``);
``parse_log`` is strict: the first malformed record fails the whole log.
One prompt may be plain text (one user message) or messages JSON. Every error names the line, the request, the key
and the reason.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.audit.logs.formats import AUTO, RecordError, read_record, text_of
from engine.audit.logs.replies import Reply, computed_tokens
from engine.audit.logs.sources import joined_records, read_any
from engine.errors import KVScopeError

if TYPE_CHECKING:  # the model is only read here; the token pass's workers need no torch
    from engine.cache.loaded import LoadedModel, LoadedTokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
RENDER_BATCH = 256  # texts tokenized together (their new lines in one call of the fast tokenizer)


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
class Skipped:
    """A record left out of the audit, named by its line and key."""

    line: int
    key: str
    reason: str

    @property
    def message(self) -> str:
        return _named(f"line {self.line}", self.key, self.reason)

    def as_dict(self) -> dict:
        return {"line": self.line, "key": self.key, "reason": self.reason}


@dataclass(frozen=True)
class Flagged:
    """Something a kept request's record says that could not be read (a cached count, a time): dropped, and why."""

    request: int
    line: int
    key: str
    reason: str

    def as_dict(self) -> dict:
        return {"request": self.request, "line": self.line, "key": self.key, "reason": self.reason}


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

    def reading(self) -> dict:
        """How the log was read, for reports: the order used and why, the requests without a timestamp, the flags."""
        untimed = sum(request.timestamp is None for request in self.requests)
        keys: dict[str, int] = {}
        for request in self.requests:
            if request.session_key:
                keys[request.session_key] = keys.get(request.session_key, 0) + 1
        return {
            "order": self.order,
            "order_reason": ORDERS[self.order],
            "untimed_requests": untimed,
            "flagged": [item.as_dict() for item in self.flagged],
            "session_keys": keys,
        }


def read_log(text: str, fmt: str = AUTO) -> RequestLog:
    """Every readable request of a JSONL log or a JSON array of records (plain requests in any format, or exports:
    ``engine.audit.logs.sources``), in time order where every request has a timestamp; each malformed record, or part of
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
    formats: dict[str, int] = {}
    for request in ordered:
        formats[request.format] = formats.get(request.format, 0) + 1
    return RequestLog(tuple(ordered), tuple(skipped), formats, order, flagged)


def join_traces(requests: Sequence[Request], sessions: Mapping[str, str]) -> list[Request]:
    """Each Langfuse observation given the session its trace's record names (``sessions``: trace -> session, from
    every record of the log), where one does; else it keeps its own session, or its trace."""
    if not sessions:
        return list(requests)
    return [dataclasses.replace(request, session=sessions[request.trace]) if request.trace in sessions else request for request in requests]


def time_ordered(requests: Sequence[Request]) -> tuple[list[Request], str, dict[int, int]]:
    """The requests in the order a report uses (``ORDERS``): by their own timestamps where every request has one
    (stable: the log's order breaks ties), else as logged; renumbered 1.. in that order, with old index -> new."""
    order = "timestamps" if requests and all(request.timestamp is not None for request in requests) else "log"
    ordered = sorted(requests, key=lambda request: request.timestamp) if order == "timestamps" else list(requests)
    renumbered = {request.index: number for number, request in enumerate(ordered, 1)}
    return [dataclasses.replace(request, index=renumbered[request.index]) for request in ordered], order, renumbered


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
        raise RequestLogError(_named(where, first.key, first.reason))
    return list(log.requests)


def _named(where: str, key: str, reason: str) -> str:
    return f"{where}, {key}: {reason}" if key else f"{where} {reason}"


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
                raise RequestLogError(_named("line 1 (request 1)", error.key, error.reason)) from None
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
_OBSERVED_KEYS = ("timestamp", "model", "observed_cached_tokens", "observed_cache_write_tokens", "observed_prompt_tokens", "session_key")


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
    parsed = tuple(_message(message, number) for number, message in enumerate(messages, 1))
    tools = item.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecordError("tools", "must be a list of tool objects")
    breakpoints = tuple(CacheBreakpoint(*mark) for mark in item.get("breakpoints", ()))
    encoded = tuple(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return Request(index, line, parsed, tools=encoded, breakpoints=breakpoints, **common)


def _message(message: Any, number: int) -> Message:
    at = f"message {number}"
    if not isinstance(message, dict):
        raise RecordError(at, "is not an object")
    role = message.get("role")
    if role == "function":  # the legacy functions API: a tool result named by its function
        role = "tool"
    if role not in ROLES:
        raise RecordError(at, f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = text_of(message.get("content"), at)
    calls = message.get("tool_calls") or ([{"function": message["function_call"]}] if message.get("function_call") else [])
    if not isinstance(calls, list):
        raise RecordError(f"{at} tool_calls", f"must be a list, got {type(calls).__name__}")
    name = message.get("name")
    call_id = message.get("tool_call_id")
    return Message(
        role,
        content,
        name if isinstance(name, str) else None,
        tuple(_tool_call(call, f"{at} tool_calls {k}") for k, call in enumerate(calls, 1)),
        call_id if isinstance(call_id, str) else None,
    )


def _tool_call(call: Any, at: str) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RecordError(at, "a tool call needs a function with a 'name'")
    arguments = function.get("arguments", "")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call.get("id") if isinstance(call.get("id"), str) else None, function["name"], arguments)


@dataclass(frozen=True, eq=False)
class RenderedRequest:
    """A request as tokens: the rendered text, its token ids, each token's character span, and which message's
    content each token belongs to (-1: the chat template's own tokens: role markers, tool definitions, tool calls)."""

    request: Request
    text: str
    token_ids: np.ndarray  # (tokens,) int32
    offsets: np.ndarray  # (tokens, 2) int32: each token's characters [start, end) of ``text``
    owners: np.ndarray  # (tokens,) int32
    content_spans: tuple[tuple[int, int], ...]  # each message's content, as characters of ``text``
    reply_ids: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int32))  # the logged reply's computed tokens

    @property
    def held(self) -> np.ndarray:
        """What a server holds after this request: its tokens and the reply tokens it computed (``replies``)."""
        return self.token_ids if not len(self.reply_ids) else np.concatenate([self.token_ids, self.reply_ids])

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def ids(self) -> tuple[int, ...]:
        """The token ids as Python ints (what the notebook and any comparison take)."""
        return tuple(self.token_ids.tolist())

    def tokens_in(self, start: int, end: int) -> range:
        """Tokens overlapping characters [start, end) (the token holding ``start`` for an empty span)."""
        first = int(np.searchsorted(self.offsets[:, 1], start, side="right"))  # the first token ending after start
        stop = int(np.searchsorted(self.offsets[:, 0], max(end, start + 1), side="left"))
        if first >= stop:
            raise RequestLogError(f"{self.request.where}: no token covers characters {start}..{end}")
        return range(first, stop)


def render_request(lm: LoadedModel, request: Request, max_tokens: int | None = None) -> RenderedRequest:
    """The request through the model's chat template (a completions prompt as it is), tokenized as a server would."""
    rendered = render_batch(lm.tokenizer, [request], max_tokens or context_limit(lm), lm.name)[0]
    if isinstance(rendered, RequestLogError):
        raise rendered
    return rendered


def render_batch(
    tokenizer: Any, requests: Sequence[Request], limit: int, model: str = "this model"
) -> list[RenderedRequest | RequestLogError]:
    """Every request rendered, the texts tokenized together by the fast tokenizer; a request that cannot be rendered
    (or exceeds ``limit`` tokens) gets its error in its place."""
    texts: list[str | RequestLogError] = []
    spans: list[tuple[tuple[int, int], ...]] = []
    for request in requests:
        try:
            text = _template_text(tokenizer, request, model)
            texts.append(text)
            spans.append(((0, len(text)),) if request.messages is None else _locate_contents(text, request))
        except RequestLogError as error:
            texts.append(error)
            spans.append(())
    good = [i for i, text in enumerate(texts) if isinstance(text, str)]
    out: list[RenderedRequest | RequestLogError] = [text for text in texts]  # errors stay in place
    encoder = TextEncoder(tokenizer)
    ends = end_of_turn_ids(tokenizer) if any(request.reply is not None for request in requests) else frozenset()
    for begin in range(0, len(good), RENDER_BATCH):
        chunk = good[begin : begin + RENDER_BATCH]
        for i, (ids, offsets) in zip(chunk, encoder.encode([texts[i] for i in chunk])):
            request = requests[i]
            if len(ids) > limit:
                out[i] = RequestLogError(f"{request.where} is {len(ids):,} tokens, longer than the context limit of {limit:,}")
            else:
                reply = _reply_tokens(tokenizer, request, texts[i], ends) if request.reply is not None else np.zeros(0, dtype=np.int32)
                out[i] = RenderedRequest(request, texts[i], ids, offsets, _owners(offsets, spans[i]), spans[i], reply)
    return out


_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|end_of_text|>")


def end_of_turn_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens that end a generation: the tokenizer's EOS and each end-of-turn marker its vocabulary holds."""
    ends = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    ends.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    vocabulary = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ends.update(vocabulary[marker] for marker in _END_MARKERS if marker in vocabulary)
    return frozenset(ends)


def _reply_tokens(tokenizer: Any, request: Request, prompt_text: str, ends: frozenset[int]) -> np.ndarray:
    """The tokens of ``request``'s reply its server computed: the ids it returned, else the reply's text tokenized
    (a reply of tool calls as the chat template writes them after the prompt), less the last sampled token."""
    reply = request.reply
    if reply.token_ids is not None:
        generated = list(reply.token_ids)
        kept = computed_tokens(generated, reply.finish, generated[-1] in ends)
    else:
        text = _reply_text(tokenizer, request, prompt_text)
        kept = computed_tokens(_encode_whole(tokenizer, [text])[0][0].tolist() if text else [], reply.finish, False)
    return np.asarray(kept, dtype=np.int32)


def _reply_text(tokenizer: Any, request: Request, prompt_text: str) -> str:
    """The text a model generated for ``request``: the logged reply, or, for tool calls, the chat template's rendering
    of the reply after the prompt, up to its end-of-turn marker (the server parsed the calls out of that text)."""
    reply = request.reply
    if not reply.tool_calls or request.messages is None:
        return reply.text
    try:
        whole = tokenizer.apply_chat_template(
            [*template_messages(request), _message(reply.as_message(), 0).template_dict()],
            tools=request.tool_definitions() or None,
            tokenize=False,
        )
    except Exception:  # a template (or a call) that refuses the reply: its text alone
        return reply.text
    if not whole.startswith(prompt_text):
        return reply.text
    rest = whole[len(prompt_text) :]
    eos = getattr(tokenizer, "eos_token", None)
    markers = [marker for marker in (eos, *_END_MARKERS) if isinstance(marker, str) and marker and marker in rest]
    return rest[: min(rest.index(marker) for marker in markers)] if markers else rest


def template_messages(request: Request) -> list[dict]:
    """The messages as ``apply_chat_template`` takes them."""
    return [message.template_dict() for message in request.messages]


def _template_text(tokenizer: Any, request: Request, model: str) -> str:
    if request.messages is None:
        return request.prompt
    if not getattr(tokenizer, "chat_template", None):
        raise RequestLogError(
            f"{request.where}: {model} has no chat template, so chat requests cannot be rendered; "
            'use completions requests ({"prompt": ...})'
        )
    try:
        return tokenizer.apply_chat_template(
            template_messages(request), tools=request.tool_definitions() or None, tokenize=False, add_generation_prompt=True
        )
    except Exception as error:  # a template's own refusal (raise_exception), e.g. roles that do not alternate
        raise RequestLogError(f"{request.where}: the chat template refuses this request: {error}") from None


def _encode_whole(tokenizer: Any, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and character offsets of each text, without special tokens (the template wrote them)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encodings = backend.encode_batch(texts, add_special_tokens=False)
        pairs = [(encoding.ids, encoding.offsets) for encoding in encodings]
    else:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        pairs = list(zip(encoded["input_ids"], encoded["offset_mapping"]))
    return [(np.asarray(ids, dtype=np.int32), np.asarray(offsets, dtype=np.int32).reshape(-1, 2)) for ids, offsets in pairs]


class TextEncoder:
    """Token ids and character offsets of rendered texts, each distinct line tokenized once.

    A log's requests repeat most of their text: the system prompt, the tools, and every earlier turn of their
    session. So each text is cut at its line starts (after a run of newlines, before a non-space character) and each
    distinct line is tokenized once, however many requests hold it. That is exact only where no token spans a line
    start: byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) split there before any merge. It is checked on probes
    when the encoder is built, and each batch's first text is also tokenized whole and compared; on any difference
    (e.g. a SentencePiece tokenizer that prefixes a word with "▁" at the start of a text) the encoder tokenizes
    whole texts from then on (``by_lines`` False)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.by_lines = backend is not None and _splits_at_line_starts(tokenizer)
        self._lines: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # line -> its token ids and offsets

    def encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        if not self.by_lines:
            return _encode_whole(self.tokenizer, texts)
        cuts = [_cut_at_line_starts(text) for text in texts]
        new = list(dict.fromkeys(line for _, lines in cuts for line in lines if line not in self._lines))
        self._lines.update(zip(new, _encode_whole(self.tokenizer, new)))
        joined = [self._joined(starts, lines) for starts, lines in cuts]
        if joined and not _same_encoding(joined[0], _encode_whole(self.tokenizer, texts[:1])[0]):
            self.by_lines = False
            return _encode_whole(self.tokenizer, texts)
        return joined

    def _joined(self, starts: list[int], lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._lines[line] for line in lines]
        shift = np.repeat(np.asarray(starts, dtype=np.int32), [len(ids) for ids, _ in parts])
        return np.concatenate([ids for ids, _ in parts]), np.concatenate([offsets for _, offsets in parts]) + shift[:, None]


_LINE_START = re.compile(r"\n(?=\S)")
# Probes of the line-start property: texts ending in newlines, then texts starting with each kind of character.
_PROBE_HEADS = ("word\n", "a.\n", "x \n", "1\n\n", "}\n", " \n\n", "<|im_end|>\n", "\t\n")
_PROBE_TAILS = ("Word", "word", '{"a": 1}', "<|im_start|>user", "12 3", "'s", "é", "-x", "# T", "中文", "_y")


def _cut_at_line_starts(text: str) -> tuple[list[int], list[str]]:
    """The text's lines (each ending with its newlines) and where each starts."""
    starts = [0, *(match.end() for match in _LINE_START.finditer(text))]
    return starts, [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def _same_encoding(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _splits_at_line_starts(tokenizer: Any) -> bool:
    """Whether every probe tokenizes as its two halves do, cut at the line start."""
    pairs = [(head, tail) for head in _PROBE_HEADS for tail in _PROBE_TAILS]
    whole = _encode_whole(tokenizer, [head + tail for head, tail in pairs])
    alone = dict(zip((*_PROBE_HEADS, *_PROBE_TAILS), _encode_whole(tokenizer, [*_PROBE_HEADS, *_PROBE_TAILS])))
    return all(ids.tolist() == [*alone[head][0].tolist(), *alone[tail][0].tolist()] for (head, tail), (ids, _) in zip(pairs, whole))


def _locate_contents(text: str, request: Request) -> tuple[tuple[int, int], ...]:
    spans, cursor = [], 0
    for number, message in enumerate(request.messages, 1):
        content = message.content.strip()
        start = text.find(content, cursor) if content else cursor
        if start < 0:
            raise RequestLogError(
                f"{request.where}, message {number}: the chat template rewrites this message's text, so its tokens cannot be placed"
            )
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return tuple(spans)


def _owners(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per token, the first message whose content span it overlaps (-1 for none); spans are in text order."""
    if not spans or not len(offsets):
        return np.full(len(offsets), -1, dtype=np.int32)
    starts, ends = np.array([a for a, _ in spans]), np.array([b for _, b in spans])
    index = np.searchsorted(ends, offsets[:, 0], side="right")  # the first span ending after the token starts
    clipped = np.minimum(index, len(spans) - 1)
    inside = (index < len(spans)) & (offsets[:, 1] > starts[clipped])
    return np.where(inside, clipped, -1).astype(np.int32)


def context_limit(lm: LoadedModel | LoadedTokenizer) -> int:
    """The longest prompt the model takes, in tokens (its config's ``max_positions``, else 32,768)."""
    return int(lm.info().get("max_positions") or 32_768)
