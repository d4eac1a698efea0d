"""Several skills at once: tie-aware splice fidelity for N = 1–4 skills, orders and placements, per remedy.

    python -m benchmarks.compose_many [--model embedded] [--scenarios refund_gate,machine_safety]
        [--skills refund_policy,tone_guide,tool_specs,rag_shipping_facts] [--placements start,after_fields,end]
        [--remedies splice,seam:1,...] [--keystone keystone_safety]
    python -m benchmarks.compose_many --rechoose RESULT.json [--keystone-result keystone-RESULT.json]

For every scenario and both values of its first field, the first N skills (N = 1..4, and all of them
reversed, at the start) are placed at each placement, each skill compiled in isolation. The composed prompt is
recomputed once and spliced with every remedy (``engine.compose.splice.Remedy``). Decision agreement counts only
cases whose recomputed margin is decisive (|margin| ≥ 0.25); ties are reported apart. Writes
benchmarks/results/compose_many-<model>-<device>.json and an HTML figure (remedy frontier and margin error by N).
Timings are single runs side by side (the full recompute once per case); the ranked remedies (deviation,
causal) rank against that recompute, so their TTFT leaves out a cost a server would pay. Then the keystone (an edit
inside a spliced skill) per deployable remedy, and ``default`` / ``choice``: the remedy
``engine.compose.choice.choose_remedy`` picks from this run's numbers. ``--rechoose`` measures nothing: it re-applies
that rule to a stored study (with a stored keystone benchmark's gaps) and writes the same keys into it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import RESULTS, write_result
from benchmarks.notes_sweep import cpu_info
from engine.compose.choice import choice_record, gaps_of, keystone_gaps
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
    parser.add_argument("--keystone", default="keystone_safety", help="scenario of the keystone check per remedy ('' to skip)")
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON and figure")
    parser.add_argument(
        "--rechoose",
        metavar="RESULT",
        help="measure nothing: re-apply the default-choice rule to this stored study, with the keystone gaps of --keystone-result",
    )
    parser.add_argument("--keystone-result", metavar="JSON", help="a stored benchmarks/keystone.py result (with --rechoose)")
    args = parser.parse_args(argv)
    if args.rechoose:
        return rechoose(Path(args.rechoose), Path(args.keystone_result) if args.keystone_result else None)
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
    checked = keystone_gaps(lm, store, remedies, args.keystone) if args.keystone else {"scenario": None, "delta_margin": None, "gaps": {}}
    data |= choice_record(data["summary"], checked["gaps"], source=f"compose_many, {lm.fingerprint.name} ({lm.fingerprint.dtype})")
    data |= {"keystone": checked, "cpu": cpu_info(), "reps": 1}
    out = write_result("compose_many", lm, {"scenarios": names, "skills": skills, "placements": placements, **data}, Path(args.out))
    study_figure(data).write_html(out.with_suffix(".html"), include_plotlyjs="cdn")
    for name, row in data["summary"].items():
        print(
            f"{name:32s} agree {row['agree_decisive']}/{row['decisive']} (ties {row['ties']})  |Δm| {row['mean_abs_margin_error']:.3f}  "
            f"cos {row['cosine']['median']:.4f}  recomputed {row['recomputed_fraction']:.1%}  speedup ×{row['speedup']['median']:.2f}"
        )
    print("default:", (data["choice"] or {}).get("reason", data.get("no_default")), "→", out)
    return data


def rechoose(path: Path, keystone_result: Path | None) -> dict:
    """Write ``default``, ``choice`` and ``keystone`` into a stored study from its own summary and, when given, a stored
    keystone benchmark's gaps (per remedy; none where that edit moved the decision less than the keystone's bar)."""
    data = json.loads(path.read_text())
    checked = {"scenario": None, "delta_margin": None, "gaps": {}, "from": None}
    if keystone_result:
        stored = json.loads(keystone_result.read_text())
        checked = {"scenario": stored["scenario"], **gaps_of(stored["remedies"]), "from": keystone_result.name}
    data |= choice_record(data["summary"], checked["gaps"], source=f"{path.name} (re-chosen from stored numbers)")
    data["keystone"] = checked
    path.write_text(json.dumps(data, indent=2))
    print("default:", data["default"], "—", (data["choice"] or {}).get("reason", data.get("no_default")), "→", path)
    return data


if __name__ == "__main__":
    main()
