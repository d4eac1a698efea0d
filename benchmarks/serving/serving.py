"""Serving benchmark: an append-only erratum vs an in-prefix edit on a real prefix-caching server, under load.

    bash scripts/build_llama_server.sh      # once: llama-server built from the pinned llama.cpp source
    python -m benchmarks.serving.serving [--scenario demos/scenarios/refund_gate.toml] [--model embedded|smollm2|FILE.gguf]
                                 [--policy-tokens 2048] [--loads 0.04,0.2,1.5] [--requests 30] [--threads 2]
    python -m benchmarks.serving.serving --workload composed [--loads 0.2]       # llama.cpp chunk reuse vs prefix only
    python -m benchmarks.serving.serving --engine vllm [--block-size 32] [--tag block32]   # vLLM's CPU build, started here
    python -m benchmarks.serving.serving --engine vllm --url http://127.0.0.1:8000 --model Qwen/Qwen2.5-7B-Instruct ...
    python -m benchmarks.serving.serving --engine lmcache --url ... --workload composed --clean-from serving-vllm-composed.json

The workload is a calibrated scenario (one whose decision follows its field under a clean prefill) scaled up:
the scenario's context (the field early, the rule after it) is followed by a long handbook (the bundled skills,
cut to ``--policy-tokens``) and then the scenario's question, so the decision at the end must come from what
the rule's tokens concluded about the field more than 2k tokens earlier. Requests alternate the field between its
old and new value. ``in_prefix`` writes the request's value into the context and a ``REQUEST n`` line right
after it, so every later token changes (a session's state at the head of its prompt); ``erratum`` keeps the
prompt byte-identical up to the end of the handbook (the old value in place) and appends ``REQUEST n`` and
``[STATE UPDATE] field -> value; ...`` before the question. ``field_erratum`` (the field's K/V edited in place
plus the erratum) is not a serving variant: no engine here can replace cached K/V in the middle of a prompt,
and writing the value into the text is the in-prefix edit (benchmarks/studies/keystone.py measures it in KVScope).

Before the sweep each value's in-prefix prompt is answered once, alone on an idle server (the clean-prefill
answer); the benchmark stops if those answers do not differ, since accuracy would then say nothing. For each
offered load (Poisson arrivals, ``benchmarks.serving.loadgen``) both variants run with the same arrival times and
values, each after one unmeasured warm-up request of its own variant; per run: TTFT percentiles with their
sample count, throughput, the prefix-cache hit rate and **accuracy**, the fraction of answers whose label equals
the clean-prefill answer's for that request's value. Agreement per variant (erratum vs in-prefix, each vs clean
and vs the scenario's expected answer) covers every load.

``--workload composed`` instead puts the bundled skills as blocks in a different order in every request before
the scenario: ``chunk_reuse`` (the engine reuses cached blocks wherever they now sit) vs ``prefix_only``.

Engines: ``llama-cpp`` (default) starts the C++ ``llama-server`` (one slot, its RAM prompt cache off) on a free
127.0.0.1 port; ``vllm`` without ``--url`` starts vLLM's CPU build (``scripts/vllm_cpu.sh``) the same way, with
``--block-size`` and a local model (``embedded`` or a model directory; benchmarks/serving/vllm_cpu_serving.sh runs
its sweep); ``vllm``, ``sglang`` and ``lmcache`` (vLLM with LMCache's CacheBlend) with ``--url`` drive a server
already running on loopback (benchmarks/serving/vllm_serving.sh, a GPU). Every run starts on an emptied prefix
cache. The hit rate is the requests' own ``usage.prompt_tokens_details.cached_tokens`` when every request reports
it, else the engine's Prometheus ``/metrics`` counters; where the engine has both, the counters' difference over the
run is kept beside it (``metrics_prefix_hit_rate``) as a cross-check. Prompts use the ChatML frame (Qwen2.5, SmolLM2).
Writes benchmarks/serving/results/serving-<engine>[-<tag>][-composed].json and .html (plot).

The parts: benchmarks/serving/serving_workload.py (the prompts), benchmarks/serving/serving_servers.py (the engines and GGUF files),
this module (the runs, the sweep, agreement, the headline and the command line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import PERCENTILE, results_dir
from benchmarks.serving.loadgen import (
    CacheCounters,
    Load,
    RequestResult,
    arrival_times,
    loopback_client,
    run_load,
    stream_completion,
    summarize,
    usage_counters,
)
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, OpenAIServer, VllmServer, local_model, payload, resolve_gguf
from benchmarks.serving.serving_workload import Engine, Variant, Workload, WorkloadError, build_workload, load_scenario
from kvscope.engine.timing import Stopwatch
from kvscope.viz.benchmarks import serving_figure

RESULTS = results_dir(__file__)
# Of 7 bundled demos, the one whose clean answer still follows its field behind a 2k handbook (embedded model).
DEFAULT_SCENARIO = "loan_approval"


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What one sweep sends."""

    loads: tuple[float, ...]
    requests: int
    max_duration_s: float
    max_tokens: int
    request_timeout_s: float
    seed: int


