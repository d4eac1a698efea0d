"""Several skills at once: tie-aware splice fidelity for N = 1–4 skills, orders and placements, per remedy.

    python -m benchmarks.compose_many [--model embedded] [--scenarios refund_gate,machine_safety]
        [--skills refund_policy,tone_guide,tool_specs,rag_shipping_facts] [--placements start,after_fields,end]
        [--remedies splice,seam:1,...]

For every scenario and both values of its first field, the first N skills (N = 1..4, and all of them
reversed, at the start) are placed at each placement, each skill compiled in isolation. The composed prompt is
recomputed once and spliced with every remedy (``engine.compose.splice.Remedy``). Decision agreement counts only
cases whose recomputed margin is decisive (|margin| ≥ 0.25); ties are reported apart. Writes
benchmarks/results/compose_many-<model>-<device>.json and an HTML figure (remedy frontier and margin error by N).
Timings are single runs side by side (the full recompute once per case); the ranked remedies (deviation,
causal) rank against that recompute, so their TTFT leaves out a cost a server would pay.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import RESULTS, write_result
from engine.compose.skills import SkillStore
from engine.compose.splice import Remedy
from engine.compose.study import REMEDIES, Study, first_field_values, run_study, skill_prefixes
from engine.scenario import Scenario, bundled_scenarios
from viz.compose import study_figure


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.add_argument("--scenarios", default="refund_gate,machine_safety")
    parser.add_argument("--skills", default="refund_policy,tone_guide,tool_specs,rag_shipping_facts")
    parser.add_argument("--placements", default="start,after_fields,end")
    parser.add_argument("--remedies", default=",".join(REMEDIES))
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON and figure")
    args = parser.parse_args(argv)
    lm = common.load(args)
    remedies = [Remedy.parse(text) for text in args.remedies.split(",")]
    skills = args.skills.split(",")
    store, cases = SkillStore(), []
    placements = args.placements.split(",")
    plans = [(skill_prefixes(skills), placements), ([tuple(reversed(skills))] if len(skills) > 1 else [], ["start"])]
    names = args.scenarios.split(",")
    bar = tqdm(total=len(names) * 2 * sum(len(sets) * len(at) for sets, at in plans) * len(remedies), desc="splices")
    for name in names:
        scenario = Scenario.load(bundled_scenarios()[name])
        values = first_field_values(scenario)
        for sets, at in plans:
            if sets:
                cases += run_study(
                    lm, scenario, sets, store, remedies=remedies, placements=at, values=values, progress=lambda _done, _total: bar.update(1)
                ).cases
    study = Study(remedies, cases)
    data = study.as_dict()
    out = write_result("compose_many", lm, {"scenarios": names, "skills": skills, "placements": placements, **data}, Path(args.out))
    study_figure(data).write_html(out.with_suffix(".html"), include_plotlyjs="cdn")
    for name, row in data["summary"].items():
        print(
            f"{name:32s} agree {row['agree_decisive']}/{row['decisive']} (ties {row['ties']})  |Δm| {row['mean_abs_margin_error']:.3f}  "
            f"cos {row['cosine']['median']:.4f}  recomputed {row['recomputed_fraction']:.1%}  speedup ×{row['speedup']['median']:.2f}"
        )
    print("best deployable remedy:", data["best"], "→", out)
    return data


if __name__ == "__main__":
    main()
