"""Splice fidelity on the default model: every bundled skill at several seams, and decisions on every demo.

    python -m benchmarks.studies.fidelity [--model embedded] [--seams 0,1,2,4] [--host refund_gate] [--skill refund_policy]

Part 1: each bundled skill is placed before a host scenario's context (after its system turn, so the
skill's keys really move) and spliced with each seam; logit cosine, KL and top-1 agreement vs a full
recompute. Part 2: one skill spliced before every bundled scenario, with the old and the new field value;
does the spliced decision agree with the recomputed one? Writes benchmarks/studies/results/fidelity-<model>-<device>.json.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import results_dir, write_result
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.scenario import Scenario, bundled_scenarios, bundled_skills


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--seams", default="0,1,2,4")
    parser.add_argument("--host", default="refund_gate", help="scenario the skills are placed into")
    parser.add_argument("--skill", default="refund_policy", help="skill spliced into every scenario in part 2")
    args = parser.parse_args()
    lm = common.load(args)
    store, seams = SkillStore(), [int(s) for s in args.seams.split(",")]
    host = Scenario.load(bundled_scenarios()[args.host])
    skills = []
    for skill_id in tqdm(list(bundled_skills()), desc="skills"):
        placed = with_skills(host, [skill_id], "start")
        row = {"skill": skill_id}
        for seam in seams:
            data = compare(lm, placed, store, seam=seam).as_dict()
            row[f"seam{seam}"] = {k: data[k] for k in ("cosine", "kl", "top1_agree", "decision_agree")}
            row["skill_tokens"] = data["skill_tokens"]
        skills.append(row)
        print(skill_id, {s: row[f"seam{s}"]["cosine"] for s in seams})
    decisions = []
    for name, path in tqdm(bundled_scenarios().items(), desc="scenarios"):
        scenario = Scenario.load(path)
        if args.skill in scenario.skills:
            continue
        placed = with_skills(scenario, [args.skill], "start")
        field = scenario.field()
        for value in (field.old, field.new):
            data = compare(lm, placed, store, seam=1, values={field.name: value}).as_dict()
            decisions.append(
                {
                    "scenario": name,
                    "field": field.name,
                    "value": value,
                    "spliced": data["spliced"]["decision"],
                    "recomputed": data["recomputed"]["decision"],
                    "decision_agree": data["decision_agree"],
                    "cosine": data["cosine"],
                }
            )
    summary = {f"min_cosine_seam{seam}": min(row[f"seam{seam}"]["cosine"] for row in skills) for seam in seams} | {
        "decision_agreement": sum(d["decision_agree"] for d in decisions) / max(len(decisions), 1)
    }
    out = write_result(
        "fidelity",
        lm,
        {"host": args.host, "skill": args.skill, "summary": summary, "skills": skills, "decisions": decisions},
        results_dir(__file__),
    )
    print(summary)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