def send_one(engine: Engine, prompt: str, settings: Settings, options: dict[str, Any] | None = None) -> str:
    """One request on its own; its answer text."""

    async def send() -> str:
        async with loopback_client(settings.request_timeout_s) as client:
            body = payload(engine, prompt, settings.max_tokens, options)
            return (await stream_completion(client, engine.base_url, body)).text

    return asyncio.run(send())


@dataclass(frozen=True)
class PlannedRun:
    """One offered load's arrivals (s) and request values, the same for every variant."""

    load: Load
    arrivals: list[float]
    values: list[str]
    first: int  # index in ``Workload.values`` of the first request's value

    @property
    def requests(self) -> list[tuple[str, int]]:
        """(value, request number) of each request; numbers start at 1 (0 is the warm-up)."""
        return [(value, index + 1) for index, value in enumerate(self.values)]


def plan(workload: Workload, settings: Settings) -> list[PlannedRun]:
    """Poisson arrivals and alternating values per offered load, reproducible from the seed."""
    planned = []
    for index, rps in enumerate(settings.loads):
        load, seed = Load(rps, settings.requests, settings.max_duration_s), settings.seed + index
        arrivals = arrival_times(load, random.Random(seed))
        planned.append(PlannedRun(load, arrivals, workload.request_values(len(arrivals), first=seed % 2), seed % 2))
    return planned


def clean_answers(engine: Engine, workload: Workload, settings: Settings, requests: Sequence[tuple[str, int]]) -> dict[str, str]:
    """The clean-prefill answer text for every clean key these requests need, each prompt answered alone on an
    emptied cache (llama-server: without its cache; a prefix cache is exact). WorkloadError if every answer
    carries the same label, since accuracy would then not show whether a variant followed the field."""
    prompts = {workload.clean_key(value, request): workload.clean_prompt(value, request) for value, request in requests}
    engine.reset_cache()
    answers = {key: send_one(engine, prompt, settings, engine.clean_options()) for key, prompt in prompts.items()}
    return checked_clean(workload, answers, requests, engine.model)


def checked_clean(workload: Workload, answers: dict[str, str], requests: Sequence[tuple[str, int]], model: str) -> dict[str, str]:
    """``answers`` if they cover every request's clean key and do not all carry one label; else WorkloadError."""
    missing = sorted({workload.clean_key(value, request) for value, request in requests} - set(answers))
    if missing:
        raise WorkloadError(f"no clean-prefill answer for {len(missing)} request(s), e.g. {missing[0]!r}")
    if len({workload.label(text) for text in answers.values()}) < 2:
        shown = ", ".join(f"{workload.field}={key}: {text.strip()!r}" for key, text in list(answers.items())[:4])
        raise WorkloadError(
            f"the clean-prefill answer does not change with {workload.field} on {model} ({shown}); "
            "pick a scenario whose decision follows its field on this model, or a shorter --policy-tokens"
        )
    return answers


