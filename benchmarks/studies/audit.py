"""Request-log audits of the bundled demo logs: reused fraction, fidelity and TTFT of every repair, turn by turn.

    python -m benchmarks.studies.audit [--logs coding_agent,support_agent,rag] [--tokens 16] [--reps 1] [--grain date]
                               [--threshold 0.05] [--min-agreement 0.9] [--model embedded] [--dtype auto]

Each log in demos/logs is audited with ``engine.audit.audit_requests`` (every repair against a clean prefill of the new
request; ``coarsen`` at ``--grain``, date-only by default: the fix hermes-agent shipped). Writes
benchmarks/studies/results/audit-<log>-<model>-<device>.json: the dtype, the CPU's flags (/proc/cpuinfo: avx2, avx512_bf16, …),
the repetitions and the load average before and after (TTFT is wall time on a machine other processes may share), and
per turn and repair the reused and computed tokens, the reused fraction, KL, top-1, top-5 overlap, greedy agreement and
TTFT (the median of the repetitions, every one kept) with its ratio to the clean prefill's; the fidelity figures come
from the first repetition (they are deterministic: the later ones are checked against it). The summary gives, per repair,
the turns it applies to and stays within the threshold on, its mean reused fraction, its median TTFT ratio and its worst
KL and agreement, and what following the recommendation computes against recomputing every turn. The Benchmarks tab
draws each file.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks import common
from benchmarks.common import cpu_info
from engine.audit.audit import DEFAULT_MIN_AGREEMENT, DEFAULT_THRESHOLD, AuditReport, audit_requests
from engine.audit.repairs import GRAINS, REPAIRS
from engine.audit.requests import parse_log
from engine.models import LoadedModel
from engine.scenario import DEMOS
from engine.timing import Stopwatch

LOGS = DEMOS / "logs"
DEFAULT_LOGS = "coding_agent,support_agent,rag"


def _parser():
    parser = common.parser(__doc__)
    parser.add_argument("--logs", default=DEFAULT_LOGS, help="comma-separated stems of demos/logs/*.jsonl")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens generated per state (N)")
    parser.add_argument("--reps", type=int, default=1, help="audits per log: TTFT is their median, fidelity the first's")
    parser.add_argument("--grain", choices=GRAINS, default="date", help="the coarsen repair's grain")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    parser.add_argument("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT)
    parser.add_argument("--log-dir", default=str(LOGS), help="folder of the logs (default: the bundled demos/logs)")
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    return parser


def _fidelity(turn: dict) -> dict:
    return {name: {k: v for k, v in result.items() if k not in ("ttft_ms", "ttft_ratio")} for name, result in turn["repairs"].items()}


def merged_turns(reports: Sequence[AuditReport]) -> list[dict]:
    """The first report's turns with every TTFT replaced by the median over the reports (each run kept beside it);
    refused when a later repetition's tokens or fidelity differ from the first's."""
    runs = [report.as_dict()["turns"] for report in reports]
    turns = []
    for index, turn in enumerate(runs[0]):
        same = [run[index] for run in runs]
        if any(_fidelity(other) != _fidelity(turn) for other in same[1:]):
            raise RuntimeError(f"request {turn['request']}: a repetition's tokens or fidelity differ from the first's")
        merged = dict(turn)
        if turn["full_ttft_ms"] is not None:
            full_runs = [other["full_ttft_ms"] for other in same]
            merged["full_ttft_ms"], merged["full_ttft_runs_ms"] = statistics.median(full_runs), full_runs
        repairs = {}
        for name, result in turn["repairs"].items():
            result = dict(result)
            if result["applicable"]:
                ttft_runs = [other["repairs"][name]["ttft_ms"] for other in same]
                result["ttft_ms"], result["ttft_runs_ms"] = statistics.median(ttft_runs), ttft_runs
                result["ttft_ratio"] = round(merged["full_ttft_ms"] / result["ttft_ms"], 3) if result["ttft_ms"] > 0 else None
                total = result["reused_tokens"] + result["computed_tokens"]
                result["reused_fraction"] = round(result["reused_tokens"] / total, 4) if total else 0.0
            repairs[name] = result
        merged["repairs"] = repairs
        turns.append(merged)
    return turns


def summarise(turns: Sequence[dict], repairs: Sequence[str], threshold: float, min_agreement: float) -> dict:
    """Per repair: where it applies and stays within the threshold, its reuse, speed and worst fidelity; and what the
    recommended repairs compute in all, beside recompute."""
    audited = [turn for turn in turns if turn["repairs"]]
    per_repair = {}
    for name in repairs:
        applied = [turn["repairs"][name] for turn in audited if turn["repairs"][name]["applicable"]]
        within = [
            r for r in applied if r["kl"] <= threshold and r["top1_agree"] and r["generation_agreement"] >= min_agreement
        ]  # as engine.audit.audit.recommend judges
        ratios = [r["ttft_ratio"] for r in applied if r["ttft_ratio"] is not None]
        per_repair[name] = {
            "turns_applicable": len(applied),
            "turns_within_threshold": len(within),
            "mean_reused_fraction": round(statistics.mean(r["reused_fraction"] for r in applied), 4) if applied else None,
            "computed_tokens": sum(r["computed_tokens"] for r in applied),
            "median_ttft_ratio": round(statistics.median(ratios), 3) if ratios else None,
            "max_kl": max((r["kl"] for r in applied), default=None),
            "min_generation_agreement": min((r["generation_agreement"] for r in applied), default=None),
        }
    chosen = [turn["repairs"][turn["recommendation"]["repair"]] for turn in audited]
    recompute = [turn["repairs"]["recompute"] for turn in audited]
    return {
        "turns": len(audited),
        "repairs": per_repair,
        "recommended": {name: sum(turn["recommendation"]["repair"] == name for turn in audited) for name in repairs},
        "recommended_computed_tokens": sum(r["computed_tokens"] for r in chosen),
        "recompute_computed_tokens": sum(r["computed_tokens"] for r in recompute),
        "recommended_ttft_ms": round(sum(r["ttft_ms"] for r in chosen), 1),
        "recompute_ttft_ms": round(sum(r["ttft_ms"] for r in recompute), 1),
    }


def run_log(lm: LoadedModel, name: str, args) -> dict:
    """Audit one bundled log ``args.reps`` times; its result file's content."""
    requests = parse_log((Path(args.log_dir) / f"{name}.jsonl").read_text(encoding="utf-8"))
    load_before, watch, reports = os.getloadavg(), Stopwatch(), []
    options = {"tokens": args.tokens, "threshold": args.threshold, "min_agreement": args.min_agreement, "grain": args.grain}
    for rep in range(args.reps):
        progress = lambda done, total, rep=rep: print(f"  {name} rep {rep + 1}/{args.reps}: {done}/{total}", flush=True)  # noqa: E731
        reports.append(audit_requests(lm, requests, repairs=REPAIRS, progress=progress, **options))
    turns = merged_turns(reports)
    first = reports[0]
    return {
        "log": name,
        "requests": len(requests),
        "cpu": cpu_info(),
        "reps": args.reps,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(watch.ms / 1000, 1),
        "threshold": first.threshold,
        "min_agreement": first.min_agreement,
        "generated_tokens": first.generated_tokens,
        "repairs": list(first.repairs),
        "grain": first.grain,
        "turns": turns,
        "summary": summarise(turns, first.repairs, first.threshold, first.min_agreement),
    }


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    lm = common.load(args)
    results = []
    for name in [stem.strip() for stem in args.logs.split(",") if stem.strip()]:
        data = run_log(lm, name, args)
        path = common.write_result(f"audit-{name}", lm, data, Path(args.out))
        results.append(data)
        summary = data["summary"]
        print(
            f"{name}: {summary['turns']} turns in {data['wall_s']} s; recommended {summary['recommended']}; "
            f"computes {summary['recommended_computed_tokens']:,} tokens vs recompute {summary['recompute_computed_tokens']:,} -> {path}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
