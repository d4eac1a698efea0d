"""The Benchmarks tab's handlers: the stored results, and a quick live TTFT check on the loaded model."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvscope.app.handlers.common import bundled_scenario_text, guarded, parse_scenario
from kvscope.app.state import ModelRegistry
from kvscope.engine import StepProgress, ttft_by_length

BENCHMARKS_DIR = Path(__file__).parents[3] / "benchmarks"  # each folder of scripts keeps its JSON in its own results/
STUDY_RESULTS = BENCHMARKS_DIR / "studies" / "results"  # the stored N-skill studies the Composer's remedy menu reads
TTFT_SCENARIO = "refund_gate"  # the quick TTFT check measures what benchmarks/studies/ttft.py measured


def benchmark_results(kind: str | None = None) -> dict[str, dict]:
    """Every JSON under benchmarks/*/results (or those of one ``kind``: ``<kind>-….json``), by file stem, folder by folder."""
    paths = sorted(BENCHMARKS_DIR.glob(f"*/results/{kind}-*.json" if kind else "*/results/*.json"))
    return {path.stem: json.loads(path.read_text()) for path in paths}


@guarded
def quick_ttft(
    registry: ModelRegistry, spec: str | None = None, lengths: Sequence[int] = (128, 512), progress: StepProgress = None
) -> dict:
    """A small live TTFT table: the long policy cut to each length, spliced before the refund gate."""
    lm = registry.get(spec)
    scenario = parse_scenario(bundled_scenario_text(TTFT_SCENARIO))
    rows = []
    for row in ttft_by_length(lm, scenario, lengths, registry.skills(spec)):
        rows.append(row.as_dict())
        if progress:
            progress(len(rows), len(lengths))
    return {"model": lm.fingerprint.name, "device": str(lm.device), "rows": rows}
