"""Soak test of a hosted KVScope: many visitors, hostile inputs and a worst-case request, memory watched.

    python -m benchmarks.app.soak [--profile public] [--model embedded] [--sessions 200] [--clients 6] [--max-seconds 1500]

Starts ``python app.py --<profile>`` on a free loopback port (nothing else is contacted) and sends
``--sessions`` simulated visitors through gradio_client, ``--clients`` at a time. Each visitor is a new
browser session: it edits a bundled scenario to its own value, knocks out the top notes of its own edit
(cross-talk check: it must see its value and its edit), and every few visitors also composes skills or
exports. Every ``--hostile-every``-th visitor sends one of the hostile inputs of the safety review instead
(server paths, an over-long scenario, a context over the limit, duplicated strategies, bad names, a model
switch cycle, an empty edit, an oversized export). Then the fairness phase: normal edits one after another
from new sessions, first alone, then while another client keeps sending the largest request the profile
allows (90% of its context limit, every strategy).

Measured: the server's RSS every 2 s (plateau: growth over the last half of the sessions), normal edit
latency percentiles under the visitors' load, alone, and while the worst-case request runs, every error (a
refusal must name its cause and never a server path or a traceback), and cross-talk. Writes benchmarks/app/results/soak-<profile>.json
and an HTML figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from gradio_client import Client

from benchmarks.common import PERCENTILE, ROOT, free_port, percentile, results_dir, wait_until_serving
from kvscope.engine.edit.strategies import STRATEGIES
from kvscope.engine.probes.analysis import DEFAULT_STRATEGIES
from kvscope.engine.scenario import bundled_scenarios
from kvscope.engine.timing import Stopwatch, timed
from kvscope.viz.benchmarks import soak_figure

RESULTS = results_dir(__file__)
SCENARIO = "refund_gate"
FIELD = "refund_eligible"
FIELD_VALUES = ("true", "false")
ACCEPTED = ("duplicated strategies", "model switch", "composer braces")  # served: run once, allowlisted, literal text
LEAK_MARKERS = (str(Path.home()), "Traceback", "/usr/", "site-packages", ".cache")


@dataclass
class Log:
    """Everything the visitors observed, appended from several threads."""

    edits: list[dict] = field(default_factory=list)  # {"t", "seconds"} of visitors' edits under load
    errors: list[dict] = field(default_factory=list)  # {"kind", "message", "expected"}
    cross_talk: list[str] = field(default_factory=list)
    worst: list[dict] = field(default_factory=list)
    rss: list[tuple[float, float, int]] = field(default_factory=list)  # (t, MB, sessions done)
    done: int = 0  # visitors finished, in completion order
    worst_running: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


def _padded_scenario(text: str, extra_lines: int) -> str:
    """The scenario with neutral order notes added inside its context (after the TICKET heading)."""
    notes = "".join(f"order note {i}: parcel scanned at the depot.\n" for i in range(extra_lines))
    return text.replace("\nTICKET\n", f"\nTICKET\n{notes}", 1)


def _refusal(log: Log, kind: str, call) -> None:
    """Run a hostile call; it must be refused with a specific message that names no server path."""
    try:
        call()
        log_entry = {"kind": kind, "message": "accepted", "expected": kind in ACCEPTED}
    except Exception as error:  # noqa: BLE001 - gradio_client raises AppError text as a plain Exception
        message = str(error)
        leak = any(marker in message for marker in LEAK_MARKERS)
        generic = (
            message.strip() in ("", "Error", "None") or "upstream Gradio app has raised an exception" in message and "\n" not in message
        )
        log_entry = {"kind": kind, "message": message[:300], "expected": not leak and not generic, "leak": leak}
    with log.lock:
        log.errors.append(log_entry)


def hostile(url: str, log: Log, index: int, text: str, over_limit: str) -> None:
    """One hostile input of the safety review (cycled by ``index``)."""
    client = Client(url, verbose=False)
    cases = [
        ("server path", lambda: client.predict("~", None, api_name="/load_model")),
        ("absolute path", lambda: client.predict("/etc", None, api_name="/load_model")),
        ("over-long scenario", lambda: client.predict(text + "#" * 50_000, FIELD, "true", ["erratum"], 4, -1, api_name="/edit")),
        ("context over limit", lambda: client.predict(over_limit, FIELD, "true", ["erratum"], 4, -1, api_name="/edit")),
        ("duplicated strategies", lambda: client.predict(text, FIELD, "true", ["erratum"] * 20, 4, -1, True, api_name="/edit")),
        ("bad tiny name", lambda: client.predict("tiny-<script>", None, api_name="/load_model")),
        ("model switch", lambda: [client.predict(spec, None, api_name="/load_model") for spec in ("tiny-llama", "tiny-gpt2")]),
        ("empty edit", lambda: client.predict(None, None, None, None, None, None, api_name="/edit")),
        ("oversized export", lambda: client.predict({"blob": "x" * 20_000_000}, None, None, None, None, None, api_name="/export_notes")),
        ("composer braces", lambda: client.predict(["account_gate"], "{skill:nope} {x}", "", "", "seam:1", api_name="/compose")),
    ]
    kind, call = cases[index % len(cases)]
    _refusal(log, kind, call)
    with log.lock:
        log.done += 1


def visitor(url: str, log: Log, index: int, text: str) -> None:
    """A normal visitor: its own edit, a knockout on it, sometimes the composer or an export."""
    client = Client(url, verbose=False)
    value = FIELD_VALUES[index % 2]
    result, ms = timed(lambda: client.predict(text, FIELD, value, list(DEFAULT_STRATEGIES), 4, -1, api_name="/edit"))
    seconds = ms / 1000
    summary = result[5]
    _, _, knocked = client.predict("", 4, api_name="/knockout")
    with log.lock:
        log.edits.append({"t": time.time(), "seconds": seconds})
        if summary.get("new") != value or not knocked.get("positions"):
            log.cross_talk.append(f"visitor {index}: asked {value}, saw {summary.get('new')}")
    if index % 4 == 1:
        client.predict(["account_gate"], f"Ticket {index}.", "", "", "seam:1", api_name="/compose")
    if index % 5 == 2:
        client.predict(summary, None, None, None, None, None, api_name="/export_notes")
    with log.lock:
        log.done += 1


def worst_case(url: str, log: Log, text: str, stop: threading.Event) -> None:
    """Keep sending the largest request the profile allows until ``stop``."""
    client = Client(url, verbose=False)
    names = [name for name in STRATEGIES if name not in ("stale", "oracle", "auto")]
    while not stop.is_set():
        log.worst_running = True
        watch = Stopwatch()
        try:
            client.predict(text, FIELD, "true", names, 8, -1, api_name="/edit")
            outcome = "completed"
        except Exception as error:  # noqa: BLE001
            outcome = f"refused: {str(error)[:160]}"
        log.worst.append({"seconds": round(watch.ms / 1000, 2), "outcome": outcome})
    log.worst_running = False


def sample_rss(pid: int, log: Log, stop: threading.Event) -> None:
    """The server's resident memory (with any children) every 2 s."""
    process, start = psutil.Process(pid), time.time()
    while not stop.is_set():
        try:
            rss = process.memory_info().rss + sum(child.memory_info().rss for child in process.children(recursive=True))
        except psutil.Error:
            break
        log.rss.append((round(time.time() - start, 1), round(rss / 2**20, 1), log.done))
        stop.wait(2)


