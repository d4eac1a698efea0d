"""Requests as a server receives them: a request log (OpenAI chat or completions format) or one prompt, parsed
strictly, and rendered with the loaded model's own chat template into the tokens a server would cache.

Accepted: JSONL (one request a line) or a JSON array of requests; a request is ``{"messages": [{"role", "content"}]}``
(``content`` a string or a list of ``{"type": "text", "text": ...}`` parts) or ``{"prompt": "..."}``
(``/v1/completions``: no chat template). One prompt may be plain text (one user message) or messages JSON. Every
error names the line, the request, the message and the reason, and nothing is kept from a log that fails.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.cache.loaded import LoadedModel
from engine.errors import KVScopeError

ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestLogError(KVScopeError):
    """A request log or prompt that cannot be audited; the message says where and why."""


@dataclass(frozen=True)
class Message:
    """One chat message with text content."""

    role: str
    content: str


@dataclass(frozen=True)
class Request:
    """One request of a log: chat ``messages``, or a completions ``prompt`` (exactly one of them)."""

    index: int  # 1-based, in log order
    line: int  # 1-based line of the log it starts on
    messages: tuple[Message, ...] | None = None
    prompt: str | None = None

    @property
    def where(self) -> str:
        return f"line {self.line} (request {self.index})"

    def with_contents(self, contents: Sequence[str]) -> Request:
        """The same request with each message's (or the prompt's) text replaced."""
        if self.messages is None:
            return Request(self.index, self.line, prompt=contents[0])
        return Request(self.index, self.line, tuple(Message(m.role, text) for m, text in zip(self.messages, contents, strict=True)))

    @property
    def contents(self) -> tuple[str, ...]:
        return (self.prompt,) if self.messages is None else tuple(m.content for m in self.messages)


def parse_log(text: str) -> list[Request]:
    """Every request of a JSONL log or a JSON array of requests."""
    stripped = text.strip()
    if not stripped:
        raise RequestLogError("the log is empty: paste one JSON request per line, or a JSON array of requests")
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as error:
            raise RequestLogError(f"line {error.lineno} is not JSON: {error.msg} (column {error.colno})") from None
        starts = _array_item_lines(stripped, len(items))
        return [_request(item, index, line) for index, (item, line) in enumerate(zip(items, starts), 1)]
    requests = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise RequestLogError(f"line {line_number} is not JSON: {error.msg} (column {error.colno})") from None
        requests.append(_request(item, len(requests) + 1, line_number))
    return requests


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
        if isinstance(item, list):
            return _request({"messages": item}, 1, 1)
        if isinstance(item, dict):
            return _request(item, 1, 1)
    return Request(1, 1, (Message("user", text),))


def _array_item_lines(text: str, count: int) -> list[int]:
    """The line each top-level array item starts on (for messages that name a line)."""
    decoder, lines, position = json.JSONDecoder(), [], text.index("[") + 1
    for _ in range(count):
        while text[position] in " \t\r\n,":
            position += 1
        lines.append(text.count("\n", 0, position) + 1)
        _, position = decoder.raw_decode(text, position)
    return lines


def _request(item: Any, index: int, line: int) -> Request:
    where = f"line {line} (request {index})"
    if not isinstance(item, dict):
        raise RequestLogError(f"{where} is a JSON {type(item).__name__}, not a request object")
    if "messages" in item:
        messages = item["messages"]
        if not isinstance(messages, list) or not messages:
            raise RequestLogError(f"{where}: 'messages' must be a non-empty list")
        return Request(index, line, tuple(_message(message, where, number) for number, message in enumerate(messages, 1)))
    if isinstance(item.get("prompt"), str):
        return Request(index, line, prompt=item["prompt"])
    raise RequestLogError(f"{where} has no 'messages' (chat completions) and no 'prompt' string (completions)")


def _message(message: Any, where: str, number: int) -> Message:
    at = f"{where}, message {number}"
    if not isinstance(message, dict):
        raise RequestLogError(f"{at} is not an object")
    role = message.get("role")
    if role not in ROLES:
        raise RequestLogError(f"{at}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is None:
        return Message(role, "")
    if isinstance(content, str):
        return Message(role, content)
    if not isinstance(content, list):
        raise RequestLogError(f"{at}: content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for part_number, part in enumerate(content, 1):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestLogError(f"{at}, part {part_number}: a {kind!r} content part is not text; KVScope audits text only")
        texts.append(part["text"])
    return Message(role, "".join(texts))


@dataclass(frozen=True)
class RenderedRequest:
    """A request as tokens: the rendered text, its token ids, each token's character span, and which message's
    content each token belongs to (-1: the chat template's own tokens)."""

    request: Request
    text: str
    token_ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]
    owners: tuple[int, ...]
    content_spans: tuple[tuple[int, int], ...]  # each message's content, as characters of ``text``

    def __len__(self) -> int:
        return len(self.token_ids)

    def tokens_in(self, start: int, end: int) -> range:
        """Tokens overlapping characters [start, end) (the token holding ``start`` for an empty span)."""
        hits = [i for i, (a, b) in enumerate(self.offsets) if a < max(end, start + 1) and b > start]
        if not hits:
            raise RequestLogError(f"{self.request.where}: no token covers characters {start}..{end}")
        return range(hits[0], hits[-1] + 1)


def render_request(lm: LoadedModel, request: Request, max_tokens: int | None = None) -> RenderedRequest:
    """The request through the model's chat template (a completions prompt as it is), tokenized as a server would."""
    tokenizer = lm.tokenizer
    if request.messages is None:
        text, spans = request.prompt, ((0, len(request.prompt)),)
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise RequestLogError(
                f"{request.where}: {lm.name} has no chat template, so chat requests cannot be rendered; "
                'use completions requests ({"prompt": ...})'
            )
        text = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages], tokenize=False, add_generation_prompt=True
        )
        spans = _locate_contents(text, request)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = tuple((int(a), int(b)) for a, b in encoded["offset_mapping"])
    owners = tuple(_owner(a, b, spans) for a, b in offsets)
    limit = max_tokens or _context_limit(lm)
    if len(encoded["input_ids"]) > limit:
        raise RequestLogError(f"{request.where} is {len(encoded['input_ids']):,} tokens, longer than the context limit of {limit:,}")
    return RenderedRequest(request, text, tuple(encoded["input_ids"]), offsets, owners, spans)


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


def _owner(start: int, end: int, spans: Sequence[tuple[int, int]]) -> int:
    for index, (a, b) in enumerate(spans):
        if start < b and end > a:
            return index
    return -1


def _context_limit(lm: LoadedModel) -> int:
    return int(lm.info().get("max_positions") or 32_768)
