"""App latency through its API: start-up, a field edit (all Notes panels), and splice vs recompute.

    python -m benchmarks.app.app_latency [--model embedded] [--scenario refund_gate] [--reps 5]

Starts `python app.py` on a free loopback port (the model cache must exist: run the app once before),
measures the time until the page answers, then calls the named endpoints with gradio_client, as a browser
would: picking a scenario prepares its cache (`/prepare`), an edit on a prepared scenario (`/edit`, new
value side computed every time), an edit of a scenario never seen (the preparation included), and the
composer's comparison with and without a scenario after the skill, for a new context and when only the
seam changes (the recomputed side is then reused). Writes
benchmarks/app/results/app-<model>-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from gradio_client import Client

from benchmarks.common import ROOT, free_port, results_dir, wait_until_serving
from kvscope.engine.scenario import bundled_scenarios
from kvscope.engine.timing import Stopwatch, repeated

RESULTS = results_dir(__file__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--scenario", default="refund_gate")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    watch = Stopwatch()
    server = subprocess.Popen(
        [sys.executable, "app.py", "--model", args.model, "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    strategies = ["field_only", "erratum", "field_erratum", "full_downstream"]
    try:
        wait_until_serving(url, 600)
        start_s = watch.ms / 1000
        client = Client(url, verbose=False)
        text = bundled_scenarios()[args.scenario].read_text()

        def edit(scenario_text: str):
            return client.predict(scenario_text, None, None, strategies, 8, -1, False, api_name="/edit")

        def fresh(rep: int) -> str:
            return f"{text}\n# benchmark copy {rep}\n"  # a scenario text the app has not prepared yet

        edit(fresh(-1))  # warm-up
        _, roundtrip_ms = repeated(lambda rep: client.predict(args.scenario, api_name="/scenario"), args.reps)
        _, prepare_ms = repeated(lambda rep: client.predict(fresh(100 + rep), api_name="/prepare"), args.reps)
        client.predict(text, api_name="/prepare")
        result, edit_ms = repeated(lambda rep: edit(text), args.reps)
        _, cold_ms = repeated(lambda rep: edit(fresh(rep)), args.reps)
        compose = {}
        for after in (args.scenario, ""):

            def composed(rep: int, seam: int = 1):
                note = f"Ticket {rep}."  # a context the app has not compared yet (its recomputed side is cached)
                return client.predict(["account_gate"], note, "", after, f"seam:{seam}", api_name="/compose")

            composed(-1)  # warm-up
            view, ms = repeated(composed, args.reps)
            _, seam_ms = repeated(lambda rep: composed(args.reps - 1, seam=2 + rep), args.reps)
            compose[after or "question only"] = {
                "new_context_ms": ms.as_dict(),
                "seam_change_ms": seam_ms.as_dict(),
                "context_tokens": view[3]["context_tokens"],
                "ttft_ms": view[3]["ttft_ms"],
            }
    finally:
        server.terminate()
        server.wait(timeout=30)
    summary = result[5]
    output = {
        "model": summary["model"],
        "scenario": args.scenario,
        "context_tokens": summary["context_tokens"],
        "app_start_s": round(start_s, 2),
        "api_roundtrip_ms": roundtrip_ms.as_dict(),  # a call that computes nothing (/scenario): Gradio and client overhead
        "prepare_scenario_ms": prepare_ms.as_dict(),
        "edit_all_panels_ms": edit_ms.as_dict(),
        "edit_unprepared_scenario_ms": cold_ms.as_dict(),
        "compose": compose,
        "reps": args.reps,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"app-{summary['model'].split(':')[0]}-cpu.json"
    out.write_text(json.dumps(output, indent=2))
    print(json.dumps(output, indent=2))


if __name__ == "__main__":
    main()
