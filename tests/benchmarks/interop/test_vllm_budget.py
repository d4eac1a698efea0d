"""The vLLM budget benchmark reads the KV cache size vLLM's log prints, and sets the audit's budget for the same server
beside it (no server started here: the log line as vLLM 0.32's ``update_kv_cache_capacity`` writes it)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.interop.vllm_budget import audit_budget, server_kv_tokens
from tests.engine.audit.simulate.test_budgets import EMBEDDED

LOG = (
    "(EngineCore pid=4242) INFO 12-06 05:01:02 [kv_cache_utils.py:1190] CPU KV cache size: 87,360 tokens, "
    "Maximum concurrency for 4,096 tokens per request: 21.33x\n"
)


def test_the_servers_kv_cache_size_is_read_off_its_log():
    found = server_kv_tokens("other lines\n" + LOG)
    assert (found["pool"], found["tokens"], found["max_model_len"], found["max_concurrency"]) == ("CPU", 87_360, 4_096, 21.33)


def test_the_audits_budget_for_the_same_server_is_vllms_num_gpu_blocks(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(EMBEDDED), encoding="utf-8")
    computed = audit_budget(tmp_path, "bfloat16", 1, 32)
    assert computed["num_gpu_blocks"] == 2**30 // (32 * 12_288) == 2_730  # 1 GiB over a 32-token block of every layer in bf16
    assert (computed["tokens"], computed["cached_blocks"]) == (2_730 * 32, 2_729)
