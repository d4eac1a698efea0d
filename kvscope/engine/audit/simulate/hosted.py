"""Hosted APIs' prompt caching simulated as two more ``PrefixCache``s, for logs whose requests name an OpenAI or
Anthropic model (each fed only its own provider's requests, ``PrefixCache.serves``).

- ``openai``: automatic on every prompt; a prompt of at least 1,024 tokens reuses the longest prefix an earlier
  prompt shares with it, counted in 128-token steps above 1,024 (1,024 + k·128, rounded down).
- ``anthropic``: explicit ``cache_control`` breakpoints. Each breakpoint writes the prefix up to it (when it holds at
  least the model's minimum cacheable length); a later request reads at a breakpoint the longest written prefix that
  ends there or at one of the 20 block boundaries before it (the lookback), if it was used within the time-to-live (5
  minutes, refreshed by each hit or write, from the requests' timestamps; without timestamps nothing expires). A
  message is one block here (its content blocks were joined when it was read); a breakpoint on the tools counts at the
  first message after the system messages (the loaded model's template renders the tools in its system turn).

The tokens are the loaded model's, not the provider's: compare the providers' hit rates (shares), never their tokens.
OpenAI's idle expiry (5 to 10 minutes, up to an hour off-peak) is not simulated.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, CacheSettings, HostedRequest, PrefixCache
from kvscope.engine.audit.simulate.radix import RadixTree

TOKENS_NOTE = "the loaded model's tokens, not the provider's: compare hit rates (shares), not tokens"
OPENAI_MINIMUM = 1024
OPENAI_STEP = 128
ANTHROPIC_TTL_SECONDS = 300.0
ANTHROPIC_LOOKBACK = 20  # block boundaries checked before a breakpoint
# The minimum cacheable prompt per model (Anthropic's prompt-caching docs, 2026): the first pattern found wins.
ANTHROPIC_MINIMUM = (
    ("opus-4-6", 4096),
    ("opus-4-5", 4096),
    ("haiku-4-5", 4096),
    ("haiku", 2048),  # Claude Haiku 3 and 3.5
)
ANTHROPIC_DEFAULT_MINIMUM = 1024  # Sonnet and Opus
_OPENAI_MODEL = re.compile(r"^(?:openai/)?(?:gpt-|o1|o3|o4|chatgpt-)", re.IGNORECASE)
_ANTHROPIC_MODEL = re.compile(r"^(?:anthropic/)?claude-", re.IGNORECASE)


def provider_of(model: str | None) -> str | None:
    """The hosted API a model name belongs to (``openai`` for gpt-*, o1/o3/o4, chatgpt-*; ``anthropic`` for claude-*),
    None for any other name."""
    if not model:
        return None
    if _OPENAI_MODEL.match(model):
        return "openai"
    if _ANTHROPIC_MODEL.match(model):
        return "anthropic"
    return None


def anthropic_minimum(model: str) -> int:
    """The shortest prefix the Anthropic model caches, in tokens."""
    name = model.lower()
    return next((tokens for pattern, tokens in ANTHROPIC_MINIMUM if pattern in name), ANTHROPIC_DEFAULT_MINIMUM)


class OpenAICache(PrefixCache):
    """OpenAI's automatic caching: the longest prefix held (a token radix tree, never evicted), rounded down to
    1,024 + k·128 tokens; nothing below 1,024."""

    name = "openai"
    hosted = True

    def __init__(self):
        self.tree = RadixTree()

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> OpenAICache:
        return cls()

    def match(self, request: CacheRequest) -> int:
        """The longest prefix held, in steps."""
        return openai_steps(self.tree.match(request.ids, None)[0])

    def insert(self, request: CacheRequest) -> int:
        """The tokens the prompt reads from the cache (the prefix held before its last token, in steps); then it is held."""
        return openai_steps(self.tree.insert(request.ids, request.request, None, request.time))

    def hold(self, request: CacheRequest) -> None:
        """Nothing: OpenAI documents caching prompts only."""


def openai_steps(shared: int) -> int:
    """A shared prefix as OpenAI counts it cached: 0 under 1,024 tokens, else 1,024 + k·128 rounded down."""
    if shared < OPENAI_MINIMUM:
        return 0
    return OPENAI_MINIMUM + (shared - OPENAI_MINIMUM) // OPENAI_STEP * OPENAI_STEP


class AnthropicCache(PrefixCache):
    """Anthropic's ``cache_control`` caching: prefixes written at breakpoints, read at a breakpoint or up to
    ``lookback`` block boundaries before it, alive for ``ttl`` seconds since their last use. A request's breakpoints,
    block boundaries (token positions where blocks end), model minimum and timestamp come in ``request.hosted``."""

    name = "anthropic"
    hosted = True

    def __init__(self, ttl: float = ANTHROPIC_TTL_SECONDS, lookback: int = ANTHROPIC_LOOKBACK):
        self.ttl = ttl
        self.lookback = lookback
        self.entries: dict[tuple[int, bytes], float | None] = {}  # (length, prefix bytes) -> last use (None: no clock)

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> AnthropicCache:
        return cls()

    def match(self, request: CacheRequest) -> int:
        """The tokens the request would read: the longest live prefix found from any breakpoint."""
        return self._read(request)[0]

    def insert(self, request: CacheRequest) -> int:
        """The tokens the request reads (``match``; each prefix read is refreshed); then each breakpoint's prefix of at
        least the model's minimum is written (or refreshed)."""
        read, hits = self._read(request)
        hosted, data = request.hosted, np.ascontiguousarray(request.ids, dtype=np.int32)
        for key in hits:
            self.entries[key] = hosted.timestamp
        for mark in sorted({int(p) for p in hosted.breakpoints if 0 < p <= len(data)}):
            if mark >= hosted.minimum:
                self.entries[(mark, data[:mark].tobytes())] = hosted.timestamp
        return read

    def hold(self, request: CacheRequest) -> None:
        """Nothing: Anthropic caches at ``cache_control`` breakpoints alone."""

    def _read(self, request: CacheRequest) -> tuple[int, list[tuple[int, bytes]]]:
        """The tokens read, and the entries read on the way (one per breakpoint that found a longer prefix)."""
        hosted, data = request.hosted, np.ascontiguousarray(request.ids, dtype=np.int32)
        marks = sorted({int(p) for p in hosted.breakpoints if 0 < p <= len(data)})
        ends = sorted({*(int(b) for b in hosted.boundaries if 0 < b <= len(data)), *marks})
        read, hits = 0, []
        for mark in marks:
            at = ends.index(mark)
            for end in reversed(ends[max(at - self.lookback, 0) : at + 1]):
                if end <= read:
                    break
                key = (end, data[:end].tobytes())
                if end >= hosted.minimum and self._alive(key, hosted.timestamp):
                    hits.append(key)
                    read = end
                    break
        return read, hits

    def _alive(self, key: tuple[int, bytes], now: float | None) -> bool:
        if key not in self.entries:
            return False
        last = self.entries[key]
        return now is None or last is None or now - last <= self.ttl