def recorded_clean(path: Path, workload: Workload, requests: Sequence[tuple[str, int]], model: str) -> dict[str, str]:
    """The clean-prefill answers of an earlier run on an exact engine (its ``agreement.clean_answers``), which
    must have sent the same prompts: same model, scenario, blocks and separator."""
    data = json.loads(path.read_text())
    mine = {"model": model, "scenario": workload.scenario.name, "blocks": len(workload.blocks), "separator": workload.separator}
    theirs = {key: data.get(key) for key in mine}
    if theirs != mine:
        raise WorkloadError(f"{path} was measured with {theirs}, this run has {mine}")
    return checked_clean(workload, data.get("agreement", {}).get("clean_answers", {}), requests, model)


def accuracy(workload: Workload, clean: dict[str, str], answered: Sequence[tuple[str, int, RequestResult]]) -> float | None:
    """Fraction of completed answers whose label equals their clean-prefill answer's."""
    done = [(value, request, result) for value, request, result in answered if result.error is None]
    if not done:
        return None
    right = sum(workload.label(result.text) == workload.label(clean[workload.clean_key(value, request)]) for value, request, result in done)
    return round(right / len(done), 4)


def run_variant(
    engine: Engine, workload: Workload, variant: Variant, planned: PlannedRun, settings: Settings, clean: dict[str, str]
) -> tuple[dict[str, Any], list[tuple[str, int, RequestResult]]]:
    """One measured run on an emptied cache after a warm-up request of its variant (request 0, the other value
    than the first request's); its row, and each request's value, number and result."""
    options = engine.request_options(variant)
    engine.reset_cache()
    send_one(engine, workload.prompt(variant, workload.values[1 - planned.first], 0), settings, options)
    payloads = [
        payload(engine, workload.prompt(variant, value, request), settings.max_tokens, options) for value, request in planned.requests
    ]
    before = engine.cache_counters()
    watch = Stopwatch()
    results = asyncio.run(run_load(engine.base_url, payloads, planned.arrivals, settings.request_timeout_s))
    wall_ms = watch.ms
    scraped = None if before is None or (after := engine.cache_counters()) is None else after.since(before)
    counters = usage_counters(results) or scraped
    hit_rate = _rate(counters)
    answered = [(value, request, result) for (value, request), result in zip(planned.requests, results, strict=True)]
    row = {
        "variant": variant.value,
        "offered_rps": planned.load.offered_rps,
        "arrival_rps": arrival_rate(planned.arrivals),
        **asdict(summarize(results)),
        "accuracy": accuracy(workload, clean, answered),
        "ttft_ms": [None if r.ttft_s is None else round(r.ttft_s * 1000, 1) for r in results],
        "prefix_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "prefix_hit_tokens": None if counters is None else counters.hits,
        "prompt_tokens": None if counters is None else counters.queries,
        "wall_s": round(wall_ms / 1000, 1),
    }
    if scraped is not None:  # the cross-check: the engine's own /metrics counters over the same run
        row["metrics_prefix_hit_rate"] = None if (rate := _rate(scraped)) is None else round(rate, 4)
        row["metrics_prefix_hit_tokens"] = scraped.hits
    if hit_rate is None:
        row["prefix_hit_rate_gauge"] = engine.cache_hit_rate_gauge()
    return row, answered


def _rate(counters: CacheCounters | None) -> float | None:
    return counters.hits / counters.queries if counters is not None and counters.queries > 0 else None


