"""Request-log audits of the bundled demo logs: reused fraction, fidelity and TTFT of every repair, turn by turn; with
``--speed``, how fast the audit's model pass runs against plain transformers, and each log's time in the app.

    python -m benchmarks.studies.audit [--logs coding_agent,support_agent,rag] [--tokens 16] [--reps 1] [--grain date]
                               [--threshold 0.05] [--min-agreement 0.9] [--model embedded] [--dtype auto]
    python -m benchmarks.studies.audit --speed [--dtypes bfloat16,float32] [--tokens 8] [--reps 3] [--app-tokens 32]

Each log in demos/logs is audited with ``kvscope.engine.audit.measure.turn.audit_requests`` (every repair against a clean prefill of the new
request; ``coarsen`` at ``--grain``, date-only by default: the fix hermes-agent shipped). Writes
benchmarks/studies/results/audit-<log>-<model>-<device>.json: the dtype, the CPU's flags (/proc/cpuinfo: avx2, avx512_bf16, …),
the repetitions and the load average before and after (TTFT is wall time on a machine other processes may share), and
per turn and repair the reused and computed tokens, the reused fraction, KL, top-1, top-5 overlap, greedy agreement and
TTFT (the median of the repetitions, every one kept) with its ratio to the clean prefill's; the fidelity figures come
from the first repetition (they are deterministic: the later ones are checked against it). The summary gives, per repair,
the turns it applies to and stays within the threshold on, its mean reused fraction, its median TTFT ratio and its worst
KL and agreement, and what following the recommendation computes against recomputing every turn. The Benchmarks tab
draws each file.

``--speed`` (:func:`speed`) runs each bundled log (demos/logs/*.jsonl and traffic/interleaved_agents.jsonl) as the app
and the CLI audit it (``audit_traffic``: the token pass, then every repair on ``--sample`` turns per change, ``--tokens``
greedy tokens) in each of ``--dtypes``. The model pass is timed from the audit's first measured step to its end; its
forwards are recorded once (the new token ids, and how many cached entries each attends to), and plain transformers
replays the same forwards (``model(...)`` over a ``DynamicCache`` of that many entries, SDPA, the same dtype; greedy
steps one token each), side by side with the audit in every repetition: the ratio is audit / plain (goal ≤ 1.3×). Then
each log goes through the app's audit handler (``kvscope.app.handlers.your_prompt.run_audit``, the tab's defaults, the model
already loaded) in bfloat16 (goal ≤ 60 s). Writes results/audit_speed-<dtypes>-<model>-cpu.json, with the load average (other
processes share the CPU) and min / median / max of every time.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from benchmarks import common
from benchmarks.common import cpu_info
from kvscope.engine.audit.logs.reading import parse_log, read_log
from kvscope.engine.audit.measure.settings import DEFAULT_MIN_AGREEMENT, DEFAULT_THRESHOLD, DEFAULT_TOKENS, measure_settings
from kvscope.engine.audit.measure.traffic import DEFAULT_SAMPLE, audit_traffic
from kvscope.engine.audit.measure.turn import AuditReport, audit_requests
from kvscope.engine.audit.prompts.repair_requests import GRAINS, REPAIRS
from kvscope.engine.cache import adapter
from kvscope.engine.models import LoadedModel, load_model
from kvscope.engine.scenario import DEMOS
from kvscope.engine.timing import Stopwatch

LOGS = DEMOS / "logs"


def _parser():
    parser = common.parser(__doc__)
    parser.add_argument("--logs", default=common.BUNDLED_LOGS, help="comma-separated stems of demos/logs/*.jsonl")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens generated per state (N; --speed: 8)")
    parser.add_argument("--reps", type=int, default=1, help="audits per log: TTFT is their median, fidelity the first's")
    parser.add_argument("--grain", choices=GRAINS, default="date", help="the coarsen repair's grain")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    parser.add_argument("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT)
    parser.add_argument("--log-dir", default=str(LOGS), help="folder of the logs (default: the bundled demos/logs)")
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    parser.add_argument("--speed", action="store_true", help="the model pass against plain transformers, and the app's time")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="--speed: the dtypes the model pass runs in")
    parser.add_argument("--speed-logs", default=",".join(SPEED_LOGS), help="--speed: the bundled logs (stems under demos/logs)")
    parser.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, help="--speed: turns measured per change signature")
    parser.add_argument("--app-tokens", type=int, default=DEFAULT_TOKENS, help="--speed: the app's greedy tokens (its default)")
    parser.add_argument("--app-reps", type=int, default=1, help="--speed: audits per log through the app (0: none)")
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
        ]  # as kvscope.engine.audit.measure.turn.recommend judges
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
    measure = measure_settings(REPAIRS, args.tokens, args.threshold, args.min_agreement, args.grain)
    for rep in range(args.reps):
        progress = lambda done, total, rep=rep: print(f"  {name} rep {rep + 1}/{args.reps}: {done}/{total}", flush=True)  # noqa: E731
        reports.append(audit_requests(lm, requests, measure=measure, progress=progress))
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


SPEED_LOGS = ("coding_agent", "rag", "support_agent", "traffic/interleaved_agents")


@dataclass(frozen=True)
class _Forward:
    """One forward of the audit's model pass: the new tokens, and the cached entries they attend to."""

    token_ids: tuple[int, ...]
    cached: int


