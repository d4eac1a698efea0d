"""Budgets as servers size them (``simulate.budgets``, each engine's ``budget``): the numbers equal the servers' own
formulas worked by hand for the embedded model, eviction starts where the budget says, and an unbounded cache says so."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.engine.audit.ci.gate import budget_lines
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.simulate.budgets import GIB, ModelKV, ServerSize
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.registry import Caches, budgets

# the embedded model's config.json (Qwen2.5-Coder-0.5B-Instruct, the converted copy's), the keys a server sizes it by
EMBEDDED = {
    "model_type": "qwen2",
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": None,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "dtype": "float32",
}
EMBEDDED_PARAMETERS = 630_167_424  # the sum of the converted model.safetensors' tensor sizes, read from its header


def _by_engine(settings: CacheSettings) -> dict:
    return {budget.engine: budget for budget in budgets(settings)}


def test_the_embedded_models_shape_is_read_from_its_config():
    model = ModelKV.of_config(EMBEDDED, "embedded")
    assert (model.layers, model.kv_heads, model.head_dim) == (24, 2, 64)
    assert model.parameters == EMBEDDED_PARAMETERS
    assert model.kv_bytes_per_token("bfloat16") == 2 * 24 * 2 * 64 * 2 == 12_288


def test_vllm_gpu_blocks_follow_determine_available_memory():
    size = ServerSize(ModelKV.of_config(EMBEDDED, "embedded"), gpu_gib=24, gpu_memory_utilization=0.9)
    memory = int(24 * 2**30 * 0.9 - EMBEDDED_PARAMETERS * 2)  # requested memory less the bf16 weights
    page = 16 * 12_288  # a 16-token block over every layer
    budget = _by_engine(CacheSettings(server=size))["vllm"]
    assert memory // page == 111_554
    assert (budget.limit, budget.tokens, budget.unit) == (111_553, 111_553 * 16, "blocks")  # less the null block
    assert "num_gpu_blocks 111,554" in budget.source and "activations not counted" in budget.source


def test_vllm_cpu_blocks_follow_its_kvcache_space():
    size = ServerSize(ModelKV.of_config(EMBEDDED, "embedded"), cpu_kvcache_gib=1, gpu_gib=80)  # the CPU space wins for vLLM
    budget = _by_engine(CacheSettings(block=32, server=size))["vllm"]
    assert budget.limit == 2**30 // (32 * 12_288) - 1 == 2_729
    assert "VLLM_CPU_KVCACHE_SPACE=1 GiB" in budget.source


def test_sglang_tokens_follow_profile_max_num_token():
    size = ServerSize(ModelKV.of_config(EMBEDDED, "embedded"), gpu_gib=24, mem_fraction_static=0.85)
    budget = _by_engine(CacheSettings(server=size))["sglang"]
    free_after_weights = 24 * 2**30 - EMBEDDED_PARAMETERS * 2
    assert budget.limit == int(free_after_weights - 24 * 2**30 * (1 - 0.85)) // 12_288
    assert "assumed" not in budget.source
    assumed = _by_engine(CacheSettings(server=ServerSize(size.model, gpu_gib=24)))["sglang"]
    assert "0.88 (assumed" in assumed.source


def test_llama_cpp_splits_its_context_across_its_slots():
    model = ModelKV.of_config(EMBEDDED, "embedded")
    split = _by_engine(CacheSettings(server=ServerSize(model, context=8192, parallel=4), prompt_cache=False))["llama_cpp"]
    assert (split.limit, split.each, split.tokens) == (4, 2048, 8192)
    unified = _by_engine(CacheSettings(server=ServerSize(model, context=8192), prompt_cache=True))["llama_cpp"]
    assert (unified.limit, unified.each) == (4, 8192)  # -np auto: 4 slots on one KV cache, each may hold all of -c


def test_a_budget_flag_wins_over_the_servers_size():
    size = ServerSize(ModelKV.of_config(EMBEDDED, "embedded"), gpu_gib=24)
    found = _by_engine(CacheSettings(budget_blocks=7, budget_tokens=99, server=size))
    assert (found["vllm"].limit, found["vllm"].source) == (7, "--kv-budget-blocks")
    assert (found["sglang"].limit, found["sglang"].source) == (99, "--kv-budget-tokens")


# a toy model: 64 bytes of KV a token in float32 (2 × 1 layer × 1 head × 8 × 4), no weights to subtract
TOY = ModelKV("toy", layers=1, kv_heads=1, head_dim=8, parameters=0, dtype="float32")


def _request(number: int, tokens: int, session: str | None = None) -> CacheRequest:
    ids = np.arange(number * 1000, number * 1000 + tokens, dtype=np.int32)  # no two requests share a token
    return CacheRequest(ids, number, session=session, time=number)


def test_vllm_evicts_where_its_block_budget_says():
    size = ServerSize(TOY, cpu_kvcache_gib=11 * 16 * 64 / GIB, dtype="float32")  # 11 blocks of 16 tokens: 10 and the null one
    cache = Caches(CacheSettings(block=16, server=size))["vllm"]
    for number in range(5):
        cache.insert(_request(number, 32))  # 2 blocks each: 10 blocks after 5 requests
    assert not cache.evicted and len(cache.blocks) == 10
    cache.insert(_request(5, 16))
    assert len(cache.evicted) == 1 and len(cache.blocks) == 10
    assert cache.evicted[0][0] == 0  # the least recently used: the first request's


def test_sglang_evicts_where_its_token_budget_says():
    size = ServerSize(TOY, gpu_gib=100 * 64 / GIB, mem_fraction_static=1.0, dtype="float32")  # 100 tokens of KV
    cache = Caches(CacheSettings(server=size))["sglang"]
    for number in range(4):
        cache.insert(_request(number, 25))
    assert cache.tree.tokens == 100
    assert cache.match(_request(0, 25)) == 25
    cache.insert(_request(4, 25))
    assert cache.tree.tokens == 100 and cache.match(_request(0, 25)) == 0  # the first request's leaf went first


def test_llama_cpp_slots_hold_their_share_of_the_context():
    size = ServerSize(TOY, context=100, parallel=2)
    cache = Caches(CacheSettings(server=size, prompt_cache=False))["llama_cpp"]
    cache.insert(_request(0, 80, "a"))
    assert len(cache.held["a"]) == 50  # a slot keeps -c / -np tokens
    cache.insert(_request(1, 10, "b"))
    cache.insert(_request(2, 10, "c"))  # a third session takes the least recently used slot
    assert list(cache.held) == ["b", "c"]


def test_unbounded_caches_say_so():
    found = budgets(CacheSettings())
    assert [budget.engine for budget in found] == ["vllm", "sglang", "llama_cpp"]
    assert all(budget.unbounded and budget.limit is None for budget in found)
    lines = budget_lines([budget.as_dict() for budget in found])
    assert all("unbounded" in line and "no real server" in line for line in lines)
    assert [budget.as_dict()["unbounded"] for budget in found] == [True, True, True]


@pytest.mark.parametrize(
    ("sizes", "named"),
    [
        ({"gpu_gib": -1.0}, "--gpu-memory-gib"),
        ({"gpu_gib": 24, "gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
        ({"gpu_gib": 24, "mem_fraction_static": 0.0}, "--mem-fraction-static"),
        ({"context": 0}, "--llama-ctx-size"),
        ({"context": 100, "parallel": 0}, "--llama-parallel"),
        ({"parallel": 2}, "--llama-ctx-size"),
        ({"gpu_gib": 24, "dtype": "int3"}, "--server-dtype"),
        ({}, "--gpu-memory-gib"),
    ],
)
def test_a_server_size_is_checked_in_its_constructor(sizes, named):
    with pytest.raises(RequestLogError, match=named):
        ServerSize(TOY, **sizes)


def test_a_server_too_small_for_the_weights_is_refused_by_the_settings():
    size = ServerSize(ModelKV.of_config(EMBEDDED, "embedded"), gpu_gib=1.0)  # 0.9 GiB less 1.17 GiB of weights
    with pytest.raises(RequestLogError, match="leaves no memory for KV"):
        ScanSettings(CacheSettings(server=size))


def test_on_a_log_the_servers_size_evicts_where_its_block_budget_would():
    """A small log's token pass with vLLM sized by VLLM_CPU_KVCACHE_SPACE reuses exactly what it reuses under
    --kv-budget-blocks at that budget, and less than unbounded: eviction starts where the budget says."""
    from kvscope.engine.audit.logs.reading import read_log
    from kvscope.engine.audit.scan.traffic_scan import scan_log
    from kvscope.engine.models import load_tokenizer

    tokenizer = load_tokenizer("tiny-qwen2").tokenizer
    manual = " ".join(f"rule {n}: refunds need a receipt." for n in range(12))
    system = f'{{"role": "system", "content": "{manual}"}}'
    lines = [f'{{"session_id": "s{n}", "messages": [{system}, {{"role": "user", "content": "q{n}"}}]}}' for n in range(2)]
    lines += [f'{{"session_id": "t{n}", "messages": [{{"role": "user", "content": "other topic {n} {manual[::-1]}"}}]}}' for n in range(2)]
    lines.append(lines[0])  # the first session's prompt again, after the others pushed its blocks out
    log = read_log("\n".join(lines))

    def reused(cache: CacheSettings) -> list[int]:
        scan = scan_log(tokenizer, log, ScanSettings(cache, "vllm", block_given=True))
        return [row.reused_tokens["vllm"] for row in scan.requests]

    size = ServerSize(TOY, cpu_kvcache_gib=9 * 16 * 64 / GIB, dtype="float32")  # 9 blocks: 8 for the cache and the null one
    sized = CacheSettings(block=16, server=size)
    assert budgets(sized)[0].limit == 8
    assert reused(sized) == reused(CacheSettings(block=16, budget_blocks=8)) == [0, 128, 0, 0, 0]
    assert reused(sized) != reused(CacheSettings(block=16, budget_blocks=9))  # one block more (the null one) would reuse more
    assert sum(reused(sized)) < sum(reused(CacheSettings(block=16)))  # unbounded keeps what the budget evicted
