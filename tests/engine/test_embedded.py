"""The embedded default model (Qwen2.5-Coder-0.5B-Instruct): self-test and bundled-demo calibration."""

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.measure.notes_scenario import notes_scenario
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.compose.keystone import keystone
from kvscope.engine.compose.remedy import DEFAULT_REMEDY
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.calibrate import calibrate
from kvscope.engine.models import load_model
from kvscope.engine.scenario import Scenario, bundled_logs, bundled_scenarios


@pytest.fixture(scope="module")
def qwen():
    return load_model("embedded", dtype="float32")


def test_selftest_is_ok_in_fp32(qwen):
    report = run_selftest(qwen)
    assert report.ok and report.rope_supported
    assert report.rope_roundtrip_max_err <= 1e-3
    assert report.reposition_vs_prefill_max_err <= 1e-3
    assert report.splice_identity_max_logit_err <= 1e-3
    assert report.splice_full_seam_max_logit_err <= 1e-3


def test_selftest_is_ok_in_bf16_against_its_own_noise_floor():
    report = run_selftest(load_model("embedded", dtype="bfloat16"))
    assert report.ok, report.summary()
    assert report.dtype == "bfloat16" and report.rope_supported
    assert 0.0078125 <= report.kv_noise_floor < 0.05 and 0.0078125 <= report.logit_noise_floor < 0.05
    assert report.reposition_vs_prefill_max_err < 0.05


def test_bundled_demos_do_what_their_expectations_say(qwen):
    results = calibrate(qwen, list(bundled_scenarios().values()))
    judged = [r for r in results if r.expected_flip is not None]
    assert judged, "no bundled scenario states [expect] for both values"
    failures = [f"{r.scenario}: Δ{r.delta_margin:+.2f} {r.old_label}→{r.new_label}" for r in judged if not r.ok]
    assert not failures, failures
    assert sum(r.flips for r in judged) >= 8
    notes_demos = [r for r in results if r.notes_demo]
    assert len(notes_demos) >= 4, [(r.scenario, r.field_only_recovery) for r in results if r.flips]
    for r in notes_demos:  # the paper's phenomenon: a clean prefill flips, the field-only edit does not
        assert r.field_only_recovery <= 0.4 and r.field_only_label == r.old_label != r.new_label and abs(r.delta_margin) >= 1.0
    controls = [r for r in judged if not r.expected_flip]
    assert controls and not any(r.flips for r in controls)


def test_keystone_demo_flips_and_composed_recovery_tracks_recomputed(qwen):
    """The bundled keystone (a field inside a skill spliced 39 positions from where it was compiled): the edit
    moves the decision by at least 1.0, and with the default remedy every strategy recovers on the composed
    cache within 0.15 of the recomputed one (the paper's diagonal)."""
    report = keystone(qwen, Scenario.load(bundled_scenarios()["keystone_safety"]), SkillStore(), remedy=DEFAULT_REMEDY)
    assert report.recomputed.flips and report.delta_margin >= 1.0
    gaps = report.recovery_gaps()
    assert gaps and None not in gaps.values(), gaps
    assert max(abs(gap) for gap in gaps.values()) <= 0.15, gaps


def test_the_notes_demo_shows_one_notes_share_in_bfloat16():
    """pharmacy_prescription in bfloat16: the Notes tab's four fused strategies, Learn's two and the locality probe read
    one field_only recovery (it was 0.09 / 0.13 / 0.12 when the references shared their forward with other forks)."""
    from kvscope.engine.edit.experiment import EditExperiment
    from kvscope.engine.edit.runs import run_scenario
    from kvscope.engine.probes.locality import probe_locality

    lm = load_model("embedded", dtype="bfloat16")
    scenario = Scenario.load(bundled_scenarios()["pharmacy_prescription"])
    stale = run_scenario(lm, scenario, capture_attention=True)
    made = lambda: EditExperiment(lm, scenario, capture_attention=True, stale=stale)  # noqa: E731
    notes = made().report(["field_only", "erratum", "field_erratum", "full_downstream"], fused=True).notes
    learn = made().report(["field_only", "full_downstream"], fused=True).notes
    locality = probe_locality(made())
    assert notes.field_recovery is not None and 0.0 <= notes.field_recovery <= 0.3 and notes.field_only_label == "refuse"
    assert learn.field_recovery == notes.field_recovery == locality.field_only.recovery


def test_the_rag_demo_passage_change_moves_the_models_answer(qwen):
    """The bundled RAG log's last turn: the printers line of the retrieved passage changes (working → out of order) and
    the model's own answer follows it (measured in bfloat16: '5 printers are working' vs '5 printers are out', margin
    +9.75 → +0.50): Open in Notes' pre-check finds the greedy continuations parting on that word."""
    log = read_log(bundled_logs()["rag"].read_text(encoding="utf-8"))
    report = audit_traffic(qwen, log, sample=3, measure=measure_settings(repairs=[], tokens=1)).measured_report()
    assert [turn.request for turn in report.turns if turn.fields] == [2, 3]  # the model pass measured both turns
    scenario = notes_scenario(qwen, report, request=3, field="printers")
    assert scenario.source == "divergence" and scenario.moves and scenario.margin_change < -2.0
    assert scenario.answers[0].endswith("working") and scenario.answers[1].endswith("out")
