"""Keystone on a flipping skill: every edit strategy on the composed vs the recomputed cache, per remedy.

    python -m benchmarks.studies.keystone [--model embedded] [--scenario keystone_safety] [--remedies seam:1,...]

The scenario's deciding field lives inside a spliced skill (``keystone_safety``: the safety gate compiled after
the model's default system prompt, spliced after a longer one). For each remedy the keystone runs every
applicable strategy on both caches; the result lists |Δmargin| (oracle − stale, recomputed), each strategy's
recovery on both and their gap, and the largest gap (the issue's bar: within 0.15). Writes
benchmarks/studies/results/keystone-<model>-<device>.json; the N-skill studies can take their keystone gaps from it
(``--keystone-result``) instead of measuring them again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import cpu_info, results_dir, write_result
from kvscope.engine.compose.choice import gaps_of
from kvscope.engine.compose.keystone import keystone
from kvscope.engine.compose.remedy import Remedy, split_remedies
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.engine.timing import Stopwatch

REMEDIES = (  # every deployable remedy of the N-skill studies (their --keystone-result), and longer seams
    "splice",
    "seam:1",
    "seam:8",
    "seam:16",
    "seam:32",
    "aggregators",
    "seam:8+aggregators",
    "seam:1+aggregators",
    "prefix+seam:1",
    "prefix+seam:1+aggregators",
    "prefix+seam:16",
    "blend:0.3",
    "prefix+seam:1+blend:0.15",
    "prefix+seam:1+blend:0.3",
    "prefix+seam:1+blend:0.5",
    "prefix+seam:1+blend:0.7",
    "prefix+seam:1+query:0.05",
    "prefix+seam:1+query:0.15",
    "prefix+ape:0.9,0.9",
    "prefix+ape:1,0.8",
    "prefix+ape:1,0.7",
    "prefix+seam:1+ape:0.9,0.9",
    "prefix+seam:1+ape:1,0.8",
    "prefix+seam:1+ape:1,0.7",
)


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.add_argument("--scenario", default="keystone_safety")
    parser.add_argument("--remedies", default=",".join(REMEDIES))
    parser.add_argument("--out", default=str(results_dir(__file__)), help="folder for the JSON")
    args = parser.parse_args(argv)
    lm = common.load(args)
    scenario = Scenario.load(bundled_scenarios()[args.scenario])
    store, rows, recomputed = SkillStore(), {}, None
    load_before, watch = os.getloadavg(), Stopwatch()
    for text in tqdm(split_remedies(args.remedies), desc="remedies"):
        report = keystone(lm, scenario, store, remedy=Remedy.parse(text), recomputed=recomputed)
        rows[text], recomputed = report.as_dict(), report.recomputed  # the recomputed side does not depend on the remedy
        gaps = {name: gap for name, gap in report.recovery_gaps().items() if gap is not None}
        print(
            f"{text:22s} Δmargin {report.delta_margin:+.3f}  max |gap| {rows[text]['max_recovery_gap']}  "
            + "  ".join(f"{name} {gap:+.2f}" for name, gap in gaps.items())
        )
    data = {
        "cpu": cpu_info(),
        "reps": 1,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "total_s": round(watch.ms / 1000, 1),
        "scenario": scenario.name,
        "remedies": rows,
    }
    print("→", write_result("keystone", lm, data, Path(args.out)))
    return data


def stored_gaps(path: Path) -> dict:
    """A study's ``keystone`` section from a result this script wrote: its scenario, the edit's Δmargin, each remedy's worst
    gap (none where the edit moved the decision less than the keystone's bar) and the file it came from."""
    stored = json.loads(path.read_text())
    return {"scenario": stored["scenario"], **gaps_of(stored["remedies"]), "from": path.name}


if __name__ == "__main__":
    main()
