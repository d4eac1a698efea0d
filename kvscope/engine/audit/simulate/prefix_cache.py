"""The one interface every simulated prefix cache fills (SGLang's ``BasePrefixCache``, transformers'
``CacheLayerMixin``): a request goes in as a ``CacheRequest``, and a cache answers three calls.

- ``match(request)``: the longest prefix of the request's tokens the cache holds now, as the cache counts it (whole
  blocks for vLLM, 1,024 + k·128 steps for OpenAI, what a breakpoint reads for Anthropic). It changes nothing: no
  LRU touched, nothing held.
- ``insert(request)``: the request served: the tokens of its prompt reused (what ``match`` finds, cut to the tokens
  before the prompt's last, which every engine computes, in vLLM's whole blocks; a hosted provider's own rule), then
  the cache holds ``request.tokens`` (the prompt and the reply tokens the server computed).
- ``hold(request)``: the cache also holds ``request.tokens`` without serving it (a reply that the session's next turn
  resent); a cache that never holds a reply (a hosted provider's) keeps nothing.

A cache is built from the audit's settings (``CacheSettings``, ``from_settings``), a serving engine's under the budget
its class computes from them (``budget``: its flag, or its server's own formula on a server's size, ``budgets``), and named in the registry
(``registry.CACHES``: its name, label, description and class); ``serves`` says which requests it sees (a hosted
provider's only its own models', from what ``HostedRequest`` carries). A serving engine's class also holds its own
rules beside the simulation: ``wrote`` (the marks its server leaves in an answer, read to name a log's server),
``owned_by`` (its server's ``/v1/models`` owner, read to name an endpoint's), ``granule`` and ``excess_hint`` (how
its counts differ from a server's), and ``names_matches`` (the radix tree that names each request's match). A cache
that can read off its own state what it would have reused had no reply ever been cached says so
(``tells_prompts_only``, ``prompts_only``: unbounded vLLM and SGLang); for the others a twin fed prompts alone is
simulated beside (``step.Simulation``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.paged_blocks import BLOCK_TOKENS
from kvscope.engine.audit.report.records import Record
from kvscope.engine.audit.simulate.budgets import LLAMA_CACHE_RAM_MIB, Budget, ModelKV, ServerSize


@dataclass(frozen=True)
class CacheSettings(Record):
    """The simulated engines' settings (None: unbounded); ``server``: a server's size, which gives each engine the budget
    its server would have where its own flag gives none (``PrefixCache.budget``)."""

    block: int = BLOCK_TOKENS
    budget_blocks: int | None = None  # vLLM
    budget_tokens: int | None = None  # SGLang
    slots: int | None = None  # llama.cpp (None: one per session; with prompt_cache, the server's 4 with one KV cache)
    cache_reuse: int = 0  # llama.cpp --cache-reuse N (0: off, its default)
    # llama.cpp: True: clients pin no slot, the server's own choice by similarity and its RAM prompt cache (``ServerSlots``);
    # False: a slot per session; None: the server's default, as ``for_log`` reads the log (not yet read: a slot per session)
    prompt_cache: bool | None = None
    server: ServerSize | None = None
    cache_ram_mib: int = LLAMA_CACHE_RAM_MIB  # llama.cpp --cache-ram: its RAM prompt cache's size (0: none, -1: no limit)
    model: ModelKV | None = None  # the served model's KV shape (sizes the RAM prompt cache; a server's size has its own)

    def __post_init__(self) -> None:
        if self.cache_ram_mib < -1:
            raise RequestLogError(f"--llama-cache-ram is MiB (0: no RAM prompt cache, -1: no limit), got {self.cache_ram_mib}")

    @property
    def kv_model(self) -> ModelKV | None:
        """The model whose KV sizes byte budgets: ``model``, else the server size's."""
        return self.model if self.model is not None or self.server is None else self.server.model

    def for_log(self, pinned: bool) -> CacheSettings:
        """The settings with llama.cpp's mode decided for a log: where not named, the server's own slot choice
        (``prompt_cache``), unless the log pins slots (``pinned``: ``id_slot``) or ``cache_reuse`` is asked for (which
        the slot-per-session mode simulates)."""
        if self.prompt_cache is not None:
            return self
        return dataclasses.replace(self, prompt_cache=not pinned and self.cache_reuse == 0)


FIT_BUDGET_DIVISORS = (2, 4, 8, 16, 32)  # budgets a fit tries: the log's working set divided by these (and unbounded)


