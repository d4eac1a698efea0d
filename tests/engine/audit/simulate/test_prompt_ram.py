"""llama-server's RAM prompt cache (``PromptRam``) against the server's rules read as written: a list of saved prompts
scanned whole on every call (``server_prompt_cache::alloc`` / ``load`` / ``update``), on random workloads of
sessions that share heads, grow, branch and repeat, with and without a limit; and its limit from ``--cache-ram``."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.engine.audit.changes.fields import common_prefix
from kvscope.engine.audit.simulate.budgets import ModelKV, prompt_ram_tokens
from kvscope.engine.audit.simulate.caches import ServerSlots, SlotCache
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest, CacheSettings
from kvscope.engine.audit.simulate.prompt_ram import PromptRam


class ListRam:
    """The rules as the server's source states them: every entry scanned on every call."""

    def __init__(self, limit: int | None):
        self.limit, self.saved = limit, []

    def save(self, tokens: np.ndarray) -> None:
        if not len(tokens) or any(common_prefix(entry, tokens) == len(tokens) for entry in self.saved):
            return
        if self.limit is not None and len(tokens) > self.limit:
            return
        self.saved = [entry for entry in self.saved if common_prefix(entry, tokens) < len(entry)]
        while self.saved and self.limit is not None and sum(map(len, self.saved)) + len(tokens) > self.limit:
            self.saved.pop(0)
        self.saved.append(tokens)

    def best(self, current: np.ndarray, ids: np.ndarray) -> int | None:
        shared = common_prefix(current, ids)
        keep, share = (shared / len(current) if len(current) else -1.0), shared / len(ids)
        chosen = None
        for number, entry in enumerate(self.saved):
            shared = common_prefix(entry, ids)
            if shared / len(entry) < 0.25:
                continue
            if keep < shared / len(entry) and share < shared / len(ids):
                keep, share, chosen = shared / len(entry), shared / len(ids), number
        return chosen


def _workload(rng: np.random.Generator, requests: int) -> list[np.ndarray]:
    """Prompts of sessions that share a system head, grow turn by turn, sometimes branch back or repeat."""
    heads = [rng.integers(0, 50, size=rng.integers(3, 12)) for _ in range(3)]
    sessions: list[np.ndarray] = []
    prompts = []
    for _ in range(requests):
        number = int(rng.integers(0, len(sessions) + 2))
        if number >= len(sessions):
            sessions.append(np.concatenate([heads[rng.integers(0, 3)], rng.integers(0, 50, size=rng.integers(1, 20))]))
            number = len(sessions) - 1
        else:
            grown = sessions[number]
            cut = rng.integers(1, len(grown) + 1) if rng.random() < 0.2 else len(grown)  # a branch back, or the whole turn
            sessions[number] = np.concatenate([grown[:cut], rng.integers(0, 50, size=rng.integers(0, 25))])
        prompts.append(sessions[number].astype(np.int32))
    return prompts


@pytest.mark.parametrize("limit", [None, 0, 40, 150, 600])
@pytest.mark.parametrize("seed", range(6))
def test_the_trie_makes_the_servers_choices(limit, seed):
    rng = np.random.default_rng(seed)
    trie, listed = PromptRam(limit), ListRam(limit)
    current = np.zeros(0, dtype=np.int32)
    for ids in _workload(rng, 300):
        ids = ids if len(ids) else np.array([1], dtype=np.int32)
        chosen, expected = trie.best(current, ids), listed.best(current, ids)
        assert (chosen is None) == (expected is None)
        if chosen is not None:
            assert np.array_equal(trie.entry_tokens(chosen), listed.saved[expected])
        if rng.random() < 0.5 and chosen is not None:  # a restore: the entry leaves
            current = trie.restore(chosen)
            listed.saved.pop(expected)
        trie.save(current)
        listed.save(current)
        current = ids
        assert [entry.tolist() for entry in trie.entries()] == [entry.tolist() for entry in listed.saved]
        assert trie.tokens == sum(map(len, listed.saved)) <= (limit if limit is not None else trie.tokens)


@pytest.mark.parametrize("limit", [None, 60, 200])
def test_a_look_ahead_names_what_a_save_would_evict(limit):
    rng = np.random.default_rng(7)
    trie = PromptRam(limit)
    for tokens in _workload(rng, 300):
        before = dict(zip(trie.leaves, (tuple(entry.tolist()) for entry in trie.entries())))
        named = trie.would_evict(tokens)
        trie.save(tokens)
        after = {tuple(entry.tolist()) for entry in trie.entries()}
        inside = {n for n, entry in before.items() if common_prefix(np.array(entry), tokens) == len(entry)}
        assert {n for n, entry in before.items() if entry not in after} - inside == named


def test_server_slots_with_a_limit_keep_the_newest_prompts():
    system = np.arange(100, 110, dtype=np.int32)
    slots = ServerSlots(ram_tokens=120)
    for n in range(6):  # six sessions, each 50 tokens: the RAM cache holds two of them
        slots.insert(CacheRequest(np.concatenate([system, np.arange(1000 * n, 1000 * n + 40)]).astype(np.int32), n + 1))
    assert [int(entry[-1]) for entry in slots.ram.entries()] == [3039, 4039]
    assert slots.held_tokens == 50 + 100
    first_again = np.concatenate([system, np.arange(0, 45)]).astype(np.int32)
    assert slots.insert(CacheRequest(first_again, 7)) == 10  # evicted: only the system head is found


def test_the_ram_limit_is_cache_ram_over_the_f16_kv_of_a_token():
    model = ModelKV("qwen2.5-0.5b", layers=24, kv_heads=2, head_dim=64, parameters=494_032_768, dtype="bfloat16")
    tokens, words = prompt_ram_tokens(8192, model)
    assert tokens == 8192 * 2**20 // (2 * 24 * 2 * 64 * 2) == 699_050
    assert "8,192 MiB" in words and "12,288 B" in words
    assert prompt_ram_tokens(-1, model)[0] is None and prompt_ram_tokens(0, model)[0] == 0
    assert prompt_ram_tokens(8192, None)[0] is None
    budget = SlotCache.budget(CacheSettings(prompt_cache=True, model=model))
    assert budget.ram_tokens == 699_050 and "RAM prompt cache 699,050 tokens" in budget.source
    assert SlotCache.budget(CacheSettings(prompt_cache=False, model=model)).ram_tokens is None
    assert ServerSlots.from_settings(CacheSettings(prompt_cache=True, model=model, cache_ram_mib=1)).ram.limit == 2**20 // 12_288


def test_a_negative_cache_ram_other_than_minus_one_is_refused():
    with pytest.raises(Exception, match="--llama-cache-ram"):
        CacheSettings(cache_ram_mib=-2)


def test_without_a_ram_cache_idle_slots_keep_their_tokens():
    # --cache-ram 0: no prompt cache, so --cache-idle-slots is off and the unified slots are not cleared
    a, b = np.arange(10, 60, dtype=np.int32), np.arange(500, 550, dtype=np.int32)
    for ram_tokens, reused in ((0, 49), (None, 49), (10, 0)):
        slots = ServerSlots(ram_tokens=ram_tokens)
        slots.insert(CacheRequest(a, 1))
        slots.insert(CacheRequest(b, 2))  # a's slot is kept (RAM off), or saved to the RAM cache and cleared
        assert slots.insert(CacheRequest(a, 3)) == reused  # a 10-token RAM cache cannot hold a's 50 tokens