def agreement(
    workload: Workload, clean: dict[str, str], answered: dict[Variant, list[tuple[str, int, RequestResult]]], sample: int
) -> dict[str, Any]:
    """Every request over every load: each variant vs the clean-prefill answer and (where the scenario states
    one) its expected answer, and (two variants) the same request under both; ``pairs`` counts requests every
    variant completed."""
    label, variants = workload.label, list(answered)
    rows = []
    for same in zip(*answered.values(), strict=True):
        if len({(value, request) for value, request, _ in same}) != 1:
            raise ValueError(f"variants answered different requests: {[(value, request) for value, request, _ in same]}")
        rows.append(
            {
                "value": same[0][0],
                "clean": clean[workload.clean_key(same[0][0], same[0][1])],
                **{variant: result.text for variant, (_, _, result) in zip(variants, same, strict=True)},
                "done": all(result.error is None for _, _, result in same),
            }
        )
    done = [row for row in rows if row["done"]]

    def rate(rows: list[dict], matches: Callable[[dict], bool]) -> float | None:
        return round(sum(matches(row) for row in rows) / len(rows), 4) if rows else None

    expected = [row for row in done if workload.expected(row["value"]) is not None]
    report: dict[str, Any] = {"pairs": len(done), "clean_answers": dict(clean)}
    if len(variants) == 2:
        first, second = variants
        report[f"{first.value}_vs_{second.value}"] = rate(done, lambda row: label(row[first]) == label(row[second]))
    for variant in variants:
        report[f"{variant.value}_vs_clean"] = rate(done, lambda row, v=variant: label(row[v]) == label(row["clean"]))
    report["clean_vs_expected"] = rate(expected, lambda row: label(row["clean"]) == workload.expected(row["value"]))
    for variant in variants:
        report[f"{variant.value}_vs_expected"] = rate(expected, lambda row, v=variant: label(row[v]) == workload.expected(row["value"]))
    report["sample"] = [{"value": row["value"], "clean": row["clean"], **{v.value: row[v] for v in variants}} for row in done[:sample]]
    return report


def sweep(
    engine: Engine,
    workload: Workload,
    variants: Sequence[Variant],
    settings: Settings,
    progress: Callable[[str], None],
    clean_from: Path | None = None,
) -> dict[str, Any]:
    """The clean-prefill answers (measured, or recorded by an exact engine in ``clean_from``), then each variant
    at every offered load (the same arrivals and values per load); runs, agreement and headline.

    All runs of the first (cheap) variant come first: the shared text then stays in a one-slot cache (llama.cpp)
    between them.
    """
    planned = plan(workload, settings)
    requests = [request for run in planned for request in run.requests]
    if clean_from is not None:
        clean = recorded_clean(clean_from, workload, requests, engine.model)
    else:
        clean = clean_answers(engine, workload, settings, requests)
    progress(f"{len(clean)} clean-prefill answers: " + ", ".join(f"{key} -> {text.strip()!r}" for key, text in list(clean.items())[:4]))
    runs, answered = [], {variant: [] for variant in variants}
    for variant in variants:
        for run in planned:
            row, results = run_variant(engine, workload, variant, run, settings, clean)
            runs.append(row)
            answered[variant].extend(results)
            progress(
                f"{run.load.offered_rps:>6} rps {variant.value:>11}: {row['completed']}/{row['requests']} done, "
                f"accuracy {row['accuracy']}, "
                f"TTFT p50 {row['ttft_p50_ms']} ms p90 {row['ttft_p90_ms']} ms, "
                f"{row['throughput_rps']} rps, prefix hit {row['prefix_hit_rate']}"
            )
    return {"runs": runs, "agreement": agreement(workload, clean, answered, sample=8), "summary": headline(runs)}


def arrival_rate(arrivals: Sequence[float]) -> float | None:
    """The run's own arrival rate (requests/s between its first and last arrival): a Poisson sample of 30 is
    often 20% off the offered load, so keeping up is judged against this."""
    return round((len(arrivals) - 1) / (arrivals[-1] - arrivals[0]), 4) if len(arrivals) > 1 and arrivals[-1] > arrivals[0] else None


