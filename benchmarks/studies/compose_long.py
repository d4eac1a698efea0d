"""Long compositions: the N-skill study at about 1k–8k skill tokens, every deployable remedy side by side.

    python -m benchmarks.studies.compose_long [--model embedded] [--dtype float32] [--scenario refund_gate]
        [--lengths 1024,2048,4096,8192] [--compositions 1:start,4:end] [--skills long_policy,rag_shipping_facts,tool_specs,refund_policy]
        [--remedies splice,prefix+seam:1,...] [--keystone keystone_safety | --keystone-result JSON] [--reps 1] [--out DIR]

Real compositions are RAG passages, tool specs and policies of 1–8k tokens, where the question and scenario are a
small part of the prompt. For each total length T and each composition ``N:placement`` the first N skills, each cut
or repeated to T/N tokens (``kvscope.engine.compose.placing.skill_of_length``), are placed in the scenario, which is read at
both values of its first field: recomputed once, spliced with every remedy (``kvscope.engine.compose.study.run_study``).
Decision agreement counts decisive cases only (ties apart). Then the keystone (an edit inside a spliced skill) per
remedy, and the default by ``kvscope.engine.compose.choice.choose_remedy`` from this run's numbers. Writes
benchmarks/studies/results/compose_many-long-<model>-<device>.json: the environment, CPU flags, repetitions and load average,
``summary`` (all lengths) with ``by_length`` per remedy, ``default`` and ``choice`` beside it, and every case.
"""

from __future__ import annotations

import os
from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import cpu_info, results_dir, write_result
from benchmarks.studies.keystone import stored_gaps
from kvscope.engine.compose.choice import choice_record, keystone_gaps
from kvscope.engine.compose.placing import skill_of_length
from kvscope.engine.compose.remedy import Remedy, split_remedies
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.study import Study, StudyCase, first_field_values, run_study, summarize
from kvscope.engine.scenario import Scenario, Skill, bundled_scenarios, bundled_skills
from kvscope.engine.timing import Stopwatch

REMEDIES = ",".join(
    (
        "splice",
        "prefix+seam:1",
        "prefix+seam:1+query:0.05",
        "prefix+seam:1+query:0.15",
        "prefix+seam:1+blend:0.15",
        "prefix+seam:1+blend:0.3",
        "prefix+seam:16",
        "prefix+ape:0.9,0.9",
        "prefix+ape:1,0.8",
        "prefix+ape:1,0.7",
        "prefix+seam:1+ape:0.9,0.9",
        "prefix+seam:1+ape:1,0.8",
        "prefix+seam:1+ape:1,0.7",
    )
)


def _compositions(text: str) -> list[tuple[int, str]]:
    """``4:end,1:start`` as (skills, placement) pairs."""
    pairs = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        count, _, placement = part.partition(":")
        pairs.append((int(count), placement or "start"))
    return pairs


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.add_argument("--scenario", default="refund_gate")
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="total skill tokens per composition")
    parser.add_argument("--compositions", default="1:start,4:end", help="N:placement pairs: the first N skills at that placement")
    parser.add_argument("--skills", default="long_policy,rag_shipping_facts,tool_specs,refund_policy")
    parser.add_argument("--remedies", default=REMEDIES)
    parser.add_argument("--keystone", default="keystone_safety", help="scenario of the keystone check ('' to skip)")
    parser.add_argument(
        "--keystone-result",
        metavar="JSON",
        help="take the keystone gaps from this stored benchmarks/studies/keystone.py result instead of measuring",
    )
    parser.add_argument("--reps", type=int, default=1, help="timing repetitions per splice and recompute (median)")
    parser.add_argument("--out", default=str(results_dir(__file__)), help="folder for the JSON")
    args = parser.parse_args(argv)
    lm = common.load(args)
    remedies = [Remedy.parse(text) for text in split_remedies(args.remedies)]
    lengths = [int(n) for n in args.lengths.split(",")]
    compositions = _compositions(args.compositions)
    skills = [bundled_skills()[name] for name in args.skills.split(",")]
    scenario = Scenario.load(bundled_scenarios()[args.scenario])
    values = first_field_values(scenario)
    store, cases, case_lengths, by_length = SkillStore(), [], [], {}
    load_before, watch = os.getloadavg(), Stopwatch()
    bar = tqdm(total=len(lengths) * len(compositions) * len(values) * len(remedies), desc="splices")
    for length in lengths:
        length_cases: list[StudyCase] = []
        for count, placement in compositions:
            library = {s.id: s for s in (skill_of_length(lm, Skill.load(path), length // count) for path in skills[:count])}
            study = run_study(
                lm,
                scenario,
                [tuple(library)],
                store,
                remedies=remedies,
                placements=[placement],
                values=values,
                library=library,
                progress=lambda _done, _total: bar.update(1),
            )
            length_cases += study.cases
        cases += length_cases
        case_lengths += [length] * len(length_cases)
        by_length[str(length)] = {remedy.name: summarize(length_cases, remedy.name) for remedy in remedies}
    bar.close()
    summary = Study(remedies, cases).summary()
    for name, row in summary.items():
        row["by_length"] = {length: rows[name] for length, rows in by_length.items()}
    checked = (
        stored_gaps(Path(args.keystone_result))
        if args.keystone_result
        else keystone_gaps(lm, store, remedies, args.keystone)
        if args.keystone
        else {"scenario": None, "delta_margin": None, "gaps": {}}
    )
    record = choice_record(summary, checked["gaps"], source=f"compose_long, {lm.fingerprint.name} ({lm.fingerprint.dtype})")
    data = {
        "cpu": cpu_info(),
        "reps": args.reps,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "total_s": round(watch.ms / 1000, 1),
        "scenario": args.scenario,
        "lengths": lengths,
        "compositions": [f"{count}:{placement}" for count, placement in compositions],
        "skills": [s.stem for s in skills],
        "remedies": [remedy.as_dict() for remedy in remedies],
        "summary": summary,
        **record,
        "keystone": checked,
        "best": Study(remedies, cases).best(),
        "cases": [case.as_dict() | {"length": length} for case, length in zip(cases, case_lengths)],
    }
    out = write_result("compose_many-long", lm, data, Path(args.out))
    for name, row in summary.items():
        print(
            f"{name:28s} agree {row['agree_decisive']}/{row['decisive']} (ties {row['ties']})  |Δm| {row['mean_abs_margin_error']:.3f}  "
            f"cos {row['cosine']['median']:.4f}  recomputed {row['recomputed_fraction']:.1%}  "
            f"speedup ×{row['speedup']['min']:.2f}/{row['speedup']['median']:.2f}/{row['speedup']['max']:.2f}"
        )
    print("default:", data["default"], "—", (data["choice"] or {}).get("reason", data.get("no_default")), "→", out)
    return data


if __name__ == "__main__":
    main()
