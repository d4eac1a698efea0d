"""The token pass's and the model pass's settings are checked in their constructors, each refusal naming the setting."""

import pytest

from kvscope.engine.audit.logs.render import DEFAULT_CONTEXT_LIMIT
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.measure.settings import DEFAULT_MIN_AGREEMENT, MeasureSettings, measure_settings
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.observed import Reported
from kvscope.engine.audit.simulate.registry import DEFAULT_ENGINE


def test_scan_settings_default_to_the_one_default_of_each_and_refuse_by_name():
    settings = ScanSettings()
    assert (settings.cache.block, settings.observed_engine, settings.fleet, settings.limit) == (
        16,
        None,  # the server the log's answers name, decided per log
        (),
        DEFAULT_CONTEXT_LIMIT,
    )
    decided, server = settings.for_log([])  # a log whose answers name no server: the default engine, said so
    assert (decided.observed_engine, decided.cache.prompt_cache) == (DEFAULT_ENGINE, True) and "assumed" in server.evidence
    assert settings.limited(4096).limit == 4096 and ScanSettings(context_limit=512).limited(4096).limit == 512
    assert ScanSettings(fleet=[[2, "session"]]).fleet == ((2, "session"),)  # a list from JSON or a form, held as a tuple
    refused = {
        "--block-size is at least 1 token, got 0": {"cache": CacheSettings(block=0)},
        "--kv-budget-tokens is at least 1": {"cache": CacheSettings(budget_tokens=0)},
        "--cache-reuse is at least 0": {"cache": CacheSettings(cache_reuse=-1)},
        "--cache-reuse is not simulated with it": {"cache": CacheSettings(cache_reuse=8, prompt_cache=True)},
        "compared with one of vllm, sglang, llama_cpp, got 'tgi'": {"observed_engine": "tgi"},
        "the context limit is at least 1 token, got 0": {"context_limit": 0},
    }
    for message, given in refused.items():
        with pytest.raises(RequestLogError, match=message):
            ScanSettings(**given)


def _reported(counts: list[int | None]) -> list[Reported]:
    return [Reported(n, None, None, count) for n, count in enumerate(counts, 1)]


def test_a_vllm_logs_block_size_is_read_from_its_counts_unless_given():
    served_at_32 = _reported([0, 0, 32, 64, 96, 160, None])
    vllm = ScanSettings(observed_engine="vllm")  # as where the log's answers name vLLM
    decided, server = vllm.for_log(served_at_32)
    assert decided.cache.block == 32
    assert server.evidence.endswith("block size 32 read from the log's counts: all 4 nonzero counts are multiples of 32")
    assert vllm.for_log(_reported([0, 32, 64, 96]))[0].cache.block == 16  # three nonzero: the default, unsaid
    assert "block size" not in vllm.for_log(_reported([0, 32, 64, 96]))[1].evidence
    assert vllm.for_log(_reported([32, 64, 96, 48]))[0].cache.block == 16  # the largest size dividing them all
    given = ScanSettings(observed_engine="vllm", block_given=True).for_log(served_at_32)  # --block-size 16 named
    assert given[0].cache.block == 16 and "block size" not in given[1].evidence
    assert ScanSettings(CacheSettings(block=64), "vllm").for_log(served_at_32)[0].cache.block == 64  # a block other than the default
    assert ScanSettings(observed_engine="sglang").for_log(served_at_32)[0].cache.block == 16  # read for vLLM only
    assumed = ScanSettings().for_log(served_at_32)  # no answer names vLLM: the counts may be a hosted provider's
    assert assumed[0].cache.block == 16 and "assumed" in assumed[1].evidence and "block size" not in assumed[1].evidence


def test_measure_settings_are_checked_in_the_constructor_whoever_builds_them():
    assert MeasureSettings(("erratum",)).repairs == ("recompute", "erratum")  # the reference first, always
    assert measure_settings(["erratum"], tokens=4) == MeasureSettings(("erratum",), 4)
    assert MeasureSettings().min_agreement == DEFAULT_MIN_AGREEMENT and MeasureSettings(context_limit=64).context_limit == 64
    refused = {
        "--min-agreement: the minimum agreement is a share between 0 and 1, got 3": {"min_agreement": 3.0},
        "--min-agreement: the minimum agreement is a share between 0 and 1, got -0.1": {"min_agreement": -0.1},
        "--threshold: the KL threshold cannot be negative": {"threshold": -0.5},
        "--tokens: generate at least one token per state, got 0": {"tokens": 0},
        "--grain: unknown grain 'week'": {"grain": "week"},
        "unknown repair 'magic'": {"repairs": ("magic",)},
        "the context limit is at least 1 token": {"context_limit": 0},
    }
    for message, given in refused.items():
        with pytest.raises(RequestLogError, match=message):
            MeasureSettings(**given)


def test_a_model_gives_the_settings_its_context_limit_and_kv_shape_where_they_set_none():
    from kvscope.engine.audit.simulate.budgets import ModelKV
    from kvscope.engine.models.tiny import tiny_model

    lm = tiny_model("qwen2")
    filled = ScanSettings().for_model(lm)
    assert filled.cache.model == ModelKV.of_loaded(lm) and filled.context_limit is not None
    other = ModelKV("given", 1, 1, 8, 100, "float16")
    kept = ScanSettings(CacheSettings(model=other), context_limit=64).for_model(lm)
    assert kept.cache.model == other and kept.context_limit == 64
