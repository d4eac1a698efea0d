"""Request logs replayed on llama.cpp's C++ ``llama-server``: the server's own prefix-cache reuse beside the audit's
simulated llama.cpp cache, request by request, for the original log and the rewritten log of each prompt-level repair.

    bash scripts/build_llama_server.sh      # once: llama-server built from the pinned llama.cpp source
    python -m benchmarks.interop.audit_replay [--logs coding_agent,support_agent,rag,traffic/interleaved_agents]
                                      [--repairs erratum,hoist,coarsen] [--grain date] [--tokens 32] [--reps 1] [--threads 2]

Each log goes through the audit's token pass (``kvscope.engine.audit.scan.traffic_scan.scan_log``): every request rendered with the
model's chat template, and fed to the simulated llama.cpp server (``caches.SlotCache``: one slot per session, here
without ``--cache-reuse``, so only the common prefix with the slot counts). The same token ids are then sent, in log
order, to one llama-server per log started as the serving benchmark starts it (``serving_servers.LlamaServer``: RAM
prompt cache off), with one slot per session (``-np`` = the log's sessions; each session pinned to its slot by
``id_slot``) and ``cache_prompt: true``. Both sides see the same tokens, so the template cannot differ.

Per request: ``server_cached_tokens`` (``timings.cache_n`` of llama-server's ``/completion``: the slot's tokens it
kept; ``timings.prompt_n`` are the ones it evaluated, and the two add up to the prompt), ``simulated_cached_tokens``
(the token pass's ``reused_tokens["llama_cpp"]``), their difference, and ``prompt_ms`` (the server's prompt time, the
median of ``--reps`` rounds, each round replaying the original and every rewritten log in turn from emptied slots;
every time kept). A difference would be named with its cause in ``mismatches``; both sides compute at least the last
token (a prompt equal to its slot's reuses all but one), and the model adds no BOS token, so there is none to expect.

The rewritten logs are the templates the audit writes, deployed: the log is audited as ``kvscope audit LOG --grain
G`` audits it (``kvscope.engine.audit.measure.traffic.audit_traffic``, the prompt-level repairs), each repair's template is written as
``--template-out`` writes it (``turn.repaired_template``) and applied to every request of the log it is for as
``--template`` applies it (``rewrite.measure.apply_template``), so a deployed template changes every request, not only the
ones whose fields changed. A repair the audit writes no template for (it does not apply, or no field changed) is named
with why in ``templates``. ``original`` is the log as logged: ``recompute``, the exact reference.

Per request, each replay also carries the audit's fidelity of its prompt against the original's clean prefill
(``rewrite.measure.measure_rewrites``, what ``--template`` measures: next-token KL, top-1, top-5 overlap, agreement of
``--tokens`` greedy tokens, the same text), measured in torch on the ``--model`` (its dtype is the JSON's), while the
server runs the GGUF.

Chat sessions whose replies are fed back (the server then caches each reply too), on llama-server and on vLLM's CPU
build: ``benchmarks/interop/chat_replay.py``.

Writes benchmarks/interop/results/audit_replay-<model>-<device>.json (and its figure, .html) with the CPU's flags, the
repetitions and the load average; the times are single-machine wall times on a CPU other processes may share.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import common
from benchmarks.common import cpu_info
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, resolve_gguf
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError
from kvscope.engine.audit.measure.settings import DEFAULT_TOKENS, measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.audit.measure.turn import repaired_template
from kvscope.engine.audit.prompts.repair_requests import GRAINS, PROMPT_REPAIRS
from kvscope.engine.audit.rewrite.measure import RewriteReport, apply_template, measure_rewrites
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficScan, scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.models import LoadedModel
from kvscope.engine.scenario import DEMOS
from kvscope.viz.benchmarks import audit_replay_figure

LOGS = DEMOS / "logs"
DEFAULT_LOGS = "coding_agent,support_agent,rag,traffic/interleaved_agents"
ENGINE = "llama_cpp"  # the simulated engine the server is checked against
FIDELITY = ("kl", "top1_agree", "top5_overlap", "generation_agreement", "generated_common_prefix", "same_text")  # per request
_CTX_STEP = 256


@dataclass(frozen=True)
class Rewrites:
    """A log's rewritten logs (``original`` first: the log itself), what the audit wrote for each repair, and the
    fidelity of every rewritten request against the original's clean prefill."""

    logs: dict[str, RequestLog]
    templates: dict[str, dict]
    fidelity: dict[str, RewriteReport]


