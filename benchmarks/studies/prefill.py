"""Prefill time vs context length, and decision-read time on a cached context.

    python -m benchmarks.studies.prefill [--model embedded] [--lengths 256,512,1024,2048,4096] [--reps 2]

Prints a table and writes benchmarks/studies/results/prefill-<model>-<device>.json. Both numbers are measured in
the same run on the same notebook, so their ratio is what a cached context saves per question.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import filler_text, results_dir, write_result
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.scenario import Scenario, bundled_scenarios, render
from kvscope.engine.timing import repeated


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    lm = common.load(args)
    scenario = Scenario.load(bundled_scenarios()["refund_gate"])
    prompt = render(scenario, lm.tokenizer)
    rows = []
    for length in tqdm([int(n) for n in args.lengths.split(",")], desc="lengths"):
        ids = lm.tokenizer(filler_text(lm, length), add_special_tokens=False).input_ids
        notebook, prefill = repeated(lambda rep: Notebook.prefill(lm, ids), args.reps, warmup=1)
        _, read = repeated(lambda rep: notebook.read_prompt(prompt), args.reps, warmup=1)
        rows.append(
            {
                "tokens": len(ids),
                "prefill_ms": round(prefill.median, 1),
                "read_ms": round(read.median, 1),
                "prefill_over_read": round(prefill.median / read.median, 2),
            }
        )
    _, run = repeated(lambda rep: run_scenario(lm, scenario), args.reps, warmup=1)
    data = {"decode_tokens": len(prompt.decode_ids), "scenario_prefill_and_read_ms": round(run.median, 1), "rows": rows}
    out = write_result("prefill", lm, data, results_dir(__file__))
    print(f"{'tokens':>8} {'prefill ms':>12} {'read ms':>10} {'ratio':>7}")
    for row in rows:
        print(f"{row['tokens']:>8} {row['prefill_ms']:>12} {row['read_ms']:>10} {row['prefill_over_read']:>7}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
