"""One registry names every simulated cache: each entry is a ``PrefixCache`` class with its name, label and
description; the caches fed each request are exactly its serving engines, in its order; the hosted providers' are
exactly its providers; and the gate, the Markdown and the figures label them from it."""

import numpy as np

from kvscope.engine.audit.ci.gate import QUANTITIES, markdown
from kvscope.engine.audit.simulate.caches import CacheSettings, ServerSlots, SlotCache
from kvscope.engine.audit.simulate.hosted import HostedRequest
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, PrefixCache
from kvscope.engine.audit.simulate.registry import CACHES, ENGINES, LABELS, MATCHING, PROVIDERS, Caches, budgets
from kvscope.engine.audit.simulate.step import Simulation
from kvscope.viz.audit import ENGINE_LABELS, PROVIDER_LABELS


def _subclasses(cls):
    return {sub for direct in cls.__subclasses__() for sub in {direct, *_subclasses(direct)}}


def test_the_registry_holds_every_cache_once_by_its_class_s_name():
    assert list(CACHES) == ["vllm", "sglang", "llama_cpp", "openai", "anthropic"]
    assert all(name == entry.name == entry.cache.name and entry.label and entry.description for name, entry in CACHES.items())
    assert len({entry.cache for entry in CACHES.values()}) == len(CACHES)
    # every simulated cache is registered, or is the llama.cpp entry's other mode (``--prompt-cache``)
    found = {cls for cls in _subclasses(PrefixCache) if cls.__module__.startswith("kvscope.engine.")}
    assert found == {entry.cache for entry in CACHES.values()} | {ServerSlots}
    assert type(SlotCache.from_settings(CacheSettings(prompt_cache=True))) is ServerSlots
    assert set(ENGINES) | set(PROVIDERS) == set(CACHES) and not set(ENGINES) & set(PROVIDERS)
    assert list(PROVIDERS) == ["openai", "anthropic"] and MATCHING in ENGINES


def test_the_engines_fed_are_the_registry_s_in_its_order():
    reused = Caches(CacheSettings()).insert(CacheRequest(np.arange(40), 0, "s", 1))
    assert reused == {"vllm": 0, "sglang": 0, "llama_cpp": 0}
    assert list(Simulation(CacheSettings()).engines.caches) == list(ENGINES)
    assert list(Caches(CacheSettings(), hosted=True).caches) == list(PROVIDERS)


def test_each_provider_fed_is_a_registered_one_and_only_its_own_requests():
    caches, ids = Caches(CacheSettings(), hosted=True), np.arange(2048)
    read = {}
    for provider in PROVIDERS:
        hosted = HostedRequest(provider, 0, (2047,), (1024, 2047), 1024, 0.0)
        read |= caches.insert(CacheRequest(ids, 0, hosted=hosted))
    assert read == dict.fromkeys(PROVIDERS, 0)
    assert caches.insert(CacheRequest(ids, 1)) == {}  # not a hosted model: no provider's cache sees it


def test_the_gate_the_markdown_and_the_figures_label_from_the_registry():
    assert ENGINE_LABELS == {name: CACHES[name].label for name in ENGINES}
    assert PROVIDER_LABELS == {name: CACHES[name].label for name in PROVIDERS}
    assert all(LABELS[name] in QUANTITIES[f"reuse.{name}"] for name in ENGINES)
    unbounded = [budget.as_dict() for budget in budgets(CacheSettings())]
    engines = {"requests": 2, "tokens": 80, "hit_rate": dict.fromkeys(ENGINES, 0.5), "budgets": unbounded}
    report = {"model": "m", "engines": engines, "skipped_count": 0, "turns": [], "requests": [], "sample": 0}
    text = markdown(report)
    assert all(f"{LABELS[name]} 50.0%" in text for name in ENGINES)
    assert all(f"- {LABELS[name]}: unbounded" in text for name in ENGINES)  # each engine's budget, from the registry's label
    assert "| request | session | matched | tokens | vLLM | SGLang | llama.cpp | causes | recommended |" in text
