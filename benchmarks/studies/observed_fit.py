"""``--fit-observed`` against the token pass it reuses, on the audit_scale benchmark's synthetic agent log.

    python -m benchmarks.studies.observed_fit [--requests 1000] [--sessions 50] [--block 32] [--divisor 4] [--reps 3]
        [--tokenizer DIR] [--out benchmarks/studies/results]

The log's observed cached tokens are made by a "server": a vLLM-style block cache with ``--block``-token blocks and a
budget of the log's working set divided by ``--divisor`` (the tokens an unbounded cache holds at the end), fed the
log in order, holding each prompt and its reply as the next turn resends it. The token pass (``scan_log``) and the
fit (``fit_observed``: 6 block sizes × 6 budgets, the ids hashed once) are then timed side by side in this process,
``--reps`` times each (min / median / max), with the settings tied best and whether the server's is among them (a
budget that never binds on the log ties with unbounded, which comes first). Writes
benchmarks/studies/results/observed_fit-cpu.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from benchmarks import common
from benchmarks.common import cpu_info
from benchmarks.studies.audit_scale import _embedded_tokenizer_dir, synthetic_log
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.paged_blocks import BLOCK_SIZES
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import BlockCache
from kvscope.engine.audit.simulate.observed import fit_observed
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.radix import RadixTree


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--block", type=int, default=32, help="the server's block size")
    parser.add_argument("--divisor", type=int, default=4, help="the server's budget: the working set divided by this")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokenizer", help="a local model dir with tokenizer.json (default: the embedded model's converted copy)")
    parser.add_argument("--out", default=str(common.results_dir(__file__)))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else _embedded_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    load_before = os.getloadavg()
    log = read_log("\n".join(json.dumps(record) for record in synthetic_log(args.requests, args.sessions)))
    plain = scan_log(tokenizer, log)
    radix = RadixTree()  # the working set: every token the server held (prompts, and replies the next turns resend)
    for step, row in enumerate(plain.requests, 1):
        radix.insert(plain.rendered[row.request].token_ids, row.request, None, step, held=plain.held(row.request))
    budget = radix.tokens // args.divisor
    server = BlockCache(args.block, budget // args.block)
    counts = {
        row.request: server.insert(CacheRequest(plain.rendered[row.request].token_ids, row.request, held=plain.held(row.request)))
        for row in plain.requests
    }
    observed = dataclasses.replace(
        log, requests=tuple(dataclasses.replace(r, observed_cached_tokens=counts[r.index]) for r in log.requests)
    )
    passes, fits = [], []
    for _ in range(args.reps):  # side by side: a token pass, then the fit over its rows
        start = time.perf_counter()
        scan = scan_log(tokenizer, observed)
        passes.append(time.perf_counter() - start)
        start = time.perf_counter()
        fit = fit_observed(scan.requests, scan.held)
        fits.append(time.perf_counter() - start)
    best = fit.best
    data = {
        "benchmark": "observed_fit",
        "tokenizer": tokenizer_dir.name,
        "cpu": cpu_info(),
        "cpus": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "requests": args.requests,
        "sessions": args.sessions,
        "tokens": sum(row.tokens for row in scan.requests),
        "working_set_tokens": fit.working_set_tokens,
        "server": {"block": args.block, "budget_tokens": budget},
        "settings_tried": len(fit.tried),
        "block_sizes": list(BLOCK_SIZES),
        "recovered": best.as_dict() | {"requests": fit.requests},
        "tied": [setting.as_dict() for setting in fit.tried if setting.matches == best.matches],
        "server_setting_among_the_best": any(
            s.setting == {"block": args.block, "budget_tokens": budget} for s in fit.tried if s.matches == best.matches
        ),
        "token_pass_seconds": common.spread(passes),
        "fit_seconds": common.spread(fits),
        "fit_over_token_pass": common.spread([f / p for f, p in zip(fits, passes)]),
    }
    path = Path(args.out) / "observed_fit-cpu.json"
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(path)


if __name__ == "__main__":
    main()
