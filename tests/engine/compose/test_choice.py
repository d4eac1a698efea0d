"""The composer's default remedy: one rule over measured summaries, calibrated once per model and kept in the cache."""

from __future__ import annotations

import json

import pytest

from engine.compose import choice as choice_module
from engine.compose.choice import AUTO, CalibrationPlan, calibrated_remedy, choose_remedy, gaps_of, resolve_remedy, stored_choice
from engine.compose.splice import DEFAULT_REMEDY, Remedy
from engine.errors import KVScopeError
from tests.engine.test_cli import run_cli


def row(agree: int, decisive: int, speedup: float, fraction: float, *, reference: bool = False, error: float = 0.1) -> dict:
    """A study summary row as ``Study.summary()`` writes it."""
    return {
        "agree_decisive": agree,
        "decisive": decisive,
        "ties": 2,
        "agreement": agree / decisive,
        "speedup": {"min": speedup * 0.9, "median": speedup, "max": speedup * 1.1},
        "recomputed_fraction": fraction,
        "mean_abs_margin_error": error,
        "needs_reference": reference,
    }


SUMMARY = {
    "splice": row(32, 35, 6.0, 0.0),
    "prefix+seam:1": row(32, 35, 5.5, 0.003, error=0.05),
    "prefix+seam:1+blend:0.15": row(33, 35, 2.6, 0.15),
    "prefix+seam:1+blend:0.7": row(35, 35, 1.2, 0.7),
    "deviation:0.5": row(35, 35, 9.0, 0.5, reference=True),
}


def test_the_goal_met_picks_the_fastest_remedy_that_meets_it():
    summary = SUMMARY | {"prefix+seam:1+query:0.05": row(34, 35, 4.5, 0.05), "prefix+seam:1+query:0.1": row(35, 35, 4.3, 0.1)}
    choice = choose_remedy(summary)
    # 0.97 · 35 = 33.95: 34/35 meets the agreement goal; 0.7 · 6.0 = 4.2: both query points keep the speed
    assert choice.goal_met and choice.remedy == "prefix+seam:1+query:0.05" and choice.splice_speedup == 6.0
    assert "fastest remedy keeping" in choice.reason and "34/35" in choice.chosen.words()
    assert "deviation:0.5" not in {point.name for point in choice.points}  # ranked against the recompute: not deployable


def test_without_the_goal_the_best_trade_off_is_stated_with_the_frontier():
    choice = choose_remedy(SUMMARY)
    # attained shares: splice 0.942 + 1, prefix+seam:1 0.942 + 1 (slower: the tie goes to the faster), blend:0.15 0.972 + 0.619
    assert not choice.goal_met and choice.remedy == "splice"
    assert "no remedy keeps ≥ 97%" in choice.reason and "(≥ ×4.20)" in choice.reason
    assert [point.name for point in choice.frontier()] == ["splice", "prefix+seam:1+blend:0.15", "prefix+seam:1+blend:0.7"]
    assert choice.fastest.name == "splice" and choice.most_faithful.name == "prefix+seam:1+blend:0.7"


def test_the_keystone_bar_sets_aside_remedies_that_fail_it_unless_all_do():
    gaps = {"splice": 0.6, "prefix+seam:1": 0.24, "prefix+seam:1+blend:0.15": 0.06, "prefix+seam:1+blend:0.7": 0.04}
    choice = choose_remedy(SUMMARY, gaps)
    assert choice.remedy == "prefix+seam:1+blend:0.15" and "within the keystone bar" in choice.reason
    assert choice.chosen.keystone_gap == 0.06
    failing = choose_remedy(SUMMARY, {name: 0.5 for name in gaps})
    assert failing.remedy == "splice" and "all were kept" in failing.reason


def test_keystone_gaps_count_only_where_the_edit_moves_the_decision():
    moved = {"seam:1": {"delta_margin": 1.4, "max_recovery_gap": 0.62}, "blend:0.3": {"delta_margin": 1.4, "max_recovery_gap": 0.26}}
    assert gaps_of(moved) == {"delta_margin": 1.4, "gaps": {"seam:1": 0.62, "blend:0.3": 0.26}}
    still = {name: value | {"delta_margin": 0.3} for name, value in moved.items()}
    assert gaps_of(still) == {"delta_margin": 0.3, "gaps": {}}


def test_nothing_deployable_is_refused():
    with pytest.raises(KVScopeError, match="no deployable remedy"):
        choose_remedy({"deviation:0.5": SUMMARY["deviation:0.5"]})


def test_a_choice_round_trips_through_its_dict():
    choice = choose_remedy(SUMMARY, {"splice": 0.5}, source="study")
    again = choice_module.RemedyChoice.from_dict(json.loads(json.dumps(choice.as_dict())))
    assert again == choice and again.as_dict()["frontier"] == ["splice", "prefix+seam:1+blend:0.15", "prefix+seam:1+blend:0.7"]


PLAN = CalibrationPlan(
    scenarios=("refund_gate",),
    skills=("account_gate",),
    sizes=(1,),
    placements=("start",),
    remedies=("splice", "seam:1"),
    keystone_scenario=None,
)


def test_calibration_runs_once_per_model_is_stored_and_auto_reads_it(lm, store, tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    assert stored_choice(lm) is None
    measured = calibrated_remedy(lm, store, PLAN)
    assert measured.measured["cases"] == 2 and {point.name for point in measured.points} <= {"splice", "seam:1"}
    stored = json.loads((tmp_path / "remedy-choices.json").read_text())
    (key,) = stored
    assert key.startswith(lm.fingerprint.name) and key.endswith("|float32|cpu") and stored[key]["remedy"] == measured.remedy

    def refuse(*_args, **_kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(choice_module, "measure_choice", refuse)
    assert calibrated_remedy(lm, store) == measured == stored_choice(lm)
    assert resolve_remedy(lm, AUTO, store) == Remedy.parse(measured.remedy)
    assert resolve_remedy(lm, "", store) == DEFAULT_REMEDY and resolve_remedy(lm, "seam:3", store) == Remedy(seam=3)


def test_a_calibration_without_a_decisive_case_falls_back_to_the_static_default(lm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        choice_module, "run_study", lambda _lm, _scenario, _sets, _store, *, remedies, **_: choice_module.Study(remedies, [])
    )
    fallback = calibrated_remedy(lm, store, PLAN)
    assert fallback.remedy == DEFAULT_REMEDY.name and not fallback.goal_met and "no decisive" not in fallback.reason
    assert "had a decisive decision" in fallback.reason and fallback.chosen is None and fallback.as_dict()["fastest"] is None
    assert stored_choice(lm) == fallback and resolve_remedy(lm, AUTO, store) == DEFAULT_REMEDY


def test_the_cli_compose_with_auto_uses_the_calibrated_remedy(lm, store, tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(choice_module, "CalibrationPlan", lambda: PLAN)
    code, data = run_cli("compose", "--model", "tiny-qwen2", "--skills", "account_gate", "--remedy", "auto")
    assert code == 0 and data["remedy"]["name"] == data["remedy_choice"]["remedy"]
    assert data["remedy_choice"]["measured"]["plan"]["skills"] == ["account_gate"]
    assert {"goal_met", "reason", "frontier", "fastest", "most_faithful"} <= set(data["remedy_choice"])