def rewrites_of(lm: LoadedModel, log: RequestLog, repairs: Sequence[str], grain: str, tokens: int, settings: ScanSettings) -> Rewrites:
    """The log audited, each repair's template written and applied to the log, and every rewrite measured."""
    report = audit_traffic(
        lm, log, measure=measure_settings(repairs=repairs, tokens=tokens, grain=grain), settings=settings
    ).measured_report()
    turn = report.last_with_fields()
    logs, templates = {"original": log}, {}
    for repair in repairs:
        try:
            text = repaired_template(report, repair)
        except RequestLogError as error:
            templates[repair] = {"written": False, "reason": str(error)}
            continue
        logs[repair] = apply_template(text, log)
        changed = [old.index for old, new in zip(log.requests, logs[repair].requests) if old.contents != new.contents]
        form = "object" if isinstance(json.loads(text), dict) else "list"
        templates[repair] = {"written": True, "from_request": turn.request, "form": form, "rewritten_requests": changed}
    return Rewrites(logs, templates, measure_rewrites(lm, log, logs, settings=settings, tokens=tokens))


def slots_of(scan: TrafficScan) -> dict[str | None, int]:
    """One server slot per session, numbered in order of first appearance."""
    return {session: slot for slot, session in enumerate(dict.fromkeys(row.session for row in scan.requests))}


def completion(server: LlamaServer, ids: Sequence[int], slot: int) -> dict:
    """One request on its session's slot, the prompt cache on, one token generated; llama-server's answer."""
    body = {"prompt": list(ids), "n_predict": 1, "temperature": 0.0, "id_slot": slot, "cache_prompt": True, "n_cache_reuse": 0}
    with httpx.Client(trust_env=False, timeout=600.0) as client:
        response = client.post(f"{server.base_url}/completion", json=body)
        response.raise_for_status()
    return response.json()


def erase_slots(server: LlamaServer, scan: TrafficScan) -> None:
    """Leave every slot holding one token no request starts with (a prompt evaluated with the cache off replaces the
    slot's), so that a replay cannot reuse the previous replay's prompts; this build answers 501 to the slot-erase
    route without ``--slot-save-path``."""
    firsts = {int(rendered.token_ids[0]) for rendered in scan.rendered.values() if len(rendered)}
    token = next(t for t in range(1, 1 << 20) if t not in firsts)
    with httpx.Client(trust_env=False, timeout=60.0) as client:
        for slot in slots_of(scan).values():
            body = {"prompt": [token], "n_predict": 1, "id_slot": slot, "cache_prompt": False}
            client.post(f"{server.base_url}/completion", json=body).raise_for_status()


def replay(server: LlamaServer, scan: TrafficScan) -> list[dict]:
    """Every request of ``scan`` sent in order, each on its session's slot: the server's reuse and time beside the
    simulation's."""
    slots, rows = slots_of(scan), []
    for row in scan.requests:
        answer = completion(server, scan.rendered[row.request].token_ids.tolist(), slots[row.session])
        timings = answer["timings"]
        cached, evaluated = int(timings["cache_n"]), int(timings["prompt_n"])
        simulated = int(row.reused_tokens[ENGINE])
        rows.append(
            {
                "request": row.request,
                "session": row.session,
                "slot": slots[row.session],
                "tokens": row.tokens,
                "server_cached_tokens": cached,
                "server_evaluated_tokens": evaluated,
                "simulated_cached_tokens": simulated,
                "difference": cached - simulated,
                "accounted": cached + evaluated == row.tokens,
                "prompt_ms": round(float(timings["prompt_ms"]), 1),
            }
        )
    return rows