def saturation_rps(rows: Sequence[dict[str, Any]]) -> float | None:
    """The lowest offered load a variant no longer keeps up with (completed requests/s under 90% of the run's
    arrival rate; a run of one arrival cannot tell), if any."""
    for row in sorted(rows, key=lambda row: row["offered_rps"]):
        if row["arrival_rps"] and (row["throughput_rps"] or 0.0) < 0.9 * row["arrival_rps"]:  # none completed: saturated
            return row["offered_rps"]
    return None


def headline(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """At the highest offered load: each variant's hit rate and accuracy and, for two variants (cheap first),
    the second / first p90 TTFT ratio and the first / second throughput ratio; where each variant saturates."""
    top = max(row["offered_rps"] for row in runs)
    variants = list(dict.fromkeys(row["variant"] for row in runs))
    at_top = {row["variant"]: row for row in runs if row["offered_rps"] == top}

    def ratio(numerator: float | None, denominator: float | None) -> float | None:
        return round(numerator / denominator, 1) if numerator and denominator else None

    summary: dict[str, Any] = {"offered_rps": top}
    for variant in variants:
        summary[f"{variant}_prefix_hit_rate"] = at_top[variant]["prefix_hit_rate"]
    for variant in variants:
        summary[f"{variant}_accuracy"] = at_top[variant]["accuracy"]
    if len(variants) == 2:
        cheap, reference = at_top[variants[0]], at_top[variants[1]]
        summary[f"p90_ttft_ratio_{variants[1]}_over_{variants[0]}"] = ratio(reference["ttft_p90_ms"], cheap["ttft_p90_ms"])
        summary[f"throughput_ratio_{variants[0]}_over_{variants[1]}"] = ratio(cheap["throughput_rps"], reference["throughput_rps"])
    summary["saturation_rps"] = {variant: saturation_rps([row for row in runs if row["variant"] == variant]) for variant in variants}
    return summary


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def benchmark(
    engine: Engine, workload: Workload, settings: Settings, progress: Callable[[str], None], clean_from: Path | None = None
) -> dict:
    """Sweep the workload's variants (for composed prompts, the ones this engine has); the result document."""
    variants = workload.variants if workload.kind == "edit" else engine.composed_variants()
    progress(
        f"{workload.kind} workload: {workload.policy_tokens} shared tokens; variants {[v.value for v in variants]}; "
        f"loads {settings.loads} rps, {settings.requests} requests each"
    )
    return {
        "engine": engine.name,
        "model": engine.model,
        "workload": workload.kind,
        "scenario": workload.scenario.name,
        "field": workload.field,
        "values": list(workload.values),
        "policy_tokens": workload.policy_tokens,
        "blocks": len(workload.blocks),
        "separator": workload.separator,
        "prompt_tokens": {v.value: engine.count_tokens(workload.prompt(v, workload.values[1], 1)) for v in variants},
        "engine_settings": engine.settings(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "settings": asdict(settings),
        "percentile": PERCENTILE,
        "clean_source": str(clean_from) if clean_from is not None else "measured on this engine before the sweep",
        **sweep(engine, workload, variants, settings, progress, clean_from),
    }


def write(data: dict[str, Any]) -> Path:
    """benchmarks/serving/results/serving-<engine>[-composed].json and its plot (.html)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = f"-{data['tag']}" if data.get("tag") else ""
    suffix = "" if data.get("workload", "edit") == "edit" else f"-{data['workload']}"
    path = RESULTS / f"serving-{data['engine']}{tag}{suffix}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    serving_figure(data).write_html(path.with_suffix(".html"), include_plotlyjs="cdn")
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine",
        choices=("llama-cpp", "vllm", "sglang", "lmcache"),
        default="llama-cpp",
        help="lmcache: vLLM with LMCache's CacheBlend connector (composed workload, needs --clean-from)",
    )
    parser.add_argument("--workload", choices=("edit", "composed"), default="edit")
    parser.add_argument("--model", default="embedded", help="llama-cpp: embedded|smollm2|FILE.gguf, else served name")
    parser.add_argument("--url", help="vllm/sglang/lmcache: the running server, on loopback")
    parser.add_argument("--scenario", default=DEFAULT_SCENARIO, help="bundled scenario name or scenario file")
    parser.add_argument("--policy-tokens", type=int, default=2048)
    parser.add_argument("--loads", default="0.04,0.2,1.5", help="offered loads, requests/s")
    parser.add_argument("--requests", type=int, default=30, help="requests per run (upper bound)")
    parser.add_argument("--max-duration", type=float, default=1200.0, help="arrival window per run, s (upper bound)")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--request-timeout", type=float, default=1800.0)
    parser.add_argument("--threads", type=int, default=2, help="llama-cpp: threads for prompt and generation")
    parser.add_argument("--server", default=str(SERVER_BINARY), help="llama-cpp: the llama-server binary")
    parser.add_argument("--reuse-chunk", type=int, default=16, help="llama-cpp chunk_reuse: shortest chunk it shifts")
    parser.add_argument("--separator", default="\n\n", help="composed: text between blocks (LMCache: its blend_special_str)")
    parser.add_argument("--clean-from", type=Path, help="clean-prefill answers recorded by an exact engine's run")
    parser.add_argument("--block-size", type=int, default=32, help="vllm without --url: the block size it is started with")
    parser.add_argument("--tag", default="", help="added to the result's file name: serving-<engine>[-<tag>][-composed].json")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.engine not in ("llama-cpp", "vllm") and not args.url:
        parser.error(f"--engine {args.engine} needs --url of the running server (and --model, its served name)")
    if args.block_size % 32 and args.engine == "vllm" and not args.url:
        parser.error(f"--block-size {args.block_size}: vLLM's CPU backend takes a multiple of 32")
    if args.engine == "lmcache" and (args.workload != "composed" or args.clean_from is None):
        parser.error("--engine lmcache runs --workload composed with --clean-from (CacheBlend's own answers are not clean)")
    return args


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    settings = Settings(
        loads=tuple(float(x) for x in args.loads.split(",")),
        requests=args.requests,
        max_duration_s=args.max_duration,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    scenario = load_scenario(args.scenario)
    try:
        if args.engine == "llama-cpp":
            gguf, model = resolve_gguf(args.model)
            n_ctx = (max(args.policy_tokens, 2048) + 1024 + 255) // 256 * 256
            RESULTS.mkdir(parents=True, exist_ok=True)
            log = RESULTS / f"{LlamaServer.name}-server.log"
            with LlamaServer(Path(args.server), gguf, n_ctx, args.threads, log, model, args.reuse_chunk) as server:
                workload = build_workload(server, scenario, args.workload, args.policy_tokens, args.separator)
                data = benchmark(server, workload, settings, _progress, args.clean_from)
        elif args.engine == "vllm" and not args.url:
            model_dir, model = local_model(args.model)
            log = RESULTS / f"vllm-{args.block_size}-server.log"
            max_model_len = (args.policy_tokens + 2048 + 1023) // 1024 * 1024  # the handbook, the scenario and the answer
            with VllmServer(model_dir, log, block=args.block_size, name=model, max_model_len=max_model_len) as server:
                workload = build_workload(server, scenario, args.workload, args.policy_tokens, args.separator)
                data = benchmark(server, workload, settings, _progress, args.clean_from)
        else:
            engine = OpenAIServer(args.engine, args.url, args.model)
            workload = build_workload(engine, scenario, args.workload, args.policy_tokens, args.separator)
            data = benchmark(engine, workload, settings, _progress, args.clean_from)
    except WorkloadError as error:
        raise SystemExit(f"serving benchmark: {error}") from None
    data["tag"] = args.tag
    path = write(data)
    _progress(f"wrote {path}: {json.dumps(data['summary'])}")
    return path


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
