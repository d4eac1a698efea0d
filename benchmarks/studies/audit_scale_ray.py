"""One process against Ray on the generated agent log (``audit_scale.synthetic_log``), side by side: at each size, the
token pass of one process and of ``--ray local --workers N`` alternate, each in a fresh process, ``--repeats`` times.

    python -m benchmarks.studies.audit_scale_ray [--sizes 10000,100000] [--repeats 3] [--workers 2] [--sessions 50]
        [--tokenizer DIR] [--out benchmarks/studies/results]

Each run is ``audit_scale --scale-worker`` (one process: read_logs + scan_log, the tokenizer's own parallelism on;
Ray: start_ray + ray_scan, the driver in that process); its seconds are timed inside it (the pass, and Ray's start-up
apart), and the whole process's wall (imports and start-up included, as a user waits for the command) from outside.
Per size: min/median/max of each, the ratio of the medians (one process's over Ray's: above 1, Ray is faster), whether
every run gave the same totals and causes, and the load average before each run (the machine may be shared).

Writes benchmarks/studies/results/audit_scale_ray_interleaved-cpu.json (again after each run, so a comparison cut
short keeps what it measured) and prints each size's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import common
from benchmarks.common import cpu_info
from benchmarks.studies.audit_scale import _embedded_tokenizer_dir, synthetic_log

MODES = ("single", "ray")
NOTES = {
    "pass_seconds": "the token pass timed inside its process: read_logs + scan_log, or ray_scan (sharding, counting, "
    "tokenizing on the actors while the driver simulates, the pairs re-read) without ray.init",
    "command_seconds": "the whole fresh process timed from outside: Python's imports, the tokenizer's load, ray.init "
    "and Ray's shutdown included",
    "ratio": "the one process's median over Ray's (above 1: Ray is faster)",
    "peak_rss_mb": "the single process's peak RSS, or the Ray driver's (the actors' memory is their own, not counted)",
}


def _run(mode: str, log: Path, tokenizer_dir: Path, workers: int) -> dict:
    """One token pass in a fresh process (``audit_scale --scale-worker``), with its wall from outside and the load."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAY_USAGE_STATS_ENABLED": "0"}
    command = [sys.executable, "-m", "benchmarks.studies.audit_scale", "--scale-worker", mode, str(log), str(tokenizer_dir), str(workers)]
    load = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the {mode} pass failed: {done.stderr[-3000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return measured | {"command_seconds": round(wall, 2), "load_average_before": load}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": round(statistics.median(values), 2), "max": max(values)}


def compare(size: int, repeats: int, workers: int, sessions: int, tokenizer_dir: Path, folder: Path, done: Callable[[dict], None]) -> dict:
    """Both passes on one generated log of ``size`` requests, alternating, ``repeats`` times each; ``done`` is given
    the result so far after each run (a long comparison cut short keeps what it measured)."""
    log = folder / f"agents-{size}.jsonl"
    with log.open("w", encoding="utf-8") as stream:
        for record in synthetic_log(size, sessions):
            stream.write(json.dumps(record) + "\n")
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            runs[mode].append(_run(mode, log, tokenizer_dir, workers))
            last = runs[mode][-1]
            print(f"{size:,} requests, {mode}: pass {last['seconds']} s, command {last['command_seconds']} s", file=sys.stderr)
            done(_summary(size, sessions, workers, log, runs))
    return _summary(size, sessions, workers, log, runs)


def _summary(size: int, sessions: int, workers: int, log: Path, runs: dict[str, list[dict]]) -> dict:
    """The runs so far: per pass min/median/max, the ratio of the medians, and whether every run gave one answer."""
    measured = [mode for mode in MODES if runs[mode]]
    answers = [(run["totals"], run["causes"]) for mode in measured for run in runs[mode]]
    keys = ("seconds", "command_seconds", "peak_rss_mb")
    summary = {mode: {key: _spread([run[key] for run in runs[mode]]) for key in keys} for mode in measured}
    both = len(measured) == len(MODES)
    ratio = {key: round(summary["single"][key]["median"] / summary["ray"][key]["median"], 2) if both else None for key in keys[:2]}
    return {
        "requests": size,
        "sessions": sessions,
        "workers": workers,
        "repeats": {mode: len(runs[mode]) for mode in MODES},
        "log_bytes": log.stat().st_size,
        "summary": summary,
        "ratio": ratio,
        "same_totals_and_causes": all(answer == answers[0] for answer in answers),
        "runs": {mode: [{k: v for k, v in run.items() if k not in ("totals", "causes")} for run in runs[mode]] for mode in MODES},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000", help="requests of each generated log (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pass per size, alternating")
    parser.add_argument("--workers", type=int, default=2, help="the local Ray's CPUs and tokenizer actors")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--tokenizer", help="a local model dir with tokenizer.json (default: the embedded model's converted copy)")
    parser.add_argument("--out", default=str(common.results_dir(__file__)))
    args = parser.parse_args(argv)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else _embedded_tokenizer_dir()
    load_before, results = os.getloadavg(), []
    path = Path(args.out) / "audit_scale_ray_interleaved-cpu.json"

    def write(partial: dict | None = None) -> None:
        data = {
            "benchmark": "audit_scale_ray_interleaved",
            "tokenizer": tokenizer_dir.name,
            "cpu": cpu_info(),
            "cpus": os.cpu_count(),
            "load_average": {"before": [round(x, 2) for x in load_before], "now": [round(x, 2) for x in os.getloadavg()]},
            "goal": "--ray local --workers 2 faster than one process at 100,000 requests, the same totals",
            "notes": NOTES,
            "results": results + ([partial] if partial else []),
        }
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")

    with tempfile.TemporaryDirectory() as folder:
        for size in [int(n) for n in args.sizes.split(",")]:
            results.append(compare(size, args.repeats, args.workers, args.sessions, tokenizer_dir, Path(folder), write))
            write()
            ratio = results[-1]["ratio"]
            print(f"{size:,} requests: one process / Ray = x{ratio['seconds']} (pass), x{ratio['command_seconds']} (command)")
    print(path)


if __name__ == "__main__":
    main()
