"""The agent loop against the clean prompt of the current state: compaction policies and erratum wordings.

    python -m benchmarks.studies.agent [--model embedded] [--scenarios machine_safety,refund_gate,...] [--turns 28]
        [--policies never,every:4,adaptive] [--wording-turns 10]

For each flipping demo, a toggling episode of --turns state changes (the paper's stress test) runs once per
compaction policy; every turn the cached path (errata on a cached context, compacted by the policy) is read
beside a clean prefill of the current state and a re-prefill of the identical tokens. Reported per run:
agreement with the clean state (the paper's 0.81-1.00 over 13 models), with the identical tokens, margin
error, compactions and the cumulative TTFT speedup against clean prefills, all from the same run. Then the
erratum wordings on the first scenario (no compaction). Writes benchmarks/studies/results/agent-<model>-<device>.json
and an HTML figure.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import results_dir, write_result
from kvscope.engine.compose.agent import Compaction, run_agent
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.erratum import WORDINGS
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.viz.benchmarks import agent_policy_figure

SCENARIOS = "machine_safety,pharmacy_prescription,badge_access_yaml,refund_gate"
SUMMARY_KEYS = (
    "clean_state_agreement",
    "identical_tokens_agreement",
    "margin_error_vs_clean_state",
    "min_cosine_vs_clean_state",
    "compactions",
    "cumulative_ttft_ms",
    "cumulative_speedup_vs_clean_state",
    "state_sensitive",
)


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--scenarios", default=SCENARIOS)
    parser.add_argument("--turns", type=int, default=28)
    parser.add_argument("--policies", default="never,every:4,adaptive")
    parser.add_argument("--wording-turns", type=int, default=10)
    args = parser.parse_args()
    lm = common.load(args)
    policies = [Compaction.parse(text) for text in args.policies.split(",")]
    names = args.scenarios.split(",")
    scenarios = [Scenario.load(bundled_scenarios()[name]) for name in names]
    store, rows, wordings = SkillStore(), [], []
    for name, scenario in tqdm([(n, s) for n, s in zip(names, scenarios)], desc="scenarios"):
        for policy in policies:
            data = run_agent(lm, scenario, store, turns=args.turns, toggle=True, policy=policy).as_dict()
            rows.append(
                {
                    "scenario": name,
                    "policy": policy.name,
                    **{key: data[key] for key in SUMMARY_KEYS},
                    "per_turn": [
                        {
                            "turn": t["turn"],
                            "cached": t["cached"]["margin"],
                            "clean": t["clean_state"]["margin"],
                            "compacted": t["compacted"],
                        }
                        for t in data["turns"]
                    ],
                }
            )
            print(
                f"{name:>24} {policy.name:>12}: clean-state agreement {data['clean_state_agreement']:.3f}, identical "
                f"{data['identical_tokens_agreement']:.3f}, {data['compactions']} compactions, "
                f"TTFT ×{data['cumulative_speedup_vs_clean_state']}"
            )
    for wording in tqdm(WORDINGS, desc="wordings"):
        data = run_agent(lm, scenarios[0], store, turns=args.wording_turns, toggle=True, wording=wording).as_dict()
        wordings.append(
            {"scenario": names[0], "wording": wording, "example": WORDINGS[wording], **{key: data[key] for key in SUMMARY_KEYS}}
        )
        print(f"{wording:>10}: clean-state agreement {data['clean_state_agreement']:.3f}")
    result = {"turns": args.turns, "toggle": True, "rows": rows, "wordings": wordings, "wording_turns": args.wording_turns}
    out = write_result("agent", lm, result, results_dir(__file__))
    figure_path = out.with_suffix(".html")
    agent_policy_figure(result).write_html(figure_path, include_plotlyjs="cdn")
    print(f"wrote {out} and {figure_path}")


if __name__ == "__main__":
    main()
