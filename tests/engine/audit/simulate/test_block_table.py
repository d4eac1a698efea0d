"""vLLM's simulated blocks (``caches.BlockTable``) against the ordered dict they stand for: block hash -> (request that
last used it, its number there), least recently used first. Random workloads that re-touch, evict and grow the table
through its rebuilds must give the same holdings, the same evictions in the same order, and the same lookups. And the
prompts-only reuse that unbounded vLLM and SGLang read off their own caches, against twin caches fed the prompts alone."""

import dataclasses
from collections import OrderedDict

import numpy as np
import pytest

from kvscope.engine.audit.paged_blocks import block_hashes
from kvscope.engine.audit.simulate.caches import BlockCache, BlockTable, CacheSettings
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.radix import RadixCache
from kvscope.engine.audit.simulate.step import Simulation, Step


def _touch(model: OrderedDict, keys: np.ndarray, request: int) -> None:
    """``BlockTable.touch`` on the ordered dict: each distinct key with its first number, the first key touched last."""
    first: dict[int, int] = {}
    for number, key in enumerate(keys.tolist()):
        first.setdefault(key, number)
    for key, number in reversed(first.items()):
        model[key] = (request, number)
        model.move_to_end(key)


def _evict(model: OrderedDict, count: int) -> list[tuple[int, int]]:
    return [model.popitem(last=False)[1] for _ in range(min(count, len(model)))]


def _leading(model: OrderedDict, keys: np.ndarray) -> int:
    held = [key in model for key in keys.tolist()]
    return held.index(False) if False in held else len(held)


@pytest.mark.parametrize("seed", range(4))
def test_the_block_table_holds_evicts_and_finds_what_an_ordered_dict_would(seed):
    rng = np.random.default_rng(seed)
    universe = rng.integers(-(2**63), 2**63 - 1, size=6_000, dtype=np.int64)  # negative keys too: any 64-bit hash
    table, model = BlockTable(), OrderedDict()
    budget = int(rng.integers(500, 3_000))
    for request in range(400):
        keys = universe[rng.integers(0, len(universe), size=int(rng.integers(1, 60)))]
        if rng.random() < 0.3:  # a prefix of an earlier request's chain, then new blocks: re-touches within one call
            keys = np.concatenate([keys, keys[: len(keys) // 2]])
        query = universe[rng.integers(0, len(universe), size=20)]
        assert table.leading(keys) == _leading(model, keys)
        assert table.leading(query) == _leading(model, query)
        table.touch(keys, request)
        _touch(model, keys, request)
        if len(table) > budget and request % 3:
            count = len(table) - budget
            assert table.evict(count) == _evict(model, count)
        assert len(table) == len(model)
    assert table.evict(len(model)) == _evict(model, len(model))  # every block left, in LRU order
    assert len(table) == 0


def _sessions(seed: int, turns: int = 120) -> list[Step]:
    """Interleaved sessions over one system prompt: each turn resends its session's last prompt and reply and adds a
    user message; a third of the replies logged, the others known only when the next turn resends them."""
    rng = np.random.default_rng(seed)
    system, end = rng.integers(100, 200, size=37).astype(np.int32), 7
    last: dict[str, np.ndarray] = {}
    steps = []
    for request in range(1, turns + 1):
        session = f"s{rng.integers(0, 6)}"
        reply = np.append(rng.integers(100, 200, size=int(rng.integers(3, 30))), end).astype(np.int32)
        ids = np.concatenate([last.get(session, system), rng.integers(100, 200, size=int(rng.integers(1, 25))).astype(np.int32)])
        logged = bool(rng.random() < 1 / 3)
        steps.append(Step(ids, reply[:-1] if logged else np.zeros(0, dtype=np.int32), request, session, logged))
        last[session] = np.concatenate([ids, reply])
    return steps


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hashed", [False, True])  # the distributed pass's workers hash the blocks; one process hashes here
def test_unbounded_engines_read_their_prompts_only_reuse_off_their_own_caches(seed, hashed):
    """Ground truth: a twin cache fed the prompts alone (what every engine's prompts-only reuse was). Unbounded, vLLM's
    blocks, each marked when a prompt held it, and SGLang's tree, each edge's tokens a prompt went through, give the
    same reuse request by request, replies cached beside (logged, and resent by the next turn)."""
    simulation = Simulation(CacheSettings(block=4), end_ids=(7,))
    twins = {"vllm": BlockCache(4), "sglang": RadixCache()}
    assert all(simulation.engines[name].tells_prompts_only and name not in simulation.prompts_only.caches for name in twins)
    differ = dict.fromkeys(twins, 0)
    for step in _sessions(seed):
        if hashed:
            step = dataclasses.replace(step, hashes=block_hashes(step.held, 4))
        result = simulation.step(step)
        for name, twin in twins.items():
            assert result.prompts_only[name] == twin.insert(CacheRequest(step.ids, step.request, step.session, step.request))
            differ[name] += result.prompts_only[name] != result.reused[name]
    assert min(differ.values()) > 10  # the replies cached make a difference the marks must see


def test_under_a_budget_a_twin_simulates_the_prompts_only_reuse():
    """Evicting in their own LRU order, caches fed prompts only hold other tokens than caches holding replies too."""
    simulation = Simulation(CacheSettings(block=4, budget_blocks=40, budget_tokens=160))
    assert not any(simulation.engines[name].tells_prompts_only for name in ("vllm", "sglang"))
    assert {"vllm", "sglang"} <= set(simulation.prompts_only.caches)
