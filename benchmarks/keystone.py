"""Keystone on a flipping skill: every edit strategy on the composed vs the recomputed cache, per remedy.

    python -m benchmarks.keystone [--model embedded] [--scenario keystone_safety] [--remedies seam:1,...]

The scenario's deciding field lives inside a spliced skill (``keystone_safety``: the safety gate compiled after
the model's default system prompt, spliced after a longer one). For each remedy the keystone runs every
applicable strategy on both caches; the result lists |Δmargin| (oracle − stale, recomputed), each strategy's
recovery on both and their gap, and the largest gap (the issue's bar: within 0.15). Writes
benchmarks/results/keystone-<model>-<device>.json.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import RESULTS, write_result
from engine.compose.keystone import keystone
from engine.compose.skills import SkillStore
from engine.compose.splice import Remedy
from engine.scenario import Scenario, bundled_scenarios

REMEDIES = (
    "seam:1",
    "seam:8",
    "seam:32",
    "aggregators",
    "seam:8+aggregators",
    "prefix+seam:1",
    "blend:0.3",
    "prefix+seam:1+blend:0.15",
    "prefix+seam:1+blend:0.3",
    "prefix+seam:1+blend:0.7",
)


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.add_argument("--scenario", default="keystone_safety")
    parser.add_argument("--remedies", default=",".join(REMEDIES))
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON")
    args = parser.parse_args(argv)
    lm = common.load(args)
    scenario = Scenario.load(bundled_scenarios()[args.scenario])
    store, rows = SkillStore(), {}
    for text in tqdm(args.remedies.split(","), desc="remedies"):
        report = keystone(lm, scenario, store, remedy=Remedy.parse(text))
        rows[text] = report.as_dict()
        gaps = {name: gap for name, gap in report.recovery_gaps().items() if gap is not None}
        print(
            f"{text:22s} Δmargin {report.delta_margin:+.3f}  max |gap| {rows[text]['max_recovery_gap']}  "
            + "  ".join(f"{name} {gap:+.2f}" for name, gap in gaps.items())
        )
    data = {"scenario": scenario.name, "remedies": rows}
    print("→", write_result("keystone", lm, data, Path(args.out)))
    return data


if __name__ == "__main__":
    main()