def block_ends(rendered: RenderedRequest) -> list[int]:
    """The token after each message's content: the block boundaries the Anthropic lookback checks."""
    return [rendered.tokens_in(end - 1, end).stop for start, end in rendered.content_spans if end > start]


def tools_end(rendered: RenderedRequest) -> int:
    """Where a breakpoint on the tools counts: the first token of the first message's content after the system messages
    (the loaded model's template renders the tools in its system turn), or the end of the prompt."""
    messages = rendered.request.messages or ()
    for number, message in enumerate(messages):
        if message.role not in ("system", "developer"):
            start = rendered.content_spans[number][0]
            return rendered.tokens_in(start, start).start
    return len(rendered)


def hosted_request(rendered: RenderedRequest, breakpoints: Sequence[int | None]) -> HostedRequest | None:
    """``rendered`` as its provider's cache reads it (None: its model is not a hosted one); ``breakpoints``: its
    breakpoint tokens (None: after the tools)."""
    request = rendered.request
    provider = provider_of(request.model)
    if provider == "openai":
        return HostedRequest(provider, request.index)
    if provider == "anthropic":
        tokens = tuple(tools_end(rendered) if mark is None else mark for mark in breakpoints)
        minimum = anthropic_minimum(request.model)
        return HostedRequest(provider, request.index, tokens, tuple(block_ends(rendered)), minimum, request.timestamp)
    return None
