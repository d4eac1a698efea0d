"""The tab's budgets from a server's size: the same settings and budgets as the CLI's server-size flags build (one
engine computation, ``budgets``), refused by the flag's name, and said in the traffic text beside the unbounded ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvscope.app.handlers.audit_settings import EngineInputs
from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.your_prompt import run_audit
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.simulate.budgets import ModelKV
from kvscope.engine.audit.simulate.registry import budgets
from kvscope.engine.cli.parser import build_parser
from kvscope.engine.cli.scale import scan_settings
from kvscope.viz.common import markdown_literal

CONFIG = {  # a small Qwen2's config.json, the keys a server sizes it by
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
    "dtype": "float32",
}


class _Config(dict):
    def to_dict(self) -> dict:
        return dict(self)


LOADED = SimpleNamespace(name="small", config=_Config(CONFIG))  # a tokenizer-only load as the CLI and the app read it


def test_the_tab_and_the_cli_size_the_same_server_alike():
    flags = ["--gpu-memory-gib", "0.5", "--mem-fraction-static", "0.8", "--llama-ctx-size", "4096", "--llama-parallel", "2"]
    args = build_parser().parse_args(["audit", "log.jsonl", *flags])
    cli = scan_settings(args, LOADED)
    tab = EngineInputs(gpu_gib=0.5, mem_fraction_static=0.8, llama_ctx=4096, llama_parallel=2).scan(None, ModelKV.of_loaded(LOADED))
    assert tab.cache == cli.cache
    assert [budget.as_dict() for budget in budgets(tab.cache)] == [budget.as_dict() for budget in budgets(cli.cache)]
    assert not any(budget.unbounded for budget in budgets(tab.cache))  # -np 2: two slots of 2,048 tokens


def test_the_tab_refuses_a_size_by_the_clis_flag_and_needs_the_models_shape():
    with pytest.raises(RequestLogError, match="--gpu-memory-utilization"):
        EngineInputs(gpu_gib=8, gpu_memory_utilization=1.5).cache(ModelKV.of_loaded(LOADED))
    with pytest.raises(AppError, match="model's KV shape"):
        EngineInputs(gpu_gib=8).cache()
    assert EngineInputs().cache().server is None  # nothing given: no server's size


LOG = "".join(
    f'{{"session_id": "s{n % 3}", "messages": [{{"role": "user", "content": "question {n} about the same long manual"}}]}}\n'
    for n in range(6)
)


def test_the_traffic_text_says_each_engines_budget_and_which_ran_unbounded(registry, sessions):
    view = run_audit(registry, sessions, LOG, session="budgets", sample=0, engines=EngineInputs(llama_ctx=64, llama_parallel=2))
    found = {item["engine"]: item for item in view.summary["engines"]["budgets"]}
    assert (found["llama_cpp"]["limit"], found["llama_cpp"]["each"]) == (2, 32)
    assert found["vllm"]["unbounded"] and found["sglang"]["unbounded"]
    assert "**KV budgets**" in view.traffic_markdown
    assert markdown_literal("llama.cpp: 2 slots (64 tokens): 2 slots of 32 tokens: -c 64 / -np 2") in view.traffic_markdown
    assert markdown_literal("vLLM: unbounded") in view.traffic_markdown and "no real server does" in view.traffic_markdown
