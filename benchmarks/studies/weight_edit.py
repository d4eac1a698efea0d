"""Cache editing vs weight editing over the flipping demos: ROME, LoRA and field_erratum, measured in one run each.

    python -m benchmarks.studies.weight_edit [--model embedded] [--scenarios a,b,...] [--methods rome,lora,field_erratum] [--collateral 6]

For every scenario whose clean prefill changes the decision (stale label ≠ oracle label; the others are listed
as skipped), ``kvscope.engine.edit.weight_edit.compare_edits`` runs each method on the same edit: efficacy (recovery on the
edited request), contamination (the same case for three other customers, old value kept, now decided the new
way), collateral over every other bundled scenario (decision changed; mean |Δmargin|), edit time, one-time setup
(ROME's key covariance, once per layer) and memory. Writes benchmarks/studies/results/weight_edit-<model>-<device>.json
with per-method means and an HTML figure of the first scenario.
"""

from __future__ import annotations

import statistics

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import results_dir, write_result
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.weight_edit import METHODS, compare_edits
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.viz.weights import weight_edit_figure

CONTROLS = ("request_id_control", "ticket_id_control", "timestamp_control")  # built not to flip
SUMMARY = ("efficacy", "contamination", "collateral", "collateral_mean_abs_delta", "edit_ms", "setup_ms", "memory_bytes")


def _summary(rows: list[dict], methods: list[str]) -> dict:
    """Per method: the mean of each measure over the edited scenarios (efficacy over defined values)."""
    summary = {}
    for method in methods:
        outcomes = [row["methods"][method] for row in rows]
        summary[method] = {
            key: round(statistics.fmean(values), 4) if (values := [o[key] for o in outcomes if o[key] is not None]) else None
            for key in SUMMARY
        }
        summary[method]["flipped"] = sum(o["decision"] == row["oracle"]["decision"] for o, row in zip(outcomes, rows))
    return summary


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--scenarios", help="comma-separated bundled scenario names (default: every demo but the controls)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--collateral", type=int, default=6, help="unrelated scenarios read per edit (all: 0); each costs 4 reads")
    args = parser.parse_args()
    lm = common.load(args)
    bundled = {name: Scenario.load(path) for name, path in bundled_scenarios().items()}
    names = args.scenarios.split(",") if args.scenarios else [n for n in bundled if n not in CONTROLS]
    methods = args.methods.split(",")
    rows, skipped, first = [], [], None
    for name in tqdm(names, desc="scenarios"):
        experiment = EditExperiment(lm, bundled[name])
        if experiment.stale.decision.label == experiment.oracle.decision.label:
            skipped.append({"scenario": name, "reason": f"the clean prefill keeps {experiment.stale.decision.label}: no flip to edit"})
            continue
        others = [scenario for other, scenario in bundled.items() if other != name]
        report = compare_edits(lm, bundled[name], others[: args.collateral or None], methods=methods)
        first = first or report
        rows.append({"scenario": name, **report.as_dict()})
        print(
            f"{name:>24}: "
            + "; ".join(
                f"{m} eff {o.efficacy} cont {o.contamination:.2f} coll {o.collateral:.2f} {o.edit_ms / 1000:.1f} s"
                for m, o in report.methods.items()
            )
        )
    result = {
        "methods": methods,
        "collateral_scenarios": args.collateral or "all",
        "summary": _summary(rows, methods),
        "rows": rows,
        "skipped": skipped,
        "paper": {
            "model": "Llama-3.1-8B",
            "rome": {"edit_s": 5.6, "setup_s": 11.6, "contamination": 1.0, "collateral": 0.5},
            "lora": {"edit_s": 3.1, "contamination": 1.0, "collateral": 0.5},
            "field_erratum": {"edit_ms": 114, "contamination": 0.0},
        },
    }
    out = write_result("weight_edit", lm, result, results_dir(__file__))
    if first is not None:
        figure_path = out.with_suffix(".html")
        weight_edit_figure(first).write_html(figure_path, include_plotlyjs="cdn")
        print(f"wrote {figure_path}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
