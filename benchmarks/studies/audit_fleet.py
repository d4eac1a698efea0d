"""What routing keeps of the cache: the audit's fleets (``kvscope.engine.audit.simulate.fleet``) on the bundled interleaved log and a
generated agent log (``audit_scale.synthetic_log``: 50 sessions, a shared system prompt with a clock line), with the
embedded model's tokenizer, each router at 2, 4 and 8 replicas.

    python -m benchmarks.studies.audit_fleet [--requests 1000] [--replicas 2,4,8] [--out benchmarks/studies/results]

Writes benchmarks/studies/results/audit_fleet-cpu.json and prints the tables (Markdown, as the tab shows them).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks import common
from benchmarks.studies.audit_scale import _embedded_tokenizer_dir, synthetic_log
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.fleet import fleet_grid
from kvscope.viz.fleet import fleet_markdown


def fleet_study(text: str, tokenizer, replicas: str) -> dict:
    """One log's hit rate on one server and behind each router at each replica count."""
    scan = scan_log(tokenizer, read_log(text), ScanSettings(fleet=tuple(fleet_grid(replicas, None))))
    return {"requests": len(scan.requests), "engines": scan.totals().as_dict(), "fleet": [result.as_dict() for result in scan.fleet]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--out", default=str(common.results_dir(__file__)))
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer_dir = _embedded_tokenizer_dir()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    logs = {
        "interleaved_agents (bundled)": Path("demos/logs/traffic/interleaved_agents.jsonl").read_text(encoding="utf-8"),
        f"generated: {args.requests} requests, {args.sessions} sessions": "\n".join(
            json.dumps(record) for record in synthetic_log(args.requests, args.sessions)
        ),
    }
    results = {name: fleet_study(text, tokenizer, args.replicas) for name, text in logs.items()}
    for name, data in results.items():
        print(f"### {name}\n\n{fleet_markdown(data)}\n")
    data = {"benchmark": "audit_fleet", "tokenizer": tokenizer_dir.name, "load_average": list(os.getloadavg()), "logs": results}
    path = Path(args.out) / "audit_fleet-cpu.json"
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(path)


if __name__ == "__main__":
    main()