def _recorded_pass(lm: LoadedModel, log, options: dict) -> tuple[float, list[_Forward]]:
    """One audit of ``log``: the model pass's wall time (from its first measured step to its end) and its forwards."""
    forwards, started = [], []
    forward = adapter.forward

    def recorded(model, keys, values, key_positions, input_ids, *args, **kwargs):
        forwards.append(_Forward(tuple(input_ids.tolist()), len(key_positions)))
        return forward(model, keys, values, key_positions, input_ids, *args, **kwargs)

    def first_step(done: int, total: int) -> None:
        if not started:
            started.append(Stopwatch())

    adapter.forward = recorded
    try:
        audit_traffic(lm, log, progress=first_step, **options)
    finally:
        adapter.forward = forward
    return (started[0].ms / 1000 if started else 0.0), forwards


def _plain_pass(lm: LoadedModel, forwards: Sequence[_Forward], master: DynamicCache) -> float:
    """Plain transformers running the same forwards (SDPA, each over the first ``cached`` entries of ``master``): s."""
    model, device = lm.model, lm.device
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        watch = Stopwatch()
        with torch.no_grad():
            for step in forwards:
                layers = [(layer.keys[:, :, : step.cached], layer.values[:, :, : step.cached]) for layer in master.layers]
                cache = DynamicCache(ddp_cache_data=layers) if step.cached else DynamicCache()
                ids = torch.tensor([step.token_ids], device=device)
                positions = torch.arange(step.cached, step.cached + len(step.token_ids), device=device)[None]
                model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        return watch.ms / 1000
    finally:
        model.set_attn_implementation(implementation)


def _master_cache(lm: LoadedModel, length: int) -> DynamicCache:
    """A cache of ``length`` entries (what the plain replay crops each forward's cached entries from), not timed."""
    cache = DynamicCache()
    ids = torch.tensor([[lm.tokenizer.eos_token_id or 0] * max(length, 1)], device=lm.device)
    with torch.no_grad():
        lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _stems(text: str) -> list[str]:
    return [stem.strip() for stem in text.split(",") if stem.strip()]


def model_pass_ratio(lm: LoadedModel, name: str, args) -> dict:
    """One log: the audit's model pass and plain transformers doing its forwards, alternating, ``args.reps`` times."""
    log = read_log((LOGS / f"{name}.jsonl").read_text(encoding="utf-8"))
    options = {"measure": measure_settings(REPAIRS, args.tokens), "sample": args.sample}
    load_before = os.getloadavg()
    _, forwards = _recorded_pass(lm, log, options)  # also the warm-up
    if not forwards:  # no turn of this log is measurable: the audit runs no model pass
        return {"log": name, "forwards": 0, "forward_tokens": 0, "audit_s": None, "plain_s": None, "ratio": None, "ratio_of_medians": None}
    master = _master_cache(lm, max((step.cached for step in forwards), default=0))
    audits, plains = [], []
    for _ in range(args.reps):
        audits.append(_recorded_pass(lm, log, options)[0])
        plains.append(_plain_pass(lm, forwards, master))
    ratios = [a / p for a, p in zip(audits, plains)]
    return {
        "log": name,
        "forwards": len(forwards),
        "forward_tokens": sum(len(step.token_ids) for step in forwards),
        "audit_s": common.spread(audits, runs=True),
        "plain_s": common.spread(plains, runs=True),
        "ratio": common.spread(ratios, runs=True),
        "ratio_of_medians": round(statistics.median(audits) / statistics.median(plains), 3),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }


def app_times(spec: str, args) -> list[dict]:
    """Each bundled log through the app's audit handler (the tab's defaults; the model loaded first), in bfloat16."""
    from kvscope.app.handlers.your_prompt import AuditInputs, run_audit
    from kvscope.app.state import ModelRegistry, SessionStore

    registry, sessions = ModelRegistry(spec, dtype="bfloat16"), SessionStore()
    registry.get()
    rows = []
    for name in _stems(args.speed_logs):
        text = (LOGS / f"{name}.jsonl").read_text(encoding="utf-8")
        load_before, runs = os.getloadavg(), []
        for rep in range(args.app_reps):
            watch = Stopwatch()
            run_audit(registry, sessions, text, session=f"{name}-{rep}", inputs=AuditInputs(tokens=args.app_tokens))
            runs.append(watch.ms / 1000)
        rows.append({"log": name, "s": common.spread(runs, runs=True), "load_average_before": [round(x, 2) for x in load_before]})
        print(f"  app: {name} {statistics.median(runs):.1f} s", flush=True)
    return rows


def speed(args) -> dict:
    """The model-pass ratio per log and dtype, and the app's time per log; written beside the other results."""
    data = {"cpu": cpu_info(), "tokens": args.tokens, "sample": args.sample, "reps": args.reps, "goal_ratio": 1.3, "goal_app_s": 60}
    data["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
    data["model_pass"] = {}
    lm = None
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        lm = load_model(args.model, device=args.device, dtype=dtype, progress=print)
        rows = []
        for name in _stems(args.speed_logs):
            rows.append(model_pass_ratio(lm, name, args))
            print(f"  {dtype} {name}: {rows[-1]['forwards']} forwards, ratio {rows[-1]['ratio_of_medians']}", flush=True)
        data["model_pass"][dtype] = rows
    data["app"] = app_times(args.model, args) if args.app_reps else []
    data["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    path = common.write_result("audit_speed-" + "-".join(data["model_pass"]), lm, data, Path(args.out))
    print(f"-> {path}", flush=True)
    return data


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = _parser().parse_args(argv)
    if args.speed:
        return [speed(args)]
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
