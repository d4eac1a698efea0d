"""The N-skill study: cases, tie-aware summaries, the default remedy it picks."""

import pytest

from kvscope.engine.compose.placing import adhoc_scenario
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.compose.study import Study, run_study, skill_prefixes, summarize
from kvscope.engine.errors import KVScopeError
from kvscope.engine.scenario import Scenario, bundled_scenarios

SHORT = ["account_gate", "user_memory"]


def test_skill_prefixes_grow_in_order():
    assert skill_prefixes(["a", "b", "c"]) == [("a",), ("a", "b"), ("a", "b", "c")]


def test_study_cases_and_summary_are_consistent(lm, store):
    scenario = Scenario.load(bundled_scenarios()["refund_gate"])
    remedies = [Remedy(), Remedy(seam=10_000)]
    seen = []
    study = run_study(
        lm,
        scenario,
        skill_prefixes(SHORT),
        store,
        remedies=remedies,
        placements=("start", "after_fields"),
        values=({"refund_eligible": "false"}, {"refund_eligible": "true"}),
        progress=lambda done, total: seen.append((done, total)),
    )
    assert len(study.cases) == 2 * 2 * 2 and seen[-1] == (16, 16)
    summary = study.summary()
    exact = summary["seam:10000"]
    assert exact["cases"] == 8 and exact["decisive"] + exact["ties"] == 8
    assert exact["agree_decisive"] == exact["decisive"] and exact["mean_abs_margin_error"] == pytest.approx(0.0, abs=1e-4)
    assert exact["cosine"]["min"] == pytest.approx(1.0, abs=1e-6) and exact["recomputed_fraction"] == pytest.approx(1.0)
    assert summary["splice"]["by_n"]["1"]["cases"] == 4 and summary["splice"]["recomputed_fraction"] == 0.0
    case = study.cases[0].as_dict()
    assert case["n"] == 1 and case["placement"] == "start" and set(case["remedies"]) == {"splice", "seam:10000"}
    decisive = [c for c in study.cases if c.results["splice"].match.decisive]
    assert summarize(study.cases, "splice")["agree_decisive"] == sum(bool(c.results["splice"].match.agree) for c in decisive)
    if exact["decisive"]:
        assert "seam:10000" in study.perfect()
        assert study.best() == "seam:10000"  # agrees everywhere with no margin error


def test_study_refuses_empty_or_repeated_remedies(lm, store):
    with pytest.raises(KVScopeError, match="at least one remedy"):
        run_study(lm, adhoc_scenario([]), [SHORT], store, remedies=[])
    with pytest.raises(KVScopeError, match="remedies repeat"):
        run_study(lm, adhoc_scenario([]), [SHORT], store, remedies=[Remedy(), Remedy.parse("splice")])


def test_best_ignores_ranked_remedies():
    study = Study([Remedy(select="deviation", fraction=0.5)], [])
    assert study.best() is None
