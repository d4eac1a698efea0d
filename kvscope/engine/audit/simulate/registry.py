"""Every simulated prefix cache by name: its short label, its one-line description and its class (a ``PrefixCache``);
the token pass, the report, the gate, the figures and the CLI read them here, and ``Caches`` builds and feeds them.
Serving engines are simulated for every log; a hosted provider's cache only for the requests that name one of its
models."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvscope.engine.audit.simulate.budgets import Budget
from kvscope.engine.audit.simulate.caches import BlockCache, CacheSettings, SlotCache
from kvscope.engine.audit.simulate.hosted import AnthropicCache, OpenAICache
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, PrefixCache
from kvscope.engine.audit.simulate.radix import RadixCache


@dataclass(frozen=True)
class SimulatedCache:
    """One simulated cache: its class (whose ``name`` is its name in the JSON), its label for people, and what it
    simulates."""

    cache: type[PrefixCache]
    label: str
    description: str

    @property
    def name(self) -> str:
        return self.cache.name

    @property
    def hosted(self) -> bool:
        """A provider's API cache (``hosted``), not a serving engine's (``caches``)."""
        return self.cache.hosted


CACHES = {
    entry.name: entry
    for entry in (
        SimulatedCache(BlockCache, "vLLM", "vLLM automatic prefix caching: whole blocks, LRU under a block budget"),
        SimulatedCache(RadixCache, "SGLang", "SGLang RadixAttention: a token radix tree, LRU leaves under a token budget"),
        SimulatedCache(SlotCache, "llama.cpp", "llama.cpp server: one slot per session, --cache-reuse chunk shifting"),
        SimulatedCache(
            OpenAICache,
            "OpenAI (simulated)",
            "OpenAI automatic prompt caching: prompts of at least 1,024 tokens, the cached prefix in 128-token steps",
        ),
        SimulatedCache(
            AnthropicCache,
            "Anthropic (simulated)",
            "Anthropic cache_control breakpoints: a minimum length per model, a 20-block lookback, a 5-minute time-to-live",
        ),
    )
}
ENGINES = {name: cache.description for name, cache in CACHES.items() if not cache.hosted}  # in the order rows list them
PROVIDERS = {name: cache.description for name, cache in CACHES.items() if cache.hosted}
LABELS = {name: cache.label for name, cache in CACHES.items()}
DEFAULT_ENGINE = "vllm"  # the serving engine assumed where neither the log nor the user names one
# the engine whose radix tree names each request's match, routes by prefix and counts a replica's load
MATCHING = next(name for name, cache in CACHES.items() if cache.cache.names_matches)


def engine_of_answer(marks: Collection[str]) -> tuple[str, str] | None:
    """The serving engine whose server wrote an answer with these marks (``usage.answer_marks``) and the evidence, in
    the registry's order (each engine reads its own marks: ``PrefixCache.wrote``); None: the answer names none."""
    for name in ENGINES:
        evidence = CACHES[name].cache.wrote(marks)
        if evidence:
            return name, evidence
    return None


def engine_of_owner(owned_by: str) -> str:
    """The serving engine whose server's ``/v1/models`` names ``owned_by`` as its model's owner (``PrefixCache.owned_by``),
    else ``DEFAULT_ENGINE``."""
    return next((name for name in ENGINES if CACHES[name].cache.owned_by == owned_by), DEFAULT_ENGINE)


def budgets(settings: CacheSettings) -> list[Budget]:
    """The budget each serving engine's cache runs with under ``settings`` and where it came from (each class's
    ``budget``: its flag, its server's formula on ``settings.server``, or unbounded), in the registry's order."""
    return [budget for name in ENGINES if (budget := CACHES[name].cache.budget(settings)) is not None]


class Caches:
    """The registry's serving engines (or, ``hosted``, its providers' caches), built from one set of settings and fed
    together, one request at a time: one serving replica's caches, or the providers'."""

    def __init__(self, settings: CacheSettings, hosted: bool = False, names: Collection[str] | None = None):
        built = ((name, entry) for name, entry in CACHES.items() if entry.hosted == hosted and (names is None or name in names))
        self.caches = {name: entry.cache.from_settings(settings) for name, entry in built}

    def __getitem__(self, name: str) -> PrefixCache:
        return self.caches[name]

    def matched(self, request: CacheRequest) -> int | None:
        """The earlier request ``request`` shares its longest prefix with, as the cache that names matches sees it
        (``PrefixCache.names_matches``: the radix tree's ``matched``)."""
        return self.caches[MATCHING].matched(request)

    def insert(self, request: CacheRequest) -> dict[str, int]:
        """The tokens each cache that serves the request reused, in the registry's order (then each holds it)."""
        return {name: cache.insert(request) for name, cache in self.caches.items() if cache.serves(request)}

    def hold(self, request: CacheRequest) -> None:
        """Each cache also holds ``request.tokens`` (a reply known once the next turn resent it)."""
        for cache in self.caches.values():
            cache.hold(request)
