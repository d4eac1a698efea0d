"""One registry names every simulated cache: the engines fed each request are exactly its serving engines, in its
order; the hosted providers' are exactly its providers; and the gate, the Markdown and the figures label them from it."""

import numpy as np

from engine.audit.report.gate import QUANTITIES, markdown
from engine.audit.simulate.caches import CacheSettings, Engines
from engine.audit.simulate.hosted import HostedCaches, HostedRequest
from engine.audit.simulate.registry import CACHES, ENGINES, LABELS, PROVIDERS
from viz.audit import ENGINE_LABELS, PROVIDER_LABELS


def test_the_engines_fed_are_the_registry_s_in_its_order():
    reused = Engines(CacheSettings()).insert(np.arange(40), 0, "s", 0)
    assert list(reused) == list(ENGINES) == ["vllm", "sglang", "llama_cpp"]
    assert set(ENGINES) | set(PROVIDERS) == set(CACHES) and not set(ENGINES) & set(PROVIDERS)


def test_each_provider_fed_is_a_registered_one():
    caches, ids = HostedCaches(), np.arange(2048)
    read = {}
    for provider in PROVIDERS:
        read |= caches.insert(ids, HostedRequest(provider, 0, (2047,), (1024, 2047), 1024, 0.0))
    assert set(read) == set(PROVIDERS)


def test_the_gate_the_markdown_and_the_figures_label_from_the_registry():
    assert ENGINE_LABELS == {name: CACHES[name].label for name in ENGINES}
    assert PROVIDER_LABELS == {name: CACHES[name].label for name in PROVIDERS}
    assert all(LABELS[name] in QUANTITIES[f"reuse.{name}"] for name in ENGINES)
    engines = {"requests": 2, "tokens": 80, "hit_rate": dict.fromkeys(ENGINES, 0.5)}
    report = {"model": "m", "engines": engines, "skipped_count": 0, "turns": [], "requests": [], "sample": 0}
    text = markdown(report)
    assert all(f"{LABELS[name]} 50.0%" in text for name in ENGINES)
    assert "| request | session | matched | tokens | vLLM | SGLang | llama.cpp | causes | recommended |" in text