def mismatches(rows: Sequence[dict]) -> list[dict]:
    """The requests where the server's count differs from the simulation's (or its counts do not add up to the
    prompt), each with by how much and the likely cause."""
    found = []
    for row in rows:
        if row["difference"] == 0 and row["accounted"]:
            continue
        if not row["accounted"]:
            why = "cache_n + prompt_n differ from the prompt's tokens: the server truncated or re-tokenized the prompt"
        elif row["server_cached_tokens"] == row["tokens"] - 1 or row["simulated_cached_tokens"] == row["tokens"] - 1:
            why = "one side kept the last token uncached and the other did not"
        else:
            why = "the server kept a different prefix of the slot than the simulated slot holds"
        found.append({"request": row["request"], "by": row["difference"], "why": why})
    return found


def replay_logs(server: LlamaServer, scans: dict[str, TrafficScan], reps: int) -> dict[str, dict]:
    """``reps`` rounds, each replaying every (original or rewritten) log in turn from emptied slots, so the logs'
    times are taken side by side; per log, the median prompt time per request, every time kept."""
    runs: dict[str, list[list[dict]]] = {label: [] for label in scans}
    for _ in range(reps):
        for label, scan in scans.items():
            erase_slots(server, scan)
            runs[label].append(replay(server, scan))
    return {label: _merged(label_runs) for label, label_runs in runs.items()}


def _merged(runs: list[list[dict]]) -> dict:
    rows = [dict(first, prompt_ms_reps=[run[i]["prompt_ms"] for run in runs]) for i, first in enumerate(runs[0])]
    for row in rows:
        row["prompt_ms"] = round(statistics.median(row["prompt_ms_reps"]), 1)
    counts_repeat = all([r["server_cached_tokens"] for r in run] == [r["server_cached_tokens"] for r in runs[0]] for run in runs)
    tokens = sum(row["tokens"] for row in rows)
    return {
        "requests": rows,
        "tokens": tokens,
        "server_cached_tokens": sum(row["server_cached_tokens"] for row in rows),
        "simulated_cached_tokens": sum(row["simulated_cached_tokens"] for row in rows),
        "prompt_ms": round(sum(row["prompt_ms"] for row in rows), 1),
        "matches": sum(row["difference"] == 0 and row["accounted"] for row in rows),
        "mismatches": mismatches(rows),
        "counts_repeat_across_reps": counts_repeat,
    }


def with_fidelity(replayed: dict, measured: RewriteReport) -> dict:
    """A replay's rows with the audit's fidelity of each request (``FIDELITY``), and its verdict and totals."""
    by_request = {row.request: row.as_dict() for row in measured.requests}
    rows = [row | {key: by_request[row["request"]][key] for key in FIDELITY} for row in replayed["requests"]]
    count = len(rows)
    fidelity = {
        "verdict": measured.verdict(),
        "max_kl": max(row["kl"] for row in rows),
        "mean_kl": round(sum(row["kl"] for row in rows) / count, 8),
        "top1_agree": sum(row["top1_agree"] for row in rows),
        "mean_generation_agreement": round(sum(row["generation_agreement"] for row in rows) / count, 4),
        "same_text": sum(row["same_text"] for row in rows),
        "of": count,
    }
    return replayed | {"requests": rows, "fidelity": fidelity}


