"""Every registered cache fills the one ``PrefixCache`` contract, counted by hand.

Serving engines (block 4): A = 1..20 (20 tokens), B = A's first 12 then 8 others, C = 20 tokens shared with nothing;
one session. Hosted providers: the same shapes at OpenAI's and Anthropic's scale (A 1,300 tokens, B shares 1,200;
Anthropic's breakpoint at 1,200, its minimum 1,024)."""

import random

import numpy as np
import pytest

from kvscope.engine.audit.changes.fields import common_prefix
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.hosted import HostedRequest
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, PrefixCache
from kvscope.engine.audit.simulate.radix import longest_shared
from kvscope.engine.audit.simulate.registry import CACHES, ENGINES

SETTINGS = CacheSettings(block=4)
MODES = {**{name: SETTINGS for name in CACHES}, "llama_cpp --prompt-cache": CacheSettings(block=4, prompt_cache=True)}


def _ids(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(part, dtype=np.int32) for part in parts])


def _requests(mode: str) -> tuple[CacheRequest, CacheRequest, CacheRequest]:
    """A, B (a shared prefix with A) and C (disjoint), as the cache's requests."""
    if mode in ("openai", "anthropic"):
        a, b, c = np.arange(1300), _ids(np.arange(1200), np.arange(5000, 5100)), np.arange(9000, 10300)
        hosted = {n: HostedRequest(mode, n, (1200,), (600, 1200), 1024, float(n)) for n in (1, 2, 3)}
        return tuple(CacheRequest(ids, n, time=n, hosted=hosted[n]) for n, ids in ((1, a), (2, b), (3, c)))
    a, b, c = np.arange(1, 21), _ids(np.arange(1, 13), np.arange(100, 108)), np.arange(200, 220)
    return tuple(CacheRequest(ids, n, "s", n) for n, ids in ((1, a), (2, b), (3, c)))


# per cache: (match A, match B, match C) once A is held; then what inserting B reuses
EXPECTED = {
    "vllm": ((20, 12, 0), 12),  # whole blocks of 4
    "sglang": ((20, 12, 0), 12),
    "llama_cpp": ((20, 12, 0), 12),
    "llama_cpp --prompt-cache": ((20, 12, 0), 12),
    "openai": ((1280, 1152, 0), 1152),  # 1,024 + k·128 steps
    "anthropic": ((1200, 1200, 0), 1200),  # what the breakpoint at 1,200 reads
}


def _cache(mode: str) -> PrefixCache:
    return CACHES[mode.split()[0]].cache.from_settings(MODES[mode])


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_insert_then_match_finds_the_shared_prefix_and_match_changes_nothing(mode):
    cache, (a, b, c) = _cache(mode), _requests(mode)
    matches, reused = EXPECTED[mode]
    assert isinstance(cache, PrefixCache) and cache.serves(a)
    assert [cache.match(r) for r in (a, b, c)] == [0, 0, 0]  # cold
    assert cache.insert(a) == 0
    assert tuple(cache.match(r) for r in (a, b, c)) == matches
    assert tuple(cache.match(r) for r in (a, b, c)) == matches  # matching held nothing, touched nothing
    assert cache.insert(b) == reused == min(matches[1], len(b.ids) - 1)


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_engine_reuses_all_but_the_last_token_of_a_prompt_it_holds(name):
    cache, (a, _, _) = _cache(name), _requests(name)
    cache.insert(a)
    again = CacheRequest(a.ids, 4, "s", 4)
    assert cache.match(again) == 20 and cache.insert(again) == {"vllm": 16, "sglang": 19, "llama_cpp": 19}[name]


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_engine_holds_a_reply_the_next_turn_resent(name):
    cache, (a, _, _) = _cache(name), _requests(name)
    cache.insert(a)
    held = _ids(a.ids, [300, 301, 302, 303, 304])  # A and its 5-token reply: 25 tokens
    cache.hold(CacheRequest(held, 1, "s", 2))
    follow_up = CacheRequest(_ids(held, [400, 401, 402]), 2, "s", 3)
    assert cache.match(follow_up) == {"vllm": 24, "sglang": 25, "llama_cpp": 25}[name]


@pytest.mark.parametrize("name", ["openai", "anthropic"])
def test_a_provider_serves_only_its_own_models_and_holds_no_reply(name):
    cache, (a, _, _) = _cache(name), _requests(name)
    other = "anthropic" if name == "openai" else "openai"
    assert not cache.serves(CacheRequest(a.ids, 1)) and not cache.serves(CacheRequest(a.ids, 1, hosted=HostedRequest(other, 1)))
    cache.hold(a)
    assert cache.match(a) == 0


def test_longest_shared_is_the_first_key_with_the_longest_prefix_up_to_most():
    keys = [(1, 2, 3, 4), (1, 2, 9), (1, 2, 3, 4, 5, 6), (7,), (1, 2, 3, 4, 5, 8)]
    assert longest_shared(keys, (1, 2, 3, 4, 5, 6, 7), 100) == (2, 6)
    assert longest_shared(keys, (1, 2, 3, 4, 5, 6, 7), 5) == (2, 5)  # 2 and 4 share 5: the first
    assert longest_shared(keys, (1, 2, 3, 4, 5, 6, 7), 4) == (0, 4)  # 0, 2 and 4 share 4
    assert longest_shared(keys, (1, 2, 8), 100) == (0, 2) and longest_shared(keys, (1, 2, 8), 0) == (None, 0)
    assert longest_shared(keys, (5, 5), 100) == (None, 0) and longest_shared([], (1,), 1) == (None, 0)


def test_longest_shared_chooses_as_a_scan_of_every_key_does():
    rng = random.Random(55)
    for _ in range(200):
        keys = list(dict.fromkeys(tuple(rng.choices(range(4), k=rng.randrange(1, 9))) for _ in range(rng.randrange(0, 8))))
        ids, most = tuple(rng.choices(range(4), k=rng.randrange(1, 9))), rng.randrange(0, 10)
        best, shared = None, 0
        for number, key in enumerate(keys):  # the model pass's store before it read the tree
            if (count := min(common_prefix(key, ids), most)) > shared:
                best, shared = number, count
        assert longest_shared(keys, ids, most) == (best, shared), (keys, ids, most)
