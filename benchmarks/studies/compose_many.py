"""Several skills at once: tie-aware splice fidelity for N = 1–4 skills, orders and placements, per remedy.

    python -m benchmarks.studies.compose_many [--model embedded] [--scenarios refund_gate,machine_safety]
        [--skills refund_policy,tone_guide,tool_specs,rag_shipping_facts] [--placements start,after_fields,end]
        [--remedies splice,seam:1,...] [--keystone keystone_safety | --keystone-result JSON]
    python -m benchmarks.studies.compose_many --rechoose RESULT.json [--keystone-result keystone-RESULT.json]
    python -m benchmarks.studies.compose_many --frontiers RESULT.json,RESULT.json [--out DIR]

For every scenario and both values of its first field, the first N skills (N = 1..4, and all of them
reversed, at the start) are placed at each placement, each skill compiled in isolation. The composed prompt is
recomputed once and spliced with every remedy (``kvscope.engine.compose.remedy.Remedy``). Decision agreement counts only
cases whose recomputed margin is decisive (|margin| ≥ 0.25); ties are reported apart. Writes
benchmarks/studies/results/compose_many-<model>-<device>.json and an HTML figure (remedy frontier and margin error by N).
Timings are single runs side by side (the full recompute once per case); the ranked remedies (deviation,
causal) rank against that recompute, so their TTFT leaves out a cost a server would pay. Then the keystone (an edit
inside a spliced skill) per deployable remedy (or its gaps from a stored keystone benchmark, ``--keystone-result``),
and ``default`` / ``choice``: the remedy ``kvscope.engine.compose.choice.choose_remedy`` picks from this run's numbers.
``--rechoose`` measures nothing: it re-applies that rule to a stored study (with a stored keystone benchmark's gaps)
and writes the same keys into it. ``--frontiers`` measures nothing either: it draws stored studies of several models
side by side (``kvscope.viz.compose.frontiers_figure``) into compose_frontiers.html in ``--out``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import cpu_info, results_dir, write_result
from benchmarks.studies.keystone import stored_gaps
from kvscope.engine.compose.choice import choice_record, keystone_gaps
from kvscope.engine.compose.remedy import Remedy, split_remedies
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.study import REMEDIES, Study, first_field_values, run_study, skill_prefixes
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.engine.timing import Stopwatch
from kvscope.viz.compose import frontiers_figure, study_figure


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.add_argument("--scenarios", default="refund_gate,machine_safety")
    parser.add_argument("--skills", default="refund_policy,tone_guide,tool_specs,rag_shipping_facts")
    parser.add_argument("--placements", default="start,after_fields,end")
    parser.add_argument("--remedies", default=",".join(REMEDIES), help="comma-separated remedies (ape:T,S keeps its comma)")
    parser.add_argument("--keystone", default="keystone_safety", help="scenario of the keystone check per remedy ('' to skip)")
    parser.add_argument("--out", default=str(results_dir(__file__)), help="folder for the JSON and figure")
    parser.add_argument(
        "--rechoose",
        metavar="RESULT",
        help="measure nothing: re-apply the default-choice rule to this stored study, with the keystone gaps of --keystone-result",
    )
    parser.add_argument(
        "--keystone-result",
        metavar="JSON",
        help="take the keystone gaps from this stored benchmarks/studies/keystone.py result instead of measuring",
    )
    parser.add_argument("--frontiers", metavar="RESULTS", help="measure nothing: draw these stored studies (comma-separated) side by side")
    args = parser.parse_args(argv)
    if args.rechoose:
        return rechoose(Path(args.rechoose), Path(args.keystone_result) if args.keystone_result else None)
    if args.frontiers:
        return frontiers([Path(path) for path in args.frontiers.split(",")], Path(args.out))
    lm = common.load(args)
    remedies = [Remedy.parse(text) for text in split_remedies(args.remedies)]
    load_before, watch = os.getloadavg(), Stopwatch()
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
    checked = (
        stored_gaps(Path(args.keystone_result))
        if args.keystone_result
        else keystone_gaps(lm, store, remedies, args.keystone)
        if args.keystone
        else {"scenario": None, "delta_margin": None, "gaps": {}}
    )
    data |= choice_record(data["summary"], checked["gaps"], source=f"compose_many, {lm.fingerprint.name} ({lm.fingerprint.dtype})")
    data |= {
        "keystone": checked,
        "cpu": cpu_info(),
        "reps": 1,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "total_s": round(watch.ms / 1000, 1),
    }
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
    checked = stored_gaps(keystone_result) if keystone_result else {"scenario": None, "delta_margin": None, "gaps": {}, "from": None}
    data |= choice_record(data["summary"], checked["gaps"], source=f"{path.name} (re-chosen from stored numbers)")
    data["keystone"] = checked
    path.write_text(json.dumps(data, indent=2))
    print("default:", data["default"], "—", (data["choice"] or {}).get("reason", data.get("no_default")), "→", path)
    return data


def frontiers(paths: list[Path], out: Path) -> dict:
    """Draw stored studies side by side into ``out``/compose_frontiers.html; returns which files it drew."""
    studies = [json.loads(path.read_text()) for path in paths]
    target = out / "compose_frontiers.html"
    frontiers_figure(studies).write_html(target, include_plotlyjs="cdn")
    print("→", target)
    return {"studies": [path.name for path in paths], "figure": str(target)}


if __name__ == "__main__":
    main()
