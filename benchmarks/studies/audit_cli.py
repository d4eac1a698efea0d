"""The CLI audit timed as a user runs it, process start included: each bundled log's default audit, and ``--rewritten``
against plain transformers doing the same prefills and generations, as ratios.

    python -m benchmarks.studies.audit_cli [--logs coding_agent,support_agent,rag] [--reps 3] [--baseline DIR]
                                           [--rewrite hoist] [--tokens 32] [--model embedded] [--dtype auto]

Per repetition and log, one after the other (so the two times of every ratio share the machine's load):

1. ``python -m kvscope audit LOG --json``, the default audit (``--sample 3``, every repair, ``--tokens`` greedy tokens),
   from process start to exit; with ``--baseline DIR`` (another checkout, e.g. the commit before a change) the same
   command there first: ``speedup`` is its time over this checkout's, and ``same_json`` says whether both printed the
   same JSON, times aside (every ``*ttft*`` value, and the recommendation's words and KV-level alternative, which quote
   them);
2. ``python -m kvscope audit LOG --rewritten REWRITTEN --json``: the rewrite is the log with its volatile line moved as
   ``--rewrite`` moves it (the template ``--template-out --template-repair hoist`` writes, built here from the token
   pass and applied to the log as ``--template`` applies it; ``erratum`` where hoist does not apply);
3. ``python -m kvscope audit LOG --sample 0 --rewritten REWRITTEN --json``: the rewrite alone (the token pass, no
   sampled turn measured);
4. plain transformers (:mod:`benchmarks.studies.plain_generation`, a process of its own: torch and transformers
   imported, the same weights loaded) running, for every distinct prompt the rewrite's measurement reads (each original
   and rewritten request, rendered as the audit renders it), a clean prefill and ``--tokens`` greedy tokens.

``rewrite_ratio`` = (2) / (4), the goal ≤ 1.3 (2 also measures the audit's sampled turns, which (4) does not);
``rewrite_only_ratio`` = (3) / (4), the same prefills and generations on both sides; ``--baseline`` times (2) and (3)
there too. Every time is kept with its min /
median / max, the children's CPU seconds (user + sys) beside the wall seconds, and the load average before and after
each log (other processes share the CPU: compare ratios, not seconds). Writes results/audit_cli-<model>-cpu.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import common
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.render import context_limit
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError
from kvscope.engine.audit.measure.settings import DEFAULT_TOKENS
from kvscope.engine.audit.prompts.repair_requests import RepairNotApplicable
from kvscope.engine.audit.prompts.template import written_template
from kvscope.engine.audit.rewrite.measure import apply_template
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.models import gguf, load_tokenizer
from kvscope.engine.scenario import DEMOS

LOGS = DEMOS / "logs"
REWRITES = ("hoist", "erratum")  # the first that applies to a log's last changed field
GOAL_RATIO = 1.3
GOAL_AUDIT_S = 60
TIMED_KEYS = ("reason", "kv_alternative")  # a recommendation's words and its KV-level alternative quote measured times


def _parser():
    parser = common.parser(__doc__)
    parser.add_argument("--logs", default=common.BUNDLED_LOGS, help="comma-separated stems of demos/logs/*.jsonl")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every timed command")
    parser.add_argument("--baseline", help="another checkout whose CLI is timed beside this one (same commands)")
    parser.add_argument("--rewrite", choices=REWRITES, default=REWRITES[0], help="the prompt-level repair the rewrite applies")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens per prompt (the CLI's default)")
    parser.add_argument("--no-rewritten", action="store_true", help="time the default audit only")
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    return parser


def untimed(data: object) -> object:
    """An audit's JSON without what a run's timing decides: every ``*ttft*`` value, and the words and alternative of a
    recommendation (they quote the times). What is left must be the same run to run and before and after a speed-up."""
    if isinstance(data, dict):
        return {key: untimed(value) for key, value in data.items() if "ttft" not in key and key not in TIMED_KEYS}
    if isinstance(data, list):
        return [untimed(value) for value in data]
    return data


def rewritten_log(log: RequestLog, tokenizer, repair: str) -> tuple[str, str] | None:
    """The log rewritten as ``repair`` sends its last changed field (``--template-out --template-repair``, built from
    the token pass, applied as ``--template`` applies it), as JSONL, and the repair applied; None where neither of
    :data:`REWRITES` applies."""
    scan = scan_log(tokenizer.tokenizer, log, ScanSettings(context_limit=context_limit(tokenizer)), model=tokenizer.name)
    changed = [index for index, diff in scan.diffs.items() if diff is not None and diff.fields]
    if not changed:
        return None
    last = max(changed)
    for name in dict.fromkeys([repair, *REWRITES]):
        try:
            template = written_template(name, scan.rendered[last], scan.diffs[last].fields)
            rewritten = apply_template(template, log)
        except (RequestLogError, RepairNotApplicable):
            continue
        lines = [json.dumps(_record(request)) for request in rewritten.requests]
        return "\n".join(lines) + "\n", name
    return None


def _record(request) -> dict:
    record: dict = {"messages": [message.template_dict() for message in request.messages]}
    if request.tools:
        record["tools"] = request.tool_definitions()
    if request.session is not None:
        record["user"] = request.session
    return record


def distinct_prompts(tokenizer, *logs: RequestLog) -> list[list[int]]:
    """Every distinct prompt of the logs, rendered as the audit renders them (the rewrite reads each once)."""
    limit = int(tokenizer.info().get("max_positions") or 32_768)
    prompts = {}
    for log in logs:
        scan = scan_log(tokenizer.tokenizer, log, ScanSettings(context_limit=limit), model=tokenizer.name)
        for rendered in scan.rendered.values():
            prompts.setdefault(tuple(rendered.ids), None)
    return [list(ids) for ids in prompts]


def timed(command: Sequence[str], cwd: Path) -> dict:
    """One command run to its end: wall and CPU seconds (the child's user + sys), and its stdout."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} in {cwd} exited {done.returncode}: {done.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"s": wall, "cpu_s": cpu, "stdout": done.stdout}


def spread(values: Sequence[float]) -> dict:
    """Seconds and ratios of repeated CLI runs, to 2 digits, every run kept."""
    return common.spread(values, digits=2, runs=True)


def model_dir(spec: str) -> str:
    """Where the weights the engine loads for ``spec`` are (the embedded model: its safetensors copy)."""
    return str(gguf.converted_alias(spec, print)[0]) if spec in gguf.ALIASES else spec


def run(args) -> dict:
    tokenizer = load_tokenizer(args.model, progress=print)
    audit = [sys.executable, "-m", "kvscope", "audit", "--json", "--model", args.model, "--dtype", args.dtype, "--tokens", str(args.tokens)]
    trees = {"this": common.ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    work = Path(tempfile.mkdtemp(prefix="audit_cli-"))
    logs, rows = [stem.strip() for stem in args.logs.split(",") if stem.strip()], {}
    for name in logs:
        path = LOGS / f"{name}.jsonl"
        log = read_log(path.read_text(encoding="utf-8"))
        kinds = ("default", "rewritten", "rewrite_only", "plain")
        row: dict = {"log": name, "requests": len(log.requests), "runs": {key: [] for key in kinds}}
        rewrite = None if args.no_rewritten else rewritten_log(log, tokenizer, args.rewrite)
        if rewrite is not None:
            text, row["rewrite"] = rewrite
            (work / f"{name}.rewritten.jsonl").write_text(text, encoding="utf-8")
            prompts = distinct_prompts(tokenizer, log, read_log(text))
            weights = model_dir(args.model)
            row["plain_job"] = {"model_dir": weights, "tokens": args.tokens, "stop_ids": _stop_ids(tokenizer, weights), "prompts": prompts}
            row["prompts"], row["prompt_tokens"] = len(prompts), sum(len(ids) for ids in prompts)
        rows[name] = row
    load_before = os.getloadavg()
    for rep in range(args.reps):
        for name in logs:
            row, path = rows[name], str(LOGS / f"{name}.jsonl")
            outputs = {}
            for tree, where in trees.items():
                result = timed([*audit, path], where)
                row["runs"]["default"].append({"tree": tree, "s": result["s"], "cpu_s": result["cpu_s"]})
                outputs[tree] = untimed(json.loads(result["stdout"]))
            row.setdefault("dtype", outputs["this"]["dtype"])  # what the audit loaded ("auto" picks per CPU)
            if "plain_job" in row:  # plain transformers runs in that dtype too
                job = {**row.pop("plain_job"), "dtype": row["dtype"]}
                (work / f"{name}.plain.json").write_text(json.dumps(job), encoding="utf-8")
            if "baseline" in outputs:
                row.setdefault("same_json", []).append(outputs["this"] == outputs["baseline"])
            if "rewrite" in row:
                for kind, sample in (("rewritten", []), ("rewrite_only", ["--sample", "0"])):
                    for tree, where in trees.items():
                        result = timed([*audit, path, *sample, "--rewritten", str(work / f"{name}.rewritten.jsonl")], where)
                        row["runs"][kind].append({"tree": tree, "s": result["s"], "cpu_s": result["cpu_s"]})
                result = timed([sys.executable, "-m", "benchmarks.studies.plain_generation", str(work / f"{name}.plain.json")], common.ROOT)
                row["runs"]["plain"].append({"s": result["s"], "cpu_s": result["cpu_s"], **json.loads(result["stdout"])})
            print(f"rep {rep + 1}/{args.reps} {name}: {_line(row)}", flush=True)
    data = {
        "model": args.model,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu": common.cpu_info(),
        "reps": args.reps,
        "tokens": args.tokens,
        "dtype": ", ".join(sorted({row["dtype"] for row in rows.values()})),
        "baseline": str(trees["baseline"]) if args.baseline else None,
        "goal_ratio": GOAL_RATIO,
        "goal_audit_s": GOAL_AUDIT_S,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "logs": [_summary(rows[name]) for name in logs],
    }
    return data


def _stop_ids(tokenizer, weights: str) -> list[int]:
    """The ids that end a generation, as ``LoadedModel.stop_ids`` reads them: the tokenizer's EOS, then the generation
    config's (read from the weights' folder)."""
    config = (
        json.loads((Path(weights) / "generation_config.json").read_text()) if (Path(weights) / "generation_config.json").exists() else {}
    )
    configured = config.get("eos_token_id")
    ids = [tokenizer.tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _times(row: dict, kind: str, tree: str | None = None, key: str = "s") -> list[float]:
    return [run[key] for run in row["runs"][kind] if tree is None or run.get("tree") == tree]


def _summary(row: dict) -> dict:
    """A log's times (min / median / max, every run kept) and the ratios of runs side by side."""
    out = {key: value for key, value in row.items() if key != "runs"}
    this, baseline = _times(row, "default", "this"), _times(row, "default", "baseline")
    out["default_s"], out["default_cpu_s"] = spread(this), spread(_times(row, "default", "this", "cpu_s"))
    if baseline:
        out["baseline_default_s"], out["baseline_default_cpu_s"] = spread(baseline), spread(_times(row, "default", "baseline", "cpu_s"))
        out["speedup"] = spread([b / t for b, t in zip(baseline, this)])
    if row["runs"]["plain"]:
        plain, rewritten = _times(row, "plain"), _times(row, "rewritten", "this")
        out["plain_s"], out["plain_cpu_s"] = spread(plain), spread(_times(row, "plain", key="cpu_s"))
        out["plain_parts"] = row["runs"]["plain"]
        out["rewritten_s"], out["rewritten_cpu_s"] = spread(rewritten), spread(_times(row, "rewritten", "this", "cpu_s"))
        out["rewrite_ratio"] = spread([r / p for r, p in zip(rewritten, plain)])
        out["rewrite_cpu_ratio"] = spread(
            [r / p for r, p in zip(_times(row, "rewritten", "this", "cpu_s"), _times(row, "plain", key="cpu_s"))]
        )
        alone = _times(row, "rewrite_only", "this")
        out["rewrite_only_s"], out["rewrite_only_ratio"] = spread(alone), spread([r / p for r, p in zip(alone, plain)])
        for kind, key in (("rewritten", "rewrite_ratio"), ("rewrite_only", "rewrite_only_ratio")):
            old = _times(row, kind, "baseline")
            if old:
                out[f"baseline_{kind}_s"] = spread(old)
                out[f"baseline_{key}"] = spread([r / p for r, p in zip(old, plain)])
    return out


def _line(row: dict) -> str:
    """The latest repetition's times and ratios, in one line."""
    latest = lambda kind, tree=None: _times(row, kind, tree)[-1]  # noqa: E731
    words = [f"default {latest('default', 'this'):.1f} s"]
    if _times(row, "default", "baseline"):
        words.append(f"(baseline {latest('default', 'baseline'):.1f} s)")
    if row["runs"]["plain"]:
        plain = latest("plain")
        for kind in ("rewritten", "rewrite_only"):
            words.append(f"{kind} {latest(kind, 'this'):.1f} s / plain {plain:.1f} s = x{latest(kind, 'this') / plain:.2f}")
            if _times(row, kind, "baseline"):
                words.append(f"(baseline x{latest(kind, 'baseline') / plain:.2f})")
    return " ".join(words)


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    data = run(args)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    model = args.model.split(":")[0].replace("/", "_")
    path = folder / f"audit_cli-{model}-cpu.json"
    path.write_text(json.dumps(data, indent=2))
    for row in data["logs"]:
        ratio, alone = row.get("rewrite_ratio", {}).get("median"), row.get("rewrite_only_ratio", {}).get("median")
        speedup = row.get("speedup", {}).get("median")
        print(
            f"{row['log']}: default audit {row['default_s']['median']} s (goal {GOAL_AUDIT_S} s)"
            + (f", x{speedup} faster than the baseline, same JSON {all(row['same_json'])}" if speedup else "")
            + (f"; --rewritten / plain transformers x{ratio}, --sample 0 --rewritten x{alone} (goal x{GOAL_RATIO})" if ratio else ""),
            flush=True,
        )
    print(f"-> {path}", flush=True)
    return data


if __name__ == "__main__":
    main()
