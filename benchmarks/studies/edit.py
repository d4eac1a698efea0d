"""Edit strategies' latency vs a full recompute, by context length; and the fast notes map vs exact patching.

    python -m benchmarks.studies.edit [--model embedded] [--lengths 256,1024,2048] [--notes-map-tokens 500]

A bundled scenario is padded with neutral text after its rule (more downstream tokens) to each length. For
each length every strategy runs on the same stale cache in one run, and its time is compared with the
oracle's (a clean prefill with the new value + read). The notes-map part times attribution patching
against exact per-position patching on a ~500-token context and reports top-8 agreement. Writes
benchmarks/studies/results/edit-<model>-<device>.json.
"""

from __future__ import annotations

import dataclasses
import statistics

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import filler_text, results_dir, write_result
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.probes import probe_notes_map
from kvscope.engine.scenario import Scenario, bundled_scenarios, escape_braces, render

TIMED = ("field_only", "field_topk", "erratum", "field_erratum", "restate", "full_downstream", "oracle")


def padded(scenario: Scenario, lm, tokens: int) -> Scenario:
    """The scenario with neutral filler after its context, to about ``tokens`` context tokens."""
    base = len(render(scenario, lm.tokenizer).context_ids)
    if tokens <= base:
        return scenario
    filler = escape_braces(filler_text(lm, tokens - base))
    return dataclasses.replace(scenario, context=f"{scenario.context}\n\nMEETING LOG\n{filler}")


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--scenario", default="refund_gate")
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--notes-map-tokens", type=int, default=500)
    args = parser.parse_args()
    lm = common.load(args)
    scenario = Scenario.load(bundled_scenarios()[args.scenario])
    rows = []
    for length in tqdm([int(n) for n in args.lengths.split(",")], desc="context lengths"):
        experiment = EditExperiment(lm, padded(scenario, lm, length), settings=EditSettings(top_k=8))
        times = {name: [] for name in TIMED}
        for _ in range(args.reps):
            for name in TIMED:
                outcome = experiment.run(name)
                if outcome.applicable:
                    times[name].append(outcome.ms)
        result = {name: round(statistics.median(values), 1) if values else None for name, values in times.items()}
        full = result["oracle"]
        rows.append(
            {
                "context_tokens": len(experiment.prompt.context_ids),
                "ms": result,
                "speedup_vs_full_recompute": {name: round(full / ms, 2) if ms else None for name, ms in result.items() if name != "oracle"},
            }
        )
        print(rows[-1])
    experiment = EditExperiment(lm, padded(scenario, lm, args.notes_map_tokens))
    notes = probe_notes_map(experiment, exact=True).as_dict()
    notes_map = {
        "context_tokens": len(experiment.prompt.context_ids),
        "attribution_ms": notes["attribution_ms"],
        "exact_ms": notes["exact_ms"],
        "speedup": round(notes["exact_ms"] / notes["attribution_ms"], 1),
        "top8_overlap_with_exact": notes["exact_overlap"],
        "pearson": notes["exact_pearson"],
    }
    print(notes_map)
    out = write_result(
        "edit", lm, {"scenario": scenario.name, "reps": args.reps, "rows": rows, "notes_map": notes_map}, results_dir(__file__)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
