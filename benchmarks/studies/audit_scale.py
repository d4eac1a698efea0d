"""The audit's token pass at traffic scale: synthetic logs of agent requests (1.5–2k tokens, tools and tool calls, a clock
line in the system prompt) from 50 interleaved sessions, 1,000 and 10,000 requests.

    python -m benchmarks.studies.audit_scale [--sizes 1000,10000] [--sessions 50] [--budget-tokens 2500] [--tokenizer DIR]
        [--out benchmarks/studies/results]

Each size is written to a JSONL log and, unbounded and again under a KV budget (SGLang ``--budget-tokens``, vLLM as
many tokens in blocks), its token pass (``kvscope.engine.audit.scan.traffic_scan.scan_log``: render, match, fields,
causes and the three simulated engines; no model forward) runs in a fresh process, which reports its wall time and
peak RSS. Where ``kvlint`` is installed its ``analyze`` runs on the same log with the same tokenizer, in its own
process, timed the same way (optional: the reason is written when it is not run).

Exports: the 10,000-request log is also written as a Langfuse trace export (one trace per session, holding the
whole session) and as an OpenTelemetry collector's OTLP/JSON file (GenAI spans in batches of 512, shuffled), and
the token pass (read_log included: parsing, time order) runs on each and on the plain OpenAI JSONL, interleaved,
``--export-repeats`` times each in fresh processes; min/median/max wall and CPU seconds per format, each export's
median over the JSONL's, and whether every format gave the same requests, tokens and reuse. Goal: at most 1.5x.

Writes benchmarks/studies/results/audit_scale-cpu.json.

Memory (``--memory 10000,100000,1000000 [--memory-budgets 0,2500,gpu:80] [--logs DIR]``): one process's peak RSS on
the generated log at each size under each budget (unbounded, N tokens, or the budgets vLLM and SGLang compute on a GPU
of G GiB; llama.cpp's RAM prompt cache at its 8 GiB default throughout), each in a fresh process, with what each
engine's cache held at the end; then ``python -m kvscope audit LOG --sample 0 --json`` with the same budget's flags,
the whole command a user runs, its own peak RSS (``--logs``: where the logs are written and reused, a million requests
is about 7 GB, with each run's result beside its log, reused until deleted).
Writes benchmarks/studies/results/audit_scale_memory-cpu.json, keeping the runs of sizes not measured this time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

from benchmarks import common
from benchmarks.common import cpu_info, percentile
from kvscope.engine.audit.simulate.budgets import ModelKV, ServerSize
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.models import cache_dir

POLICY = (
    "Rule {n}: when a customer asks about order {n}, check the ledger entry, confirm the shipping status, and reply in "
    "one short paragraph; never promise a refund above the account tier's limit, and escalate disputes to a human.\n"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the shop's systems",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
        },
    }
    for name in ("lookup_order", "search_ledger", "refund", "escalate")
]


START = datetime(2026, 5, 12, 9, 0)
STEP = timedelta(seconds=20)  # between requests of the log: the clock line never repeats, about 3 requests a minute
RULES = 21  # policy lines of the shared system prompt (about 1,200 tokens with the tools and the template)
HISTORY_CHARS = 850  # a session's task restarts once its messages pass this (requests stay within 1.5–2k tokens)


def synthetic_log(requests: int, sessions: int, seed: int = 0) -> list[dict]:
    """``synthetic_records`` as a list."""
    return list(synthetic_records(requests, sessions, seed))


def synthetic_records(requests: int, sessions: int, seed: int = 0) -> Iterator[dict]:
    """Agent traffic: per session a system prompt (a clock line to the minute, and a policy shared by every
    session), the tools, and turns with tool calls and results growing to ~2k tokens, then a fresh task (whose first
    request carries a task brief, so no request is under ~1.5k tokens); sessions interleaved at random, one request
    every ``STEP`` of a clock that only moves forward."""
    rng = random.Random(seed)
    policy = "".join(POLICY.format(n=n) for n in range(RULES))
    turns: dict[int, list[dict]] = {s: [] for s in range(sessions)}
    for number in range(requests):
        s = rng.randrange(sessions)
        history = turns[s]
        if not history or sum(len(m.get("content") or "") for m in history) > HISTORY_CHARS:
            order = rng.randrange(10**6)
            notes = [f"Earlier note {k}: order {order} was packed at depot {rng.randrange(90)} and scanned once.\n" for k in range(6)]
            brief = "".join(notes)
            history[:] = [{"role": "user", "content": f"{brief}Order {order} has not arrived. What now?"}]
        else:
            call = f"call_{number}"
            history += [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call,
                            "type": "function",
                            "function": {
                                "name": rng.choice(TOOLS)["function"]["name"],
                                "arguments": json.dumps({"query": f"order {number}", "limit": 5}),
                            },
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": call,
                    "content": f"status: shipped on 2026-05-{1 + number % 28:02d}; carrier ref {rng.getrandbits(40):x}",
                },
                {"role": "assistant", "content": "It shipped; the carrier has it."},
                {"role": "user", "content": rng.choice(["When will it arrive?", "Can I get a refund?", "Thanks, and the other order?"])},
            ]
        clock = f"The current time is {(START + number * STEP):%Y-%m-%d %H:%M}."
        system = f"You are Harbor, the shop's support agent.\n{clock}\n\n{policy}"
        yield {"model": "harbor", "user": f"session-{s}", "tools": TOOLS, "messages": [{"role": "system", "content": system}, *history]}


def write_log(path: Path, requests: int, sessions: int) -> Path:
    """The generated log written as JSONL, a record at a time (a million requests is about 7 GB)."""
    with path.open("w", encoding="utf-8") as stream:
        for record in synthetic_records(requests, sessions):
            stream.write(json.dumps(record) + "\n")
    return path


EXPORT_SIZE = 10_000
EXPORT_GOAL = 1.5  # an export's token pass at most this many times the OpenAI JSONL's
OTLP_BATCH = 512  # spans per OTLP/JSON line, as a collector's batch processor sends them


def _iso(number: int) -> str:
    return f"{(START + number * STEP):%Y-%m-%dT%H:%M:%S}.000Z"


def as_langfuse_traces(records: list[dict]) -> str:
    """The log as Langfuse traces, one a line: one trace per session holding all its GENERATION observations (input
    ``{"messages", "tools"}``, as Langfuse's OpenAI integration records it)."""
    traces: dict[str, dict] = {}
    for number, record in enumerate(records):
        session = record["user"]
        trace = traces.setdefault(session, {"id": f"trace-{session}", "sessionId": session, "timestamp": _iso(number), "observations": []})
        trace["observations"].append(
            {
                "id": f"obs-{number}",
                "traceId": trace["id"],
                "type": "GENERATION",
                "startTime": _iso(number),
                "model": record["model"],
                "input": {"messages": record["messages"], "tools": record["tools"]},
                "usageDetails": {"input": 1500, "output": 20},
            }
        )
    return "\n".join(json.dumps(trace) for trace in traces.values())


def _parts(message: dict) -> dict:
    """An OpenAI chat message in the GenAI semantic conventions' role + parts schema."""
    if message["role"] == "tool":
        return {"role": "tool", "parts": [{"type": "tool_call_response", "id": message["tool_call_id"], "response": message["content"]}]}
    parts = [{"type": "text", "content": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        arguments = json.loads(call["function"]["arguments"])
        parts.append({"type": "tool_call", "id": call["id"], "name": call["function"]["name"], "arguments": arguments})
    return {"role": message["role"], "parts": parts}


def as_otlp(records: list[dict], seed: int = 0) -> str:
    """The log as a collector's OTLP/JSON file: one chat span per request (system instructions, input messages and
    tool definitions as JSON text, 64-bit ints as text), shuffled into batches of ``OTLP_BATCH``, one a line."""

    def attribute(key: str, value: str | int) -> dict:
        return {"key": key, "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}}

    spans = []
    for number, record in enumerate(records):
        system, *messages = record["messages"]
        start = int((START + number * STEP).timestamp()) * 10**9
        attributes = [
            attribute("gen_ai.operation.name", "chat"),
            attribute("gen_ai.request.model", record["model"]),
            attribute("gen_ai.conversation.id", record["user"]),
            attribute("gen_ai.usage.input_tokens", 1500),
            attribute("gen_ai.system_instructions", json.dumps([{"type": "text", "content": system["content"]}])),
            attribute("gen_ai.input.messages", json.dumps([_parts(message) for message in messages])),
            attribute("gen_ai.tool.definitions", json.dumps([{"type": "function", **tool["function"]} for tool in record["tools"]])),
        ]
        spans.append(
            {
                "traceId": f"{number:032x}",
                "spanId": f"{number:016x}",
                "name": "chat",
                "startTimeUnixNano": str(start),
                "attributes": attributes,
            }
        )
    random.Random(seed).shuffle(spans)
    scope = {"scope": {"name": "benchmark"}}
    batches = [
        {"resourceSpans": [{"resource": {}, "scopeSpans": [{**scope, "spans": spans[i : i + OTLP_BATCH]}]}]}
        for i in range(0, len(spans), OTLP_BATCH)
    ]
    return "\n".join(json.dumps(batch) for batch in batches)


EXPORT_WRITERS = {
    "openai_jsonl": lambda records: "\n".join(json.dumps(record) for record in records),
    "langfuse_trace": as_langfuse_traces,
    "otel": as_otlp,
}


def _exports(folder: Path, tokenizer_dir: Path, sessions: int, repeats: int) -> dict:
    """Each format's token pass on the same generated requests, ``repeats`` times, the formats interleaved (so a
    change of load hits them alike): min/median/max wall and CPU seconds, each median over the JSONL's, and whether every
    format gave the same requests, tokens, sessions and reuse."""
    records = synthetic_log(EXPORT_SIZE, sessions)
    paths = {}
    for name, writer in EXPORT_WRITERS.items():
        paths[name] = folder / f"agents-{EXPORT_SIZE}-{name}.jsonl"
        paths[name].write_text(writer(records), encoding="utf-8")
    runs: dict[str, list[dict]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, path in paths.items():
            run = _measured([sys.executable, "-m", "benchmarks.studies.audit_scale", "--worker", str(path), str(tokenizer_dir), "0"])
            if run["code"] != 0:
                raise SystemExit(f"the token pass failed on the {name} export: {run['stderr']}")
            runs[name].append(json.loads(run["stdout"]))
            print(f"{name}: {runs[name][-1]['seconds']} s", file=sys.stderr)
    keys = ("requests", "tokens", "sessions", "groups", "engines", "causes")
    summary = {}
    for clock in ("seconds", "cpu_seconds"):  # wall time, and the process's CPU time (less moved by others' load)
        values = {name: [run[clock] for run in found] for name, found in runs.items()}
        medians = {name: percentile(v, 50) for name, v in values.items()}
        summary[clock] = {name: {"min": min(v), "median": round(medians[name], 2), "max": max(v), "runs": v} for name, v in values.items()}
        summary[f"{clock}_median_over_openai_jsonl"] = {name: round(medians[name] / medians["openai_jsonl"], 3) for name in paths}
        summary[f"{clock}_goal_met"] = all(medians[name] <= EXPORT_GOAL * medians["openai_jsonl"] for name in paths)
    return {
        "requests": EXPORT_SIZE,
        "repeats": repeats,
        "bytes": {name: path.stat().st_size for name, path in paths.items()},
        **summary,
        "goal": f"each export at most {EXPORT_GOAL}x the OpenAI JSONL's token pass",
        "same_results": all(
            {k: run[k] for k in keys} == {k: runs["openai_jsonl"][0][k] for k in keys} for found in runs.values() for run in found
        ),
        "order": {name: found[0]["order"] for name, found in runs.items()},
        "formats": {name: found[0]["formats"] for name, found in runs.items()},
    }


def _embedded_tokenizer_dir() -> Path:
    converted = cache_dir() / "converted"
    found = sorted(p for p in converted.glob("*") if (p / "tokenizer.json").exists()) if converted.exists() else []
    if not found:
        raise SystemExit(f"no converted embedded model with a tokenizer under {converted}: load --model embedded once first")
    return found[0]


NOTES = {
    "matching": "matching honours the SGLang budget: each request is matched in the same radix tree that evicts, so a "
    "request evicted whole is no longer a match and one evicted down to its head is matched by its head (its "
    "common_prefix_tokens is still the token-level common prefix with the whole matched request)",
    "eviction": "SGLang eviction pops least recently used leaves from a heap kept as leaves appear (stale entries "
    "skipped), not a walk of the tree; vLLM evicts from an LRU-ordered dict",
    "tokenization": "rendered texts are cut at line starts and each distinct line is tokenized once; exact for "
    "byte-level BPE tokenizers (probed when the encoder is built, each batch's first text checked whole, and "
    "exact_check compares every 10th request whole after the timed pass)",
    "hit_rate_vs_kvlint": "kvlint reuses almost exactly the same tokens but renders each message with its role and "
    "content only (its Message model drops tool_calls and tool_call_id), so its requests are shorter by their tool "
    "calls (the sum of its prompt_tokens equals apply_chat_template on the messages stripped of tool_calls, checked on "
    "the 1,000-request log) and the same reuse gives it a higher hit rate",
    "budget_vs_kvlint": "a budget that holds one request (2,500 tokens here) changes neither tool's reuse on this log, "
    "whose hits come from the last request or two; under a budget smaller than one request (tried at 1,000 tokens) they "
    "part: kvlint never evicts the request just served (as an engine's reference counts would not), we evict down to "
    "the budget including it (SGLang then reuses nothing, vLLM keeps its head blocks)",
}
EXACT_EVERY = 10  # after the timed pass, every 10th request is tokenized whole and compared with the fast path's
EXACT_CHECKED = 1_000  # at most about this many (spread over the log): each is rendered again


def _cache_settings(tokenizer_dir: Path, budget: str | int) -> CacheSettings:
    """The simulated caches' settings for a budget: 0 unbounded; N that SGLang token budget and the vLLM block budget
    holding as many tokens; ``gpu:G`` the budgets vLLM and SGLang compute on one GPU of G GiB (``--gpu-memory-gib``).
    With the model's KV shape, which sizes llama.cpp's RAM prompt cache (8 GiB of it)."""
    config = tokenizer_dir / "config.json"
    model = ModelKV.of_config(json.loads(config.read_text()), tokenizer_dir.name) if config.exists() else None
    spec = str(budget)
    if spec.startswith("gpu:"):
        return CacheSettings(model=model, server=ServerSize(model, gpu_gib=float(spec.removeprefix("gpu:"))))
    tokens = int(spec)
    return CacheSettings(model=model, **({"budget_tokens": tokens, "budget_blocks": tokens // 16} if tokens else {}))


def _progress_line(done: int, total: int) -> None:
    """A worker's progress on stderr: requests simulated, and the peak RSS so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{time.strftime('%H:%M:%S')} {done:,}/{total:,} requests, peak {peak:,.0f} MB", file=sys.stderr, flush=True)


def _worker(log: str, tokenizer_dir: str, budget: str) -> None:
    """One token pass in this process under ``budget`` (``_cache_settings``), the log read as the CLI reads it
    (``LogFiles.log``: a large file streamed), its progress and peak RSS so far on stderr: its time, peak RSS, what
    each engine's cache held at the end, and its results as JSON on stdout, then an exactness
    check of the line-cut tokenization on up to ``EXACT_CHECKED`` requests spread over the log (untimed)."""
    from transformers import AutoTokenizer

    from kvscope.engine.audit.logs.render import TextEncoder
    from kvscope.engine.audit.logs.shards import LogFiles
    from kvscope.engine.audit.scan.settings import ScanSettings
    from kvscope.engine.audit.scan.traffic_scan import scan_log

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cache = _cache_settings(Path(tokenizer_dir), budget)
    settings = ScanSettings(cache)
    before = _rss_mb()
    start, cpu_start = time.perf_counter(), time.process_time()
    log = LogFiles.of([log]).log
    read_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    scan = scan_log(tokenizer, log, settings, progress=_progress_line)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = scan.requests
    checked = [scan.rendered[row.request] for row in rows[:: max(len(rows) // EXACT_CHECKED, EXACT_EVERY)]]
    whole = tokenizer.backend_tokenizer.encode_batch([item.text for item in checked], add_special_tokens=False)
    tokens = sum(r.tokens for r in rows)
    print(
        json.dumps(
            {
                "seconds": round(seconds, 2),
                "cpu_seconds": round(cpu_seconds, 2),
                "peak_rss_mb": round(peak, 1),
                "rss_before_mb": round(before, 1),
                "peak_rss_mb_after_reading": round(read_peak, 1),
                "bytes_per_request_over_start": round((peak - before) * 2**20 / max(len(rows), 1)),
                "settings": settings.cache.as_dict(),
                "caches_held_tokens": scan.cache_tokens,
                "caches_held_share_of_log_tokens": {name: round(held / max(tokens, 1), 4) for name, held in scan.cache_tokens.items()},
                "requests": len(rows),
                "tokens": tokens,
                "min_tokens": min(r.tokens for r in rows),
                "max_tokens": max(r.tokens for r in rows),
                "sessions": len(scan.sessions()),
                "groups": len(scan.groups()),
                "engines": scan.totals().as_dict(),
                "causes": {name: count.as_dict() for name, count in scan.cause_counts().items()},
                "formats": log.formats,
                "order": log.order,
                "line_cut_tokenization": TextEncoder(tokenizer).by_lines,
                "exact_check": {
                    "requests_checked": len(checked),
                    "ids_and_offsets_equal": all(
                        item.token_ids.tolist() == encoding.ids and item.offsets.tolist() == [list(p) for p in encoding.offsets]
                        for item, encoding in zip(checked, whole)
                    ),
                },
            }
        )
    )


def _measured(command: list[str]) -> dict:
    """Wall time and peak RSS of a command run in a child process."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child so far
    return {
        "seconds": round(seconds, 2),
        "peak_rss_mb_upper_bound": round(peak, 1),
        "code": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr[-2000:],
    }


def _kvlint(log: Path, tokenizer_dir: Path, folder: Path, budget_tokens: int) -> dict:
    """kvlint's ``analyze`` on the same log and tokenizer (with the same budgets), timed in its own process; its
    per-engine hit rate, prompt tokens and cached tokens (per request, it counts what our engines call reused)."""
    executable = shutil.which("kvlint")
    if executable is None:
        return {"run": False, "reason": "kvlint is not installed (pip install kvlint)"}
    out = folder / f"{log.stem}-{budget_tokens}-kvlint.json"
    budgets = ["--kv-budget-tokens", str(budget_tokens), "--kv-budget-blocks", str(budget_tokens // 16)] if budget_tokens else []
    run = _measured([executable, "analyze", str(log), "--model", str(tokenizer_dir), "--json", str(out), *budgets])
    if run["code"] != 0:
        return {"run": False, "reason": f"kvlint analyze exited {run['code']}: {run['stderr'][-600:]}"}
    report = json.loads(out.read_text())
    engines = {
        sim["engine"]: {
            "hit_rate": round(sim["hit_rate"], 4),
            "prompt_tokens": sum(r["prompt_tokens"] for r in sim["per_request"]),
            "cached_tokens": sum(r["cached_tokens"] for r in sim["per_request"]),
            "config": sim["config"],
        }
        for sim in report["sims"]
    }
    return {
        "run": True,
        "version": report.get("version"),
        "seconds": run["seconds"],
        "peak_rss_mb_upper_bound": run["peak_rss_mb_upper_bound"],
        "engines": engines,
        "findings": len(report.get("findings") or []),
    }


def _pass(log: Path, tokenizer_dir: Path, folder: Path, budget_tokens: int) -> dict:
    """Our token pass and kvlint's analyze on one log, one after the other, each in a fresh process."""
    run = _measured([sys.executable, "-m", "benchmarks.studies.audit_scale", "--worker", str(log), str(tokenizer_dir), str(budget_tokens)])
    if run["code"] != 0:
        raise SystemExit(f"the token pass failed on {log.name}: {run['stderr']}")
    kvscope = json.loads(run["stdout"])
    kvlint = _kvlint(log, tokenizer_dir, folder, budget_tokens)
    print(
        f"{log.name}, budget {budget_tokens or 'none'}: token pass {kvscope['seconds']} s, {kvscope['peak_rss_mb']} MB; kvlint "
        + (f"{kvlint['seconds']} s" if kvlint.get("run") else kvlint["reason"]),
        file=sys.stderr,
    )
    return {"kvscope_token_pass": kvscope, "kvlint_analyze": kvlint}


def _scale_worker(mode: str, log: str, tokenizer_dir: str, workers: int) -> None:
    """One token pass of ``audit_scale_ray``'s comparison in this process (``mode``: single or ray): its seconds, peak RSS, the RSS
    before the pass, and its totals (to check that both gave the same) as JSON on stdout."""
    from transformers import AutoTokenizer

    from kvscope.engine.audit.logs.shards import LogFiles, read_logs
    from kvscope.engine.audit.scan.settings import ScanSettings
    from kvscope.engine.audit.scan.traffic_scan import scan_log

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = ScanSettings(_cache_settings(Path(tokenizer_dir), 0))  # as the CLI runs: unbounded, llama.cpp's RAM cache at 8 GiB
    started = 0.0
    if mode == "ray":
        from kvscope.engine.audit.distributed.ray_scan import ray_scan
        from kvscope.engine.audit.distributed.ray_setup import start_ray

        begin = time.perf_counter()
        start_ray("local", workers)
        started = time.perf_counter() - begin
    before = _rss_mb()
    start = time.perf_counter()
    if mode == "ray":
        scan = ray_scan(tokenizer, LogFiles.of([log]), settings, workers=workers)
    else:
        scan = scan_log(tokenizer, read_logs([log]), settings)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "seconds": round(seconds, 2),
                "ray_init_seconds": round(started, 2),
                "rss_before_mb": round(before, 1),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "requests": len(scan.requests),
                "totals": scan.totals().as_dict(),
                "causes": {name: count.as_dict() for name, count in scan.cause_counts().items()},
                "groups": len(scan.groups()),
            }
        )
    )


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def stage2_memory(size: int, sessions: int, tokenizer_dir: Path, budget_tokens: int = 0) -> dict:
    """What the Ray pass's driver keeps per request (stage 2: rows, diffs, places, the engines' caches), measured with
    tracemalloc in one process: stage 1's shards made here (no Ray) and fed to the driver one at a time, as in the run,
    each shard's records dropped once fed (``budget_tokens``: the SGLang budget, and as many tokens in vLLM blocks)."""
    import tracemalloc

    from transformers import AutoTokenizer

    from kvscope.engine.audit.distributed.ray_scan import _Driver
    from kvscope.engine.audit.distributed.shard_tokens import ShardTokenPass
    from kvscope.engine.audit.logs.render import end_of_turn_ids
    from kvscope.engine.audit.logs.shards import plan_shards
    from kvscope.engine.audit.scan.settings import ScanSettings

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cache = _cache_settings(Path(tokenizer_dir), budget_tokens)
    settings = ScanSettings(cache)
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "agents.jsonl"
        log.write_text("\n".join(json.dumps(record) for record in synthetic_log(size, sessions)) + "\n", encoding="utf-8")
        worker = ShardTokenPass(tokenizer, "auto", settings, "embedded", {})  # no Langfuse traces to join
        tracemalloc.start()
        driver, first, tokens = _Driver(settings, end_of_turn_ids(tokenizer)), 1, 0
        for number, shard in enumerate(plan_shards([log])):
            part = worker.tokens(number, shard, first, None)  # the synthetic log is in time order
            first += len(part.records)
            tokens += sum(len(record.ids) for record in part.records)
            driver.feed(part.records)
            del part
        kept, _ = tracemalloc.get_traced_memory()
        caches = _deep_bytes(driver.simulation.engines)  # the simulated caches the driver holds
        tracemalloc.stop()
    return {
        "requests": size,
        "mean_tokens": round(tokens / size),
        "settings": settings.cache.as_dict(),
        "driver_bytes_per_request": round(kept / size),
        "caches_bytes_per_request": round(caches / size),
    }


def _deep_bytes(root: object) -> int:
    """Bytes of an object graph (each object once): containers, slotted objects, numpy arrays' buffers."""
    import numpy as np

    seen, stack, total = set(), [root], 0
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        total += sys.getsizeof(item)
        if isinstance(item, np.ndarray):
            total += item.nbytes if item.base is None else 0
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            stack += list(item)
        elif hasattr(item, "__dict__"):
            stack.append(vars(item))
        elif hasattr(type(item), "__slots__"):
            stack += [getattr(item, name) for name in type(item).__slots__ if hasattr(item, name)]
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--tokenizer", help="a local model dir with tokenizer.json (default: the embedded model's converted copy)")
    parser.add_argument("--out", default=str(common.results_dir(__file__)))
    parser.add_argument("--budget-tokens", type=int, default=2_500, help="also run with this KV budget (0: skip)")
    parser.add_argument("--export-repeats", type=int, default=3, help="token passes per format on the 10,000-request exports (0: skip)")
    parser.add_argument("--worker", nargs=3, metavar=("LOG", "TOKENIZER", "BUDGET"), help=argparse.SUPPRESS)
    parser.add_argument("--stage2-memory", type=int, help="instead: the Ray driver's bytes per request on this many requests")
    parser.add_argument("--memory", help="instead: one process's peak RSS on generated logs of these sizes (e.g. 10000,100000,1000000)")
    parser.add_argument("--logs", default=None, help="with --memory: the folder the logs are written to (default: a temporary one)")
    parser.add_argument("--memory-budgets", default="0,2500,gpu:80", help="with --memory: 0 unbounded, N tokens, gpu:G a GPU of G GiB")
    parser.add_argument("--scale-worker", nargs=4, metavar=("MODE", "LOG", "TOKENIZER", "WORKERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.worker[2])
        return
    if args.scale_worker:
        _scale_worker(args.scale_worker[0], args.scale_worker[1], args.scale_worker[2], int(args.scale_worker[3]))
        return
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else _embedded_tokenizer_dir()
    if args.memory:
        _memory_main(args, tokenizer_dir)
        return
    if args.stage2_memory:
        budgets = [0, args.budget_tokens] if args.budget_tokens else [0]
        runs = [stage2_memory(args.stage2_memory, args.sessions, tokenizer_dir, budget) for budget in budgets]
        path = Path(args.out) / "audit_scale_stage2_memory-cpu.json"
        path.write_text(json.dumps({"benchmark": "audit_scale_stage2_memory", "runs": runs}, indent=2) + "\n", encoding="utf-8")
        print(path)
        return
    load_before, results = os.getloadavg(), []
    budgets = [0, args.budget_tokens] if args.budget_tokens else [0]
    with tempfile.TemporaryDirectory() as folder:
        for size in [int(n) for n in args.sizes.split(",")]:
            log = Path(folder) / f"agents-{size}.jsonl"
            log.write_text("\n".join(json.dumps(r) for r in synthetic_log(size, args.sessions)), encoding="utf-8")
            runs = {
                "unbounded" if budget == 0 else f"budget_{budget}_tokens": _pass(log, tokenizer_dir, Path(folder), budget)
                for budget in budgets
            }
            results.append({"requests": size, "sessions": args.sessions, **runs})
        exports = _exports(Path(folder), tokenizer_dir, args.sessions, args.export_repeats) if args.export_repeats else None
    data = {
        "benchmark": "audit_scale",
        "tokenizer": tokenizer_dir.name,
        "cpu": cpu_info(),
        "cpus": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "goal": "token pass of 10,000 requests under 60 s on a 2-core CPU, no slower than kvlint",
        "log": {"step_seconds": STEP.total_seconds(), "policy_rules": RULES, "history_chars": HISTORY_CHARS},
        "notes": NOTES,
        "results": results,
        "exports": exports,
    }
    path = Path(args.out) / "audit_scale-cpu.json"
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(path)


MEMORY_GOAL_MB = 2_500  # one process's peak at 100,000 requests (issue 67)


def memory_scale(sizes: list[int], sessions: int, budgets: list[str], tokenizer_dir: Path, folder: Path) -> list[dict]:
    """One process's token pass (``--sample 0``'s: ``scan_log``, the log read as the CLI reads it) on generated logs
    of each size under each budget (``_cache_settings``: 0 unbounded, N tokens, ``gpu:G`` a GPU's size), each in a fresh
    process: its peak RSS, bytes per request over its start, and what each engine's cache held at the end; then the
    whole command a user runs, report included, under the same budget (``command_peak``), in another."""
    runs = []
    for size in sizes:
        log = folder / f"agents-{size}.jsonl"
        if not log.exists():
            write_log(log, size, sessions)
        for budget in budgets:
            kept = folder / f"agents-{size}.{budget.replace(':', '')}.worker.json"  # a worker's result, reused (delete it to measure again)
            if not kept.exists():
                run = _measured([sys.executable, "-m", "benchmarks.studies.audit_scale", "--worker", str(log), str(tokenizer_dir), budget])
                if run["code"] != 0:
                    runs.append({"requests": size, "budget": budget, "failed": run["stderr"][-1500:]})
                    continue
                kept.write_text(run["stdout"], encoding="utf-8")
            ran = folder / f"agents-{size}.{budget.replace(':', '')}.command.json"  # the command's, reused the same way
            if not ran.exists():
                ran.write_text(json.dumps(command_peak(log, budget, tokenizer_dir)), encoding="utf-8")
            found, command = (json.loads(path.read_text(encoding="utf-8")) for path in (kept, ran))
            runs.append(memory_run(size, budget, log, found, command))
            peaks = f"pass {found['peak_rss_mb']} MB, command {command['peak_rss_mb']} MB"
            print(f"{size:,} requests, budget {budget}: {peaks}", file=sys.stderr)
    return runs


def memory_run(size: int, budget: str, log: Path, found: dict, command: dict) -> dict:
    """One worker's measurement as the memory study stores it, with the command's (``command_peak``)."""
    keep = ("seconds", "cpu_seconds", "peak_rss_mb", "rss_before_mb", "peak_rss_mb_after_reading", "bytes_per_request_over_start")
    return (
        {"requests": size, "budget": budget, "log_bytes": log.stat().st_size, "tokens": found["tokens"]}
        | {key: found[key] for key in keep}
        | {key: found[key] for key in ("caches_held_tokens", "caches_held_share_of_log_tokens", "exact_check")}
        | {"budgets": [budget["source"] for budget in found["engines"]["budgets"]], "hit_rate": found["engines"]["hit_rate"]}
        | {"command": command}
    )


def budget_flags(budget: str) -> list[str]:
    """The audit's flags for a budget of ``_cache_settings``: none (unbounded), the token budgets, or the GPU's size."""
    if budget.startswith("gpu:"):
        return ["--gpu-memory-gib", budget.removeprefix("gpu:")]
    tokens = int(budget)
    return ["--kv-budget-tokens", str(tokens), "--kv-budget-blocks", str(tokens // 16)] if tokens else []


def command_peak(log: Path, budget: str, tokenizer_dir: Path) -> dict:
    """``python -m kvscope audit LOG --sample 0 --json`` under ``budget`` as a user runs it (the report built and
    printed), with the worker's model: its wall seconds and its own peak RSS (``os.wait4``: this child's, not the
    largest child's so far)."""
    flags = ["--sample", "0", "--json", "--model", str(tokenizer_dir), *budget_flags(budget)]
    command = [sys.executable, "-m", "kvscope", "audit", str(log), *flags]
    with tempfile.TemporaryFile() as output:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)  # the report, or its error as JSON
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        if status:
            output.seek(0)
            raise SystemExit(f"{' '.join(command)} failed: {output.read()[-2000:].decode(errors='replace')}")
    peak = round(usage.ru_maxrss / 1024, 1)  # kilobytes on Linux
    return {"argv": ["kvscope", "audit", log.name, *flags], "seconds": round(seconds, 2), "peak_rss_mb": peak}


def _memory_main(args: argparse.Namespace, tokenizer_dir: Path) -> None:
    """Writes benchmarks/studies/results/audit_scale_memory-cpu.json; a size and budget measured before and not now keeps
    its run (so sizes may be measured in separate invocations)."""
    load_before = os.getloadavg()
    sizes = [int(n) for n in args.memory.split(",")]
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(args.logs) if args.logs else Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        runs = memory_scale(sizes, args.sessions, args.memory_budgets.split(","), tokenizer_dir, folder)
    path = Path(args.out) / "audit_scale_memory-cpu.json"
    measured = {(run["requests"], run["budget"]) for run in runs}
    earlier = json.loads(path.read_text()).get("runs", []) if path.exists() else []
    kept = [run for run in earlier if "budget" in run and (run["requests"], run["budget"]) not in measured]
    data = {
        "benchmark": "audit_scale_memory",
        "tokenizer": tokenizer_dir.name,
        "cpu": cpu_info(),
        "cpus": os.cpu_count(),
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "goal": f"one process's peak RSS at 100,000 requests at most {MEMORY_GOAL_MB:,} MB; grows with what the caches hold, not the log",
        "runs": sorted(kept + runs, key=lambda run: (run["requests"], run["budget"])),
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(path)


if __name__ == "__main__":
    main()
