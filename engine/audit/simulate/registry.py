"""Every simulated prefix cache by name, with its short label and its one-line description: the token pass, the
report, the gate, the figures and the CLI read them here. Serving engines are simulated for every log; a hosted
provider's cache only for the requests that name one of its models."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimulatedCache:
    """One simulated cache: its name in the JSON, its label for people, and what it simulates."""

    name: str
    label: str
    description: str
    hosted: bool = False  # a provider's API cache (``hosted``), not a serving engine's (``caches``)


CACHES = {
    cache.name: cache
    for cache in (
        SimulatedCache("vllm", "vLLM", "vLLM automatic prefix caching: whole blocks, LRU under a block budget"),
        SimulatedCache("sglang", "SGLang", "SGLang RadixAttention: a token radix tree, LRU leaves under a token budget"),
        SimulatedCache("llama_cpp", "llama.cpp", "llama.cpp server: one slot per session, --cache-reuse chunk shifting"),
        SimulatedCache(
            "openai",
            "OpenAI (simulated)",
            "OpenAI automatic prompt caching: prompts of at least 1,024 tokens, the cached prefix in 128-token steps",
            hosted=True,
        ),
        SimulatedCache(
            "anthropic",
            "Anthropic (simulated)",
            "Anthropic cache_control breakpoints: a minimum length per model, a 20-block lookback, a 5-minute time-to-live",
            hosted=True,
        ),
    )
}
ENGINES = {name: cache.description for name, cache in CACHES.items() if not cache.hosted}  # in the order rows list them
PROVIDERS = {name: cache.description for name, cache in CACHES.items() if cache.hosted}
LABELS = {name: cache.label for name, cache in CACHES.items()}
