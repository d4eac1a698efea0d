"""The composer's default remedy: one rule over measured summaries, calibrated once per model and kept in the cache."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvscope.engine.compose import calibration
from kvscope.engine.compose.calibration import AUTO, CalibrationPlan, calibrated_remedy, model_remedies, resolve_remedy, stored_choice
from kvscope.engine.compose.choice import RemedyChoice, choice_record, choose_remedy, gaps_of
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.errors import KVScopeError
from kvscope.engine.progress import fraction
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
    again = RemedyChoice.from_dict(json.loads(json.dumps(choice.as_dict())))
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

    monkeypatch.setattr(calibration, "measure_choice", refuse)
    assert calibrated_remedy(lm, store) == measured == stored_choice(lm)
    assert resolve_remedy(lm, AUTO, store) == Remedy.parse(measured.remedy)
    assert resolve_remedy(lm, "", store) == DEFAULT_REMEDY and resolve_remedy(lm, "seam:3", store) == Remedy(seam=3)


def test_a_calibration_without_a_decisive_case_falls_back_to_the_static_default(lm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "run_study", lambda _lm, _scenario, _sets, _store, *, remedies, **_: calibration.Study(remedies, []))
    fallback = calibrated_remedy(lm, store, PLAN)
    assert fallback.remedy == DEFAULT_REMEDY.name and not fallback.goal_met and "no decisive" not in fallback.reason
    assert "had a decisive decision" in fallback.reason and fallback.chosen is None and fallback.as_dict()["fastest"] is None
    assert stored_choice(lm) == fallback and resolve_remedy(lm, AUTO, store) == DEFAULT_REMEDY


def test_the_cli_compose_with_auto_uses_the_calibrated_remedy(lm, store, tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "CalibrationPlan", lambda: PLAN)
    code, data = run_cli("compose", "--model", "tiny-qwen2", "--skills", "account_gate", "--remedy", "auto")
    assert code == 0 and data["remedy"]["name"] == data["remedy_choice"]["remedy"]
    assert data["remedy_choice"]["measured"]["plan"]["skills"] == ["account_gate"]
    assert {"goal_met", "reason", "frontier", "fastest", "most_faithful"} <= set(data["remedy_choice"])


def _first_field(scenario_name: str):
    from kvscope.engine.scenario import Scenario, bundled_scenarios

    return next(iter(Scenario.load(bundled_scenarios()[scenario_name]).fields.values()))


def test_calibration_progress_names_the_prompt_the_remedy_and_k_of_n(lm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    messages: list[str] = []
    calibrated_remedy(lm, store, PLAN, report=messages.append)
    field = _first_field("refund_gate")
    expected = [
        f"prompt {k}/2 (refund_gate, 1 skill at start, {field.name} = {value}), remedy {remedy}; step {2 * (k - 1) + r + 1} of 4"
        for k, value in ((1, field.old), (2, field.new))
        for r, remedy in enumerate(("splice", "seam:1"))
    ]
    assert len(messages) == 4
    for message, words in zip(messages, expected, strict=True):
        assert message.startswith(f"calibrating remedy auto for {lm.fingerprint.name}: {words}, "), message
    assert [fraction(message) for message in messages] == [0.0, 0.25, 0.5, 0.75], "steps finished of the total, for a bar"
    assert messages[0].endswith("; 4 prompt steps left, timed once the first of each kind ends")
    assert all(" left" in message and "about " in message for message in messages[1:])


def test_the_time_left_is_estimated_phase_by_phase_from_the_steps_measured():
    now = [0.0]
    steps = [calibration.CalibrationStep("prompt", k, 3, f"p{k}", "splice") for k in (1, 2, 3)]
    steps += [calibration.CalibrationStep("keystone", k, 2, "keystone_safety", name) for k, name in ((1, "splice"), (2, "seam:1"))]
    run = calibration.CalibrationRun("m", steps, clock=lambda: now[0])
    assert run.begin(0).left_s is None
    now[0] = 2.0
    second = run.begin(1)  # one prompt step took 2 s: two prompt steps left, keystone not timed yet
    assert second.left_s == pytest.approx(4.0) and second.unmeasured == {"keystone": 2}
    assert second.words().endswith(
        "prompt 2/3 (p2), remedy splice; step 2 of 5, 2 s so far, about 4 s left plus 2 keystone steps, timed once the first ends"
    )
    now[0] = 6.0
    run.begin(2)  # prompt steps took 2 s and 4 s: a mean of 3 s
    now[0] = 7.0
    assert run.progress().left_s == pytest.approx(3.0 - 1.0), "the last prompt step has run 1 s of its 3"
    now[0] = 9.0
    keystone = run.begin(3)  # no keystone step measured: no estimate for what is left
    assert keystone.left_s is None and keystone.words().endswith("; 2 keystone steps left, timed once the first of each kind ends")
    now[0] = 39.0
    last = run.begin(4)
    assert last.left_s == pytest.approx(30.0) and last.unmeasured == {} and "about 30 s left" in last.words()


def test_a_cancelled_calibration_stops_within_one_forward_stores_nothing_and_can_run_again(lm, store, tmp_path, monkeypatch):
    from kvscope.engine.cache import adapter
    from kvscope.engine.cache.budget import Cancelled

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    path = tmp_path / "remedy-choices.json"
    path.write_text(json.dumps({"another-model|0|float32|cpu": {"remedy": "splice"}}))
    before = path.read_bytes()
    original, forwards, cancelled_at = adapter.forward, [], []

    def forward_then_cancel(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 5:
            cancelled_at.append(calibration.cancel_calibration(lm))  # during a forward
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", forward_then_cancel)
    with pytest.raises(Cancelled, match=r"calibration of tiny-qwen2 was cancelled at step \d of 4 .* nothing was stored"):
        calibrated_remedy(lm, store, PLAN)
    assert len(forwards) == 5, "the forward running when it was cancelled finished; no other started"
    assert cancelled_at[0] is not None and cancelled_at[0].total == 4
    assert path.read_bytes() == before and stored_choice(lm) is None
    assert calibration.cancel_calibration(lm) is None, "nothing runs any more"
    monkeypatch.setattr(adapter, "forward", original)
    again = calibrated_remedy(lm, store, PLAN)
    assert stored_choice(lm) == again and "another-model|0|float32|cpu" in json.loads(path.read_text())


def _during_a_forward(monkeypatch, action):
    """Run ``action`` in a thread from inside the first model forward, which then lasts 0.3 s more; returns the thread."""
    from kvscope.engine.cache import adapter

    original, threads = adapter.forward, []

    def forward(*args, **kwargs):
        if not threads:
            threads.append(threading.Thread(target=action))
            threads[0].start()
            time.sleep(0.3)  # the other thread arrives while this forward holds the gate
        return original(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", forward)
    return threads


def test_a_short_request_runs_between_the_calibrations_forwards_and_says_what_it_waited_for(lm, store, tmp_path, monkeypatch):
    from kvscope.engine.cache.budget import ComputeGate, WorkBudget, bounded, waits_reported
    from kvscope.engine.cache.notebook import Notebook

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    gate, waits, finished = ComputeGate(), [], {}

    def short_request() -> None:
        with bounded(WorkBudget(), gate), waits_reported(waits.append):
            keys = Notebook.prefill(lm, list(range(5, 25))).materialized().keys
        finished["short"] = (time.perf_counter(), keys[0].shape[2])

    threads = _during_a_forward(monkeypatch, short_request)
    with bounded(WorkBudget(), gate):
        calibrated_remedy(lm, store, PLAN)
    finished["calibration"] = time.perf_counter()
    threads[0].join(30)
    assert finished["short"][1] == 20 and finished["short"][0] < finished["calibration"], "it did not wait for the whole calibration"
    field = _first_field("refund_gate")
    assert waits[0].startswith(
        f"waiting for the model: calibrating remedy auto for tiny-qwen2: prompt 1/2 (refund_gate, 1 skill at start, {field.name} = "
        f"{field.old}), remedy splice; step 1 of 4"
    )


def test_a_second_caller_shares_the_running_calibration_and_hears_its_progress(lm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    heard, results = [], {}
    threads = _during_a_forward(monkeypatch, lambda: results.setdefault("second", calibrated_remedy(lm, store, PLAN, report=heard.append)))
    first = calibrated_remedy(lm, store, PLAN)
    threads[0].join(30)
    assert results["second"] == first
    assert heard[0].startswith("waiting for the calibration another request started: calibrating remedy auto for tiny-qwen2: prompt 1/2")
    assert [message.split("; step ")[1][:6] for message in heard[1:]] == ["2 of 4", "3 of 4", "4 of 4"]


def test_a_models_menu_reads_its_own_stored_study_else_its_calibration_else_the_static_default(lm, store, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    fast = {**SUMMARY, "prefix+ape:0.9,0.9": row(35, 35, 5.8, 0.0)}
    for stem, model, summary in (
        ("compose_many-embedded-cpu", "embedded:Qwen2.5-Coder-0.5B-Instruct", SUMMARY),
        ("compose_many-long-qwen-1.5b-cpu", "qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct", SUMMARY),
        ("compose_many-qwen-1.5b-cpu", "qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct", fast),
    ):
        (tmp_path / f"{stem}.json").write_text(json.dumps({"model": model, "summary": summary, **choice_record(summary, source=stem)}))
    for name in ("qwen-1.5b", "qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct"):
        menu = model_remedies(name, tmp_path)
        assert (menu.default, menu.source) == ("prefix+ape:0.9,0.9", "compose_many-qwen-1.5b-cpu") and menu.choice.goal_met
    embedded = model_remedies("embedded", tmp_path)
    assert embedded.default == choose_remedy(SUMMARY).remedy != "prefix+ape:0.9,0.9" and embedded.source == "compose_many-embedded-cpu"
    assert model_remedies(lm.fingerprint.name, tmp_path, lm).as_dict() == {
        "model": lm.fingerprint.name,
        "default": DEFAULT_REMEDY.name,
        "source": None,
        "choice": None,
    }
    calibrated = calibrated_remedy(lm, store, PLAN)
    menu = model_remedies(lm.fingerprint.name, tmp_path, lm)
    assert (menu.default, menu.source, menu.choice) == (calibrated.remedy, "calibration", calibrated)
