"""Time to first token: splicing a precompiled skill vs a full prefill, by skill length.

    python -m benchmarks.studies.ttft [--model embedded] [--lengths 256,512,1024,2048,4096] [--seam 1] [--reps 3]

For each length a skill of that many tokens (the long policy, repeated or cut) is placed before a bundled
scenario's context. Both paths are timed side by side in the same run (median of --reps after a warm-up):
``full`` prefills everything and reads the first answer token; ``splice`` prefills only the scenario text,
splices the stored skill (compiled beforehand, as a server would) with seam repair, and reads. The
speedup is full / splice. Logit cosine and decision agreement are recorded beside the times. Runs on CUDA
when present (device/dtype auto); writes benchmarks/studies/results/ttft-<model>-<device>.json and an HTML plot.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import results_dir, write_result
from kvscope.engine.compose.placing import adhoc_scenario
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.ttft import ttft_by_length
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.viz.benchmarks import ttft_figure


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--scenario", default="refund_gate", help="scenario after the skill, or 'adhoc' for only a question")
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--seam", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    lm = common.load(args)
    scenario = adhoc_scenario([]) if args.scenario == "adhoc" else Scenario.load(bundled_scenarios()[args.scenario])
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for row in tqdm(
        ttft_by_length(lm, scenario, lengths, SkillStore(), remedy=Remedy(seam=args.seam), reps=args.reps),
        total=len(lengths),
        desc="skill lengths",
    ):
        rows.append(row.as_dict())
        print(
            f"{row.skill_tokens:>6} skill tokens: full {row.full_ms:>9.1f} ms  splice "
            f"{row.splice_ms:>8.1f} ms  ×{row.speedup:<6} cosine {row.cosine:.4f}"
        )
    data = {"scenario": scenario.name, "seam": args.seam, "reps": args.reps, "rows": rows}
    out = write_result(f"ttft-{args.scenario}", lm, data, results_dir(__file__))
    figure_path = out.with_suffix(".html")
    ttft_figure({"model": lm.fingerprint.name, "device": lm.device.type, **data}).write_html(figure_path, include_plotlyjs="cdn")
    print(f"wrote {out} and {figure_path}")


if __name__ == "__main__":
    main()
