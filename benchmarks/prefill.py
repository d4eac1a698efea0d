"""Prefill time vs context length, and decision-read time on a cached context.

    python -m benchmarks.prefill [--model embedded] [--lengths 256,512,1024,2048,4096] [--reps 2]

Prints a table and writes benchmarks/results/prefill-<model>-<device>.json. Both numbers are measured in
the same run on the same notebook, so their ratio is what a cached context saves per question.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from engine.models import load_model
from engine.notebook import Notebook
from engine.runs import run_scenario
from engine.scenario import Scenario, bundled_scenarios, render

RESULTS = Path(__file__).parent / "results"


def _filler_ids(lm, count: int) -> list[int]:
    """Neutral text tokens (a meeting log) repeated to ``count`` tokens."""
    text = "The team met on Tuesday, reviewed the backlog, and agreed to revisit the schedule next week. "
    ids = lm.tokenizer(text * (count // 10 + 1), add_special_tokens=False).input_ids
    return ids[:count]


def _timed(function, reps: int) -> float:
    """Median wall time in ms of ``function()`` over ``reps`` runs (after one warm-up)."""
    function()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype, progress=print)
    scenario = Scenario.load(bundled_scenarios()["refund_gate"])
    prompt = render(scenario, lm.tokenizer)
    rows = []
    for length in tqdm([int(n) for n in args.lengths.split(",")], desc="lengths"):
        ids = _filler_ids(lm, length)
        prefill_ms = _timed(lambda: Notebook.prefill(lm, ids), args.reps)
        notebook = Notebook.prefill(lm, ids)
        read_ms = _timed(lambda: notebook.read_prompt(prompt), args.reps)
        rows.append({"tokens": length, "prefill_ms": round(prefill_ms, 1), "read_ms": round(read_ms, 1), "prefill_over_read": round(prefill_ms / read_ms, 2)})
    scenario_ms = _timed(lambda: run_scenario(lm, scenario), args.reps)
    result = {
        "model": lm.fingerprint.name,
        "dtype": lm.fingerprint.dtype,
        "device": str(lm.device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "decode_tokens": len(prompt.decode_ids),
        "scenario_prefill_and_read_ms": round(scenario_ms, 1),
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"prefill-{lm.fingerprint.name.split(':')[0]}-{lm.device.type}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"{'tokens':>8} {'prefill ms':>12} {'read ms':>10} {'ratio':>7}")
    for row in rows:
        print(f"{row['tokens']:>8} {row['prefill_ms']:>12} {row['read_ms']:>10} {row['prefill_over_read']:>7}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