def fit_budgets(working: int) -> list[int | None]:
    """The KV budgets (tokens) ``--fit-observed`` tries: unbounded, then the log's working set (``working`` tokens: what
    an unbounded token cache holds after the log) halved, quartered, ... (``FIT_BUDGET_DIVISORS``)."""
    return [None, *dict.fromkeys(working // d for d in FIT_BUDGET_DIVISORS if working // d > 0)]


@dataclass(frozen=True)
class HostedRequest:
    """What a hosted provider's simulated cache reads of one request besides its token ids: its provider and index,
    and for Anthropic its breakpoint tokens, its block boundaries, the model's minimum and when it was sent."""

    provider: str
    index: int
    breakpoints: tuple[int, ...] = ()
    boundaries: tuple[int, ...] = ()
    minimum: int = 0
    timestamp: float | None = None


@dataclass(frozen=True)
class CacheRequest:
    """One request as a simulated cache takes it: its prompt's token ids, what the server holds after it (``held``:
    the prompt and the reply tokens computed; None: the prompt alone), who sent it and when (``time``: its place in
    the pass, from 1), ``hashes``: the chained block hashes of ``held`` where a worker computed them
    (``blocks.block_hashes``), and ``hosted``: what its hosted provider's cache reads (None: not a hosted model)."""

    ids: np.ndarray
    request: int
    session: str | None = None
    time: int = 0
    held: np.ndarray | None = None
    hashes: Sequence[int] | None = None
    hosted: HostedRequest | None = None

    @property
    def tokens(self) -> np.ndarray:
        """What the cache holds after serving the request: ``held``, else the prompt."""
        return self.ids if self.held is None else self.held


class PrefixCache(ABC):
    """A simulated prefix cache (the module docstring states the contract). ``name``: its key in the registry and the
    JSON; ``hosted``: a provider's API cache, fed only its provider's requests, rather than a serving engine's."""

    name: ClassVar[str]
    hosted: ClassVar[bool] = False
    # its server reports cached counts in whole blocks of its block size (so a log's counts tell the block: ``blocks.block_of_counts``)
    counts_in_blocks: ClassVar[bool] = False
    owned_by: ClassVar[str | None] = None  # what the server's ``/v1/models`` says owns its model (``endpoint.client``)
    names_matches: ClassVar[bool] = False  # the one cache whose tree names each request's match (``Caches.matched``)

    @classmethod
    def wrote(cls, marks: Collection[str]) -> str | None:
        """The evidence, in words, that this engine's server wrote an answer with these marks (``usage.answer_marks``:
        its keys, its choices' keys, its ``system_fingerprint``); None: nothing of this engine's own."""
        return None

    @classmethod
    def fit_grid(cls, working: int) -> list[dict[str, Any]]:
        """The settings of this engine's server that ``--fit-observed`` tries, in order (``working``: the log's working
        set in tokens, for budgets: ``fit_budgets``); empty: none of its own."""
        return []

    @classmethod
    def fitted(cls, setting: Mapping[str, Any]) -> PrefixCache:
        """The cache at one of ``fit_grid``'s settings."""
        raise NotImplementedError(f"{cls.name} has no settings to fit")

    @classmethod
    def budget(cls, settings: CacheSettings) -> Budget | None:
        """The budget this engine's cache runs with under ``settings`` and where it came from: its own flag, else its
        server's formula on ``settings.server``, else unbounded (``budgets``); None: a cache its provider sizes."""
        return None

    @classmethod
    def granule(cls, block: int) -> int:
        """The tokens this engine's reuse comes in (its whole blocks: ``block`` for a paged cache, else 1)."""
        return 1

    @classmethod
    def excess_hint(cls, observed: int, usable: int, block: int) -> str | None:
        """This engine's own reading of a server reusing more than its simulation (within the shared prefix): what
        the simulation of this engine cannot do that the server did (None: no rule of its own)."""
        return None

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: CacheSettings) -> PrefixCache:
        """The cache as the audit's settings configure it."""

    def serves(self, request: CacheRequest) -> bool:
        """Whether the request reaches this cache at all: a serving engine's sees every request, a hosted provider's
        only those that name one of its models."""
        return not self.hosted or (request.hosted is not None and request.hosted.provider == self.name)

    @abstractmethod
    def match(self, request: CacheRequest) -> int:
        """The tokens of ``request.ids`` held now, as this cache counts them; nothing changes."""

    @abstractmethod
    def insert(self, request: CacheRequest) -> int:
        """The tokens of ``request.ids`` reused serving it; the cache then holds ``request.tokens``."""

    @abstractmethod
    def hold(self, request: CacheRequest) -> None:
        """The cache also holds ``request.tokens``, serving nothing."""

    @property
    def tells_prompts_only(self) -> bool:
        """Whether ``prompts_only`` reads, off this cache's own state, what it would have reused had no reply ever been
        cached; else a twin fed the prompts alone simulates that (``step.Simulation``)."""
        return False

    def prompts_only(self, request: CacheRequest) -> int:
        """Before ``insert``: the tokens of ``request.ids`` it would reuse were no reply ever cached (only where
        ``tells_prompts_only``)."""
        raise NotImplementedError(f"{self.name} does not tell its prompts-only reuse: a twin simulates it")