def context_for(scans: Sequence[TrafficScan], slots: int) -> int:
    """``-c`` for the server: the longest prompt plus one generated token, rounded up, for each slot (llama-server
    splits its context evenly among the slots)."""
    longest = max(row.tokens for scan in scans for row in scan.requests) + 1
    return slots * (-(-longest // _CTX_STEP) * _CTX_STEP)


def run_log(lm: LoadedModel, name: str, args, gguf: Path, model: str) -> dict:
    """One log and its repairs' rewritten logs, replayed on one server started for them."""
    log = read_log((Path(args.log_dir) / f"{name}.jsonl").read_text(encoding="utf-8"))
    settings = ScanSettings(CacheSettings(prompt_cache=False))  # one slot per session, no --cache-reuse: as the server is started and asked
    print(f"{name}: auditing, writing and measuring the templates of {', '.join(args.repairs)}", flush=True)
    rewrites = rewrites_of(lm, log, args.repairs, args.grain, args.tokens, settings)
    scans = {label: scan_log(lm.tokenizer, rewritten, settings, model=lm.name) for label, rewritten in rewrites.logs.items()}
    slots = max(len(slots_of(scan)) for scan in scans.values())
    server_log = Path(tempfile.gettempdir()) / f"kvscope-audit_replay-{name.replace('/', '-')}.log"
    load_before = os.getloadavg()
    with LlamaServer(
        Path(args.server), gguf, context_for(list(scans.values()), slots), args.threads, server_log, model, slots=slots
    ) as server:
        replays = replay_logs(server, scans, args.reps)
        server_settings = server.settings()
    replays = {label: with_fidelity(data, rewrites.fidelity[label]) for label, data in replays.items()}
    for label, data in replays.items():
        print(
            f"{name} {label}: server cached {data['server_cached_tokens']:,} / simulated {data['simulated_cached_tokens']:,} of "
            f"{data['tokens']:,} tokens; {data['matches']}/{len(data['requests'])} requests equal; prompt {data['prompt_ms']:,.0f} ms; "
            f"{data['fidelity']['verdict']}",
            flush=True,
        )
    return {
        "log": name,
        "sessions": len(slots_of(scans["original"])),
        "skipped": len(scans["original"].skipped),
        "templates": rewrites.templates,
        "llama_server": server_settings,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "replays": replays,
    }


def summary(logs: Sequence[dict]) -> dict:
    """Over every log and replay: requests whose server count equals the simulation's; and per log, each rewrite
    against the original (recompute): its prompt time as a ratio of the original's and its fidelity."""
    every = [row for log in logs for data in log["replays"].values() for row in data["requests"]]
    against = {
        log["log"]: {
            label: {"prompt_ms_ratio": round(data["prompt_ms"] / max(log["replays"]["original"]["prompt_ms"], 1e-6), 3), **data["fidelity"]}
            for label, data in log["replays"].items()
            if label != "original"
        }
        for log in logs
    }
    return {
        "requests": len(every),
        "equal": sum(row["difference"] == 0 and row["accounted"] for row in every),
        "max_abs_difference": max((abs(row["difference"]) for row in every), default=0),
        "against_original": against,
    }


def _parser():
    parser = common.parser(__doc__)
    parser.add_argument("--logs", default=DEFAULT_LOGS, help="comma-separated stems of demos/logs/**/*.jsonl")
    parser.add_argument("--log-dir", default=str(LOGS))
    parser.add_argument("--repairs", default="erratum,hoist,coarsen", help="prompt-level repairs whose rewritten logs are replayed")
    parser.add_argument("--grain", default="date", choices=GRAINS, help="coarsen's grain")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens compared per request (the fidelity)")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", default="embedded", help="llama-server's model: 'embedded', 'smollm2' or a .gguf path")
    parser.add_argument("--server", default=str(SERVER_BINARY))
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    args.repairs = [name.strip() for name in args.repairs.split(",") if name.strip()]
    for repair in args.repairs:
        if repair not in PROMPT_REPAIRS:
            raise SystemExit(f"--repairs {repair!r}: replay takes prompt-level repairs only (a server cannot run a KV-level one)")
    if args.reps < 1:
        raise SystemExit(f"--reps must be at least 1, got {args.reps}")
    lm = common.load(args)
    gguf, model = resolve_gguf(args.gguf)
    logs = [run_log(lm, name.strip(), args, gguf, model) for name in args.logs.split(",") if name.strip()]
    data = {
        "gguf": gguf.name,
        "cpu": cpu_info(),
        "reps": args.reps,
        "grain": args.grain,
        "generated_tokens": args.tokens,
        "repairs": args.repairs,
        "simulated_engine": ENGINE,
        "cache_settings": CacheSettings(prompt_cache=False).as_dict(),
        "server_cached_source": "timings.cache_n of /completion (timings.prompt_n: tokens evaluated)",
        "logs": logs,
        "summary": summary(logs),
    }
    path = common.write_result("audit_replay", lm, data, Path(args.out))
    audit_replay_figure(json.loads(path.read_text())).write_html(path.with_suffix(".html"), include_plotlyjs="cdn")
    print("→", path, "and", path.with_suffix(".html").name)
    return data


if __name__ == "__main__":
    main()