def _percentiles(values: list[float]) -> dict[str, float] | None:
    """Count, p50/p90/p99 (:data:`benchmarks.common.PERCENTILE`), max and mean of ``values``; None if there are none."""
    if not values:
        return None
    return {
        "n": len(values),
        **{f"p{q}": round(percentile(values, q), 2) for q in (50, 90, 99)},
        "max": round(max(values), 2),
        "mean": round(statistics.mean(values), 2),
    }


def _plateau(rss: list[tuple[float, float, int]], sessions: int) -> dict:
    """RSS growth over the last half of the sessions (MB and %)."""
    half = [mb for _, mb, done in rss if done >= sessions // 2]
    if len(half) < 2:
        return {"growth_mb": None}
    first, last = statistics.mean(half[: max(1, len(half) // 5)]), statistics.mean(half[-max(1, len(half) // 5) :])
    return {
        "growth_mb": round(last - first, 1),
        "growth_pct": round(100 * (last - first) / first, 2),
        "peak_mb": max(mb for _, mb, _ in rss),
    }


def fairness(url: str, log: Log, text: str, worst_text: str, edits: int) -> dict:
    """Normal edits one after another, first alone, then while the worst-case request keeps running."""
    alone = [_timed_edit(url, text, index) for index in range(edits // 2)]
    stop = threading.Event()
    thread = threading.Thread(target=worst_case, args=(url, log, worst_text, stop), daemon=True)
    thread.start()
    while not log.worst_running:
        time.sleep(0.1)
    time.sleep(2)  # the worst case is computing
    during = [_timed_edit(url, text, index) for index in range(edits)]
    stop.set()
    thread.join(600)
    return {"alone": _percentiles(alone), "during_worst_case": _percentiles(during)}


def _timed_edit(url: str, text: str, index: int) -> float:
    """Seconds for one normal edit from a new session."""
    client = Client(url, verbose=False)
    _, ms = timed(lambda: client.predict(text, FIELD, FIELD_VALUES[index % 2], list(DEFAULT_STRATEGIES), 4, -1, api_name="/edit"))
    return ms / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("public", "local"), default="public")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--hostile-every", type=int, default=5)
    parser.add_argument("--probe-edits", type=int, default=20, help="normal edits timed while the worst-case request runs")
    parser.add_argument("--max-seconds", type=float, default=1500, help="stop sending visitors after this long")
    parser.add_argument("--context-tokens", type=int, default=None, help="the worst-case context (default: 90%% of the profile's limit)")
    args = parser.parse_args()
    if not 1 <= args.sessions <= 2000 or not 1 <= args.clients <= 32 or not 2 <= args.probe_edits <= 200:
        parser.error("keep --sessions within 1..2000, --clients within 1..32 and --probe-edits within 2..200 (loopback only, bounded)")
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    environment = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    command = [sys.executable, "app.py", "--model", args.model, "--port", str(port), *(["--public"] if args.profile == "public" else [])]
    server = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, stop_rss = Log(), threading.Event()
    text = bundled_scenarios()[SCENARIO].read_text()
    started = time.time()
    try:
        wait_until_serving(url, 600)
        limits = Client(url, verbose=False).predict(api_name="/server_memory")
        limit = int(limits.split("context ≤ ")[1].split(" tokens")[0].replace(",", "")) if "context ≤ " in limits else 2048
        target = args.context_tokens or int(limit * 0.9)
        worst_text = _padded_scenario(text, (target - 140) // 11)  # ~11 tokens per note line (Qwen2.5 tokenizer)
        over_limit = _padded_scenario(text, limit // 8)
        threading.Thread(target=sample_rss, args=(server.pid, log, stop_rss), daemon=True).start()
        Client(url, verbose=False).predict(text, api_name="/prepare")
        with ThreadPoolExecutor(max_workers=args.clients) as pool:
            futures = []
            for index in range(args.sessions):
                hostile_turn = args.hostile_every and index % args.hostile_every == args.hostile_every - 1
                if hostile_turn:
                    futures.append(pool.submit(hostile, url, log, index // args.hostile_every, text, over_limit))
                else:
                    futures.append(pool.submit(visitor, url, log, index, text))
            for future in futures:
                remaining = args.max_seconds - (time.time() - started)
                try:
                    future.result(timeout=max(remaining, 1))
                except Exception as error:  # noqa: BLE001 - an unexpected failure of a normal visitor
                    with log.lock:
                        log.errors.append({"kind": "normal visitor failed", "message": str(error)[:300], "expected": False})
        visitors_s = time.time() - started
        memory_after_visitors = Client(url, verbose=False).predict(api_name="/server_memory")
        fair = fairness(url, log, text, worst_text, args.probe_edits)
    finally:
        stop_rss.set()
        server.terminate()
        server.wait(timeout=30)
    under_load = [edit["seconds"] for edit in log.edits]
    unexpected = [error for error in log.errors if not error["expected"]]
    result = {
        "profile": args.profile,
        "model": args.model,
        "sessions": log.done,
        "clients": args.clients,
        "cpus": os.cpu_count(),
        "visitors_seconds": round(visitors_s, 1),
        "worst_case_context_tokens": target,
        "rss_plateau": _plateau([sample for sample in log.rss if sample[0] <= visitors_s], log.done),
        "percentile": PERCENTILE,
        "edit_seconds_under_load": _percentiles(under_load),
        "edit_seconds_alone": fair["alone"],
        "edit_seconds_during_worst_case": fair["during_worst_case"],
        "worst_case_requests": log.worst,
        "cross_talk": log.cross_talk,
        "refusals": log.errors,
        "unexpected_errors": len(unexpected),
        "server_memory_after_visitors": memory_after_visitors,
        "rss_mb": log.rss,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"soak-{args.profile}.json"
    out.write_text(json.dumps(result, indent=2))
    soak_figure(result).write_html(out.with_suffix(".html"), include_plotlyjs="cdn")
    print(json.dumps({key: value for key, value in result.items() if key not in ("rss_mb", "refusals")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
