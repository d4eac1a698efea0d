"""Requests rendered with the loaded model's own chat template (tools, tool calls and tool results included) into
the tokens a server would cache, with each token's character span and message (``RenderedRequest``). A log's texts
are tokenized line by line, each distinct line once, where that gives the same tokens as the whole text
(``TextEncoder``); the reply a server kept is tokenized as the template closes it."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.engine.audit.logs.reading import read_message
from kvscope.engine.audit.logs.replies import computed_tokens
from kvscope.engine.audit.logs.requests import Request, RequestLogError

if TYPE_CHECKING:  # the model is only read here; the token pass's workers need no torch
    from kvscope.engine.cache.loaded import LoadedModel, LoadedTokenizer

RENDER_BATCH = 256  # texts tokenized together (their new lines in one call of the fast tokenizer)


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
    return [item for _, item in Renderer(tokenizer, limit, model).stream(requests)]


class Renderer:
    """Requests rendered with one tokenizer into at most ``limit`` tokens each, its encoder's line cache
    (``TextEncoder``) kept from one call to the next: a log rendered as a stream (``stream``), and any request of it
    again later (``RenderedLog``)."""

    def __init__(self, tokenizer: Any, limit: int, model: str = "this model"):
        self.tokenizer, self.limit, self.model = tokenizer, limit, model
        self.encoder = TextEncoder(tokenizer)
        self._ends: frozenset[int] | None = None  # end-of-turn ids, read once a logged reply needs them

    def stream(self, requests: Iterable[Request]) -> Iterator[tuple[Request, RenderedRequest | RequestLogError]]:
        """Each request with its rendering (or its error), in order; the texts tokenized ``RENDER_BATCH`` at a time, so
        that only one batch's texts and offsets are alive at once."""
        pending: list[tuple[Request, tuple[str, tuple[tuple[int, int], ...]] | RequestLogError]] = []
        texts = 0
        for request in requests:
            try:
                text = _template_text(self.tokenizer, request, self.model)
                spans = ((0, len(text)),) if request.messages is None else _locate_contents(text, request)
                pending.append((request, (text, spans)))
                texts += 1
            except RequestLogError as error:
                pending.append((request, error))
            if texts == RENDER_BATCH:
                yield from self._tokenized(pending)
                pending, texts = [], 0
        yield from self._tokenized(pending)

    def _tokenized(self, pending: list) -> Iterator[tuple[Request, RenderedRequest | RequestLogError]]:
        """One batch: its texts tokenized together, each error in its place."""
        good = [(request, item) for request, item in pending if not isinstance(item, RequestLogError)]
        encoded = iter(self.encoder.encode([text for _, (text, _) in good]))
        for request, item in pending:
            yield request, item if isinstance(item, RequestLogError) else self._rendered(request, *item, *next(encoded))

    def _rendered(
        self, request: Request, text: str, spans: tuple[tuple[int, int], ...], ids: np.ndarray, offsets: np.ndarray
    ) -> RenderedRequest | RequestLogError:
        if len(ids) > self.limit:
            return RequestLogError(f"{request.where} is {len(ids):,} tokens, longer than the context limit of {self.limit:,}")
        reply = np.zeros(0, dtype=np.int32)
        if request.reply is not None:
            if self._ends is None:
                self._ends = end_of_turn_ids(self.tokenizer)
            reply = _reply_tokens(self.tokenizer, request, text, self._ends)
        return RenderedRequest(request, text, ids, offsets, _owners(offsets, spans), spans, reply)


RECENT_RENDERED = 1_024  # rendered requests a ``RenderedLog`` keeps: a request's match is most often among the latest


class RenderedLog(Mapping[int, RenderedRequest]):
    """A log's rendered requests by index, without holding them all: each request rendered is kept while among the
    latest ``RECENT_RENDERED`` (LRU), and one read after that is rendered again (the same tokens: rendering is
    deterministic and the same in any batch). Memory: the recent requests' texts, tokens and offsets, and one
    reference per request to the log's own ``Request``."""

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        self.recent = RECENT_RENDERED
        self._requests: dict[int, Request] = {}  # every request rendered, by index
        self._kept: OrderedDict[int, RenderedRequest] = OrderedDict()  # the latest rendered, least recently used first

    def keep(self, rendered: RenderedRequest) -> None:
        """Record ``rendered`` as its request's rendering (kept while recent)."""
        self._requests[rendered.request.index] = rendered.request
        self._remember(rendered)

    def __getitem__(self, index: int) -> RenderedRequest:
        if index in self._kept:
            self._kept.move_to_end(index)
            return self._kept[index]
        request = self._requests[index]  # KeyError: not a request of this log that rendered
        _, rendered = next(self.renderer.stream([request]))
        self._remember(rendered)
        return rendered

    def __iter__(self) -> Iterator[int]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, index: object) -> bool:
        return index in self._requests

    def _remember(self, rendered: RenderedRequest) -> None:
        self._kept[rendered.request.index] = rendered
        self._kept.move_to_end(rendered.request.index)
        while len(self._kept) > self.recent:
            self._kept.popitem(last=False)


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
            [*template_messages(request), read_message(reply.as_message(), 0).template_dict()],
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


LINE_CACHE_TOKENS = 1_000_000  # tokens of the lines a ``TextEncoder`` keeps per generation (two generations)


class TextEncoder:
    """Token ids and character offsets of rendered texts, each distinct line tokenized once.

    A log's requests repeat most of their text: the system prompt, the tools, and every earlier turn of their
    session. So each text is cut at its line starts (after a run of newlines, before a non-space character) and each
    distinct line is tokenized once, however many requests hold it. That is exact only where no token spans a line
    start: byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) split there before any merge. It is checked on probes
    when the encoder is built, and each batch's first text is also tokenized whole and compared; on any difference
    (e.g. a SentencePiece tokenizer that prefixes a word with "▁" at the start of a text) the encoder tokenizes
    whole texts from then on (``by_lines`` False).

    The lines are kept in two generations, bounded by their tokens: a line read from the older one moves to the
    current one, and once the current one holds ``LINE_CACHE_TOKENS`` it becomes the older one (the line cache holds
    the log's recent lines, not every line it ever read)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.by_lines = backend is not None and _splits_at_line_starts(tokenizer)
        self._lines: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # line -> its token ids and offsets (current generation)
        self._older: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._tokens = 0  # tokens of the current generation's lines

    def encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        if not self.by_lines:
            return _encode_whole(self.tokenizer, texts)
        cuts = [_cut_at_line_starts(text) for text in texts]
        needed = dict.fromkeys(line for _, lines in cuts for line in lines if line not in self._lines)
        moved = {line: self._older[line] for line in needed if line in self._older}
        new = [line for line in needed if line not in moved]
        moved.update(zip(new, _encode_whole(self.tokenizer, new)))
        self._lines.update(moved)
        self._tokens += sum(len(ids) for ids, _ in moved.values())
        joined = [self._joined(starts, lines) for starts, lines in cuts]
        if self._tokens >= LINE_CACHE_TOKENS:
            self._older, self._lines, self._tokens = self._lines, {}, 0
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


DEFAULT_CONTEXT_LIMIT = 32_768  # tokens a prompt is cut at where the model's config names no limit


def context_limit(lm: LoadedModel | LoadedTokenizer) -> int:
    """The longest prompt the model takes, in tokens (its config's ``max_positions``, else ``DEFAULT_CONTEXT_LIMIT``)."""
    return int(lm.info().get("max_positions") or DEFAULT_CONTEXT_LIMIT)
