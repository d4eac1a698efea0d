"""Handlers without a browser: results match the engine, bad input gives AppError, sessions stay apart."""

import dataclasses
import html
import json
import re
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from kvscope.app.composer import SkillComposer
from kvscope.app.handlers import benchmarks as benchmarks_handlers
from kvscope.app.handlers import composer as composer_handlers
from kvscope.app.handlers.benchmarks import benchmark_results
from kvscope.app.handlers.common import NOTES_SCENARIO, AppError, bundled_scenario_text, export_files, scenario_choices
from kvscope.app.handlers.composer import (
    MAX_PICTURE_SIDE,
    Composition,
    composed_scenario,
    fitted_picture,
    remedy_for,
    remedy_info,
    remedy_menu,
    remedy_summary,
    run_compose,
    run_composition_study,
    run_image_compose,
    run_keystone,
)
from kvscope.app.handlers.learn import learn_step
from kvscope.app.handlers.model import load_model_card
from kvscope.app.handlers.notes import EditInputs, notes_map_view, prepare_baseline, run_edit, run_frontier, run_knockout
from kvscope.app.handlers.probes import run_weight_edits
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.app.tabs.benchmarks import PLOT_SLOTS
from kvscope.engine.cache.loaded import SpliceGate
from kvscope.engine.compose.pictures import bundled_images, load_picture
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.viz.common import markdown_literal
from kvscope.viz.results import FIGURES, result_figures
from tests.app.conftest import SCENARIO


def test_malformed_and_empty_scenarios_have_clear_errors():
    with pytest.raises(AppError, match="TOML syntax error"):
        scenario_choices("name = [unclosed")
    with pytest.raises(AppError, match="editor is empty"):
        scenario_choices("   ")
    with pytest.raises(AppError, match="no field .status. is declared"):
        scenario_choices(SCENARIO.replace("{order_status}", "{status}"))


def test_scenario_choices_offer_fields_and_values():
    view = scenario_choices(SCENARIO)
    assert view.fields == ["order_status"] and view.values == ["shipped", "pending"] and view.new == "pending"


def test_edit_matches_engine_and_is_kept_per_session(registry, sessions):
    view = run_edit(
        registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["field_only", "erratum"]), session="a"
    )
    direct = EditExperiment(registry.get(), Scenario.from_toml(SCENARIO)).report(["field_only", "erratum"])
    assert view.summary["strategies"]["erratum"]["margin"] == pytest.approx(direct.strategies["erratum"].decision.margin, abs=1e-4)
    assert 'data-strategy="erratum"' in view.cards_html and "data-decision=" in view.cards_html
    assert sessions.get("a", "edit") is not None and sessions.get("b", "edit") is None


def test_prepared_scenario_is_reused_by_edits_and_matches_the_engine(registry, sessions):
    text = SCENARIO + "\n# prepared copy\n"
    message = prepare_baseline(registry, None, text)
    baseline = registry.baseline(None, text, Scenario.from_toml(text))
    assert f"**{baseline.decision.label}**" in message and r"order\_status = shipped" in message  # Markdown-escaped
    assert "gradients" in baseline.__dict__  # the backward ran while preparing
    fused = run_edit(
        registry,
        sessions,
        EditInputs(text, field="order_status", new="pending", strategies=["field_only", "erratum", "full_downstream"]),
        session="p",
    )
    assert sessions.get("p", "edit").stale is baseline
    separate = run_edit(
        registry,
        sessions,
        EditInputs(text, field="order_status", new="pending", strategies=["field_only", "erratum", "full_downstream"], separately=True),
        session="q",
    )
    for name in ("field_only", "erratum", "full_downstream"):
        assert fused.summary["strategies"][name]["margin"] == pytest.approx(separate.summary["strategies"][name]["margin"], abs=1e-4)
    assert "fused forward" in fused.summary["strategies"]["erratum"]["detail"]["timing"]
    assert "detail" not in separate.summary["strategies"]["field_only"]
    assert "≈" in fused.cards_html and "≈" not in separate.cards_html
    with pytest.raises(AppError, match="TOML syntax error"):
        prepare_baseline(registry, None, "name = [unclosed")


def test_knockout_needs_an_edit_and_hides_positions(registry, sessions):
    with pytest.raises(AppError, match="run an edit first"):
        run_knockout(sessions, session="fresh", positions="", top_k=4)
    run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["field_only"]), session="s")
    text, _, data = run_knockout(sessions, session="s", positions="3, 5", top_k=4)
    assert data["positions"] == [3, 5] and "Knocked out 2 positions" in text
    with pytest.raises(AppError, match="integers"):
        run_knockout(sessions, session="s", positions="three", top_k=4)
    _, _, top = run_knockout(sessions, session="s", positions="", top_k=2)
    assert len(top["positions"]) == 2


def test_composer_drops_unknown_and_unsafe_ids():
    composer = SkillComposer({"account_gate": "Account <gate>", "bad id!": "x"}, value=["account_gate"])
    assert composer.preprocess(["account_gate", "nope", "<script>", "account_gate"]) == ["account_gate"]
    assert composer.preprocess("not a list") == []
    assert "&lt;gate&gt;" in json.dumps(composer.props["library"])
    assert composer.api_info()["items"]["enum"] == ["account_gate"]


def test_composed_scenario_keeps_user_braces_literal():
    scenario = composed_scenario(Composition(["account_gate"], before="before {x}"))
    assert "{{x}}" in scenario.context and "{skill:account_gate}" in scenario.context
    with pytest.raises(AppError, match="at least one skill"):
        composed_scenario(Composition([]))


def test_compose_reports_fidelity(registry):
    view = run_compose(registry, Composition(["account_gate"], remedy="seam:2"))
    moved = run_compose(registry, Composition(["account_gate"], remedy="prefix+seam:3"))
    # Each composition times both sides itself: no full-recompute time is carried over from an earlier request.
    for shown in (view, moved):
        assert not shown.summary["reference_reused"]
        assert shown.summary["ttft_spread_ms"]["full"]["reps"] == shown.summary["ttft_spread_ms"]["splice"]["reps"] == 2
        assert "both timed in this run" in shown.metrics_markdown and "skills compiled in" in shown.metrics_markdown
    assert view.summary["seam"] == 2 and 0 < view.summary["cosine"] <= 1 + 1e-6
    assert "TTFT" in view.metrics_markdown and "remedy seam:2 recomputed 2 of them" in view.metrics_markdown
    assert "margin error" in view.metrics_markdown and moved.summary["remedy"]["prefix"]
    ranked = run_compose(registry, Composition(["account_gate"], remedy="deviation:0.5"))
    assert "no TTFT saving in deployment" in ranked.metrics_markdown
    with pytest.raises(AppError, match="'mix:1' not understood"):
        run_compose(registry, Composition(["account_gate"], remedy="mix:1"))


def test_remedy_info_and_menu_state_each_models_own_default_and_the_fastest_from_its_stored_study(registry, tmp_path, monkeypatch):
    from kvscope.engine.compose.choice import choose_remedy
    from kvscope.engine.compose.remedy import DEFAULT_REMEDY

    def row(agree, fraction, speedup, ranked=False):
        return {
            "agree_decisive": agree,
            "decisive": 35,
            "ties": 17,
            "agreement": agree / 35,
            "mean_abs_margin_error": 0.1,
            "recomputed_fraction": fraction,
            "speedup": {"min": speedup, "median": speedup, "max": speedup},
            "needs_reference": ranked,
        }

    summary = {DEFAULT_REMEDY.name: row(34, 0.15, 2.6), "splice": row(32, 0.0, 5.8), "causal:0.15": row(34, 0.15, 9.0, ranked=True)}
    gaps = {DEFAULT_REMEDY.name: 0.06, "splice": 0.6}
    tiny = registry.get().fingerprint.name
    study = {"model": tiny, "summary": summary, "choice": choose_remedy(summary, gaps).as_dict()}
    (tmp_path / "compose_many-x-cpu.json").write_text(json.dumps(study))
    (tmp_path / "compose_many-long-x-cpu.json").write_text(json.dumps({"model": tiny, "summary": summary}))  # no choice: not read
    other = {"splice": row(35, 0.0, 6.1), DEFAULT_REMEDY.name: row(35, 0.15, 2.5)}  # another model: plain splice keeps all
    (tmp_path / "compose_many-qwen-1.5b-cpu.json").write_text(
        json.dumps({"model": "qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct", "summary": other, "choice": choose_remedy(other, {}).as_dict()})
    )
    monkeypatch.setattr(benchmarks_handlers, "STUDY_RESULTS", tmp_path)
    info = remedy_info(registry, None)
    assert info.startswith(
        f"Default for {tiny.split(':')[0]} {DEFAULT_REMEDY.name}: keeps 34/35 decisive decisions of a full recompute (97%), "
        "first token ×2.60"
    )
    assert "(compose_many-x-cpu). Why: no remedy keeps ≥ 97%" in info and "within the keystone bar" in info
    assert "Fastest: splice: keeps 32/35 decisive decisions of a full recompute (91%), first token ×5.80" in info
    assert "causal:0.15:" not in info
    assert "auto: this model's own calibration" in info and "blend:F" in info
    menu = remedy_menu(registry, None, ["splice", "seam:1"])
    assert menu == [
        (
            f"{DEFAULT_REMEDY.name} — keeps 34/35 decisions of a full recompute, ×2.60 faster first token (median) (default)",
            DEFAULT_REMEDY.name,
        ),
        ("auto — this model's calibrated choice (measured once)", "auto"),
        ("splice — keeps 32/35 decisions of a full recompute, ×5.80 faster first token (median)", "splice"),
        ("seam:1 — not measured for this model yet", "seam:1"),
    ]
    assert remedy_summary(registry, None) == (
        f"Default for {tiny.split(':')[0]} {DEFAULT_REMEDY.name}: keeps 34/35 decisions of a full recompute, ×2.60 faster first "
        "token (median). What each part means, and why this default: below the menu."
    )
    # the second model's own study: its own default (plain splice keeps every decision there) and numbers, nothing loaded
    assert remedy_menu(registry, "qwen-1.5b", ["seam:1"])[0] == (
        "splice — keeps 35/35 decisions of a full recompute, ×6.10 faster first token (median) (default)",
        "splice",
    )
    assert (
        remedy_summary(registry, "qwen-1.5b").startswith("Default for qwen-1.5b splice: keeps 35/35")
        and "qwen-1.5b" not in registry.loaded()
    )
    assert remedy_for(registry, "qwen-1.5b", registry.get(), "") == Remedy.parse("splice")  # empty: the model's own default
    assert remedy_for(registry, None, registry.get(), "") == DEFAULT_REMEDY
    monkeypatch.setattr(benchmarks_handlers, "STUDY_RESULTS", tmp_path / "none")
    assert "not measured for this model yet" in remedy_summary(registry, None)
    assert remedy_info(registry, None).startswith(
        f"Default for {tiny.split(':')[0]} {DEFAULT_REMEDY.name}: not measured for this model yet. auto:"
    )
    assert remedy_menu(registry, None, [])[0] == (f"{DEFAULT_REMEDY.name} — not measured for this model yet (default)", DEFAULT_REMEDY.name)


def test_auto_in_the_composer_calibrates_locally_and_is_refused_uncalibrated_in_public(registry, tmp_path, monkeypatch):
    from dataclasses import replace

    from kvscope.engine.compose import calibration

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    plan = calibration.CalibrationPlan(
        skills=("account_gate",), sizes=(1,), placements=("start",), remedies=("splice", "seam:1"), keystone_scenario=None
    )
    monkeypatch.setattr(calibration, "CalibrationPlan", lambda: plan)
    messages, local = [], registry.profile
    public = replace(local, calibrate_remedies=False)
    monkeypatch.setattr(registry, "profile", public)
    with pytest.raises(AppError, match="remedy auto needs .* calibration .* does not run for visitors"):
        run_compose(registry, Composition(["account_gate"], remedy="auto"))
    monkeypatch.setattr(registry, "profile", local)
    view = run_compose(registry, Composition(["account_gate"], remedy="auto"), report=messages.append)
    (stored,) = json.loads((tmp_path / "remedy-choices.json").read_text()).values()
    assert view.summary["remedy"]["name"] == stored["remedy"] and any("calibrating" in message for message in messages)
    monkeypatch.setattr(registry, "profile", public)  # stored now: a public server reads it
    assert run_compose(registry, Composition(["account_gate"], remedy="auto")).summary["remedy"]["name"] == stored["remedy"]


def test_keystone_and_study_panels(registry):
    figure, data = run_keystone(registry, Composition(["account_gate"], remedy="seam:1"))
    assert data["remedy"] == "seam:1" and "max_recovery_gap" in data and "Keystone" in figure.layout.title.text
    with pytest.raises(AppError, match="deployable"):
        run_keystone(registry, Composition(["account_gate"], remedy="causal:0.2"))
    figure, markdown, study = run_composition_study(
        registry,
        skills=["account_gate", "user_memory"],
        after="refund_gate",
        placements=["start", "end"],
        remedies=["splice", "seam:10000"],
    )
    assert len(study["cases"]) == 2 * 2 * 2 and set(study["summary"]) == {"splice", "seam:10000"}
    assert "8 composed prompts" in markdown and "seam:10000" in markdown and len(figure.data) == 4
    with pytest.raises(AppError, match="placements must be chosen"):
        run_composition_study(registry, skills=["account_gate"], after="refund_gate", placements=["middle"], remedies=["splice"])
    with pytest.raises(AppError, match="at least one remedy"):
        run_composition_study(registry, skills=["account_gate"], after="refund_gate", placements=["start"], remedies=[])


def test_export_writes_json_and_html(tmp_path):
    folder = ExportFolder(2**20, keep=4, root=tmp_path)
    paths = export_files(folder, {"a": 1}, [go.Figure()], "x")
    assert json.loads(Path(paths[0]).read_text()) == {"a": 1} and Path(paths[1]).read_text().startswith("<html>")
    with pytest.raises(AppError, match="nothing to export"):
        export_files(folder, None, [], "x")


def test_sessions_are_isolated_and_budgeted():
    store = SessionStore(budget_bytes=100, ttl_s=60)
    store.put("a", "k", torch.zeros(15))
    store.put("b", "k", torch.ones(15))
    assert store.get("a", "k") is None and float(store.get("b", "k").sum()) == 15


def test_bad_model_spec_is_reported(registry):
    with pytest.raises(AppError, match="no-such-alias"):
        load_model_card(registry, "no-such-alias")


def test_edit_headline_states_the_notes_share_from_field_only(registry, sessions):
    view = run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["erratum"]), session="h")
    notes = view.summary["notes"]
    field_only = EditExperiment(registry.get(), Scenario.from_toml(SCENARIO)).report(["field_only"]).strategies["field_only"]
    if field_only.recovery.value is None:  # the tiny model barely moves: recovery is undefined, and so is the share
        assert notes["share"] is None and notes["reason"] == field_only.recovery.reason
    else:
        assert notes["share"] == pytest.approx(1 - field_only.recovery.value, abs=1e-4)
    assert 'id="notes-headline"' in view.cards_html and html.escape(notes["headline"]) in view.cards_html


def test_frontier_and_notes_map_views_use_the_sessions_edit(registry, sessions):
    with pytest.raises(AppError, match="run an edit first"):
        run_frontier(sessions, session="nobody")
    run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["field_only"]), session="f")
    figure, data = run_frontier(sessions, session="f")
    methods = {point["method"] for point in data["points"]}
    assert {
        "field_only",
        "erratum",
        "field_erratum",
        "restate",
        "full_downstream",
        "field_topk (causal)",
        "field_topk (deviation)",
    } <= methods
    field_only = next(p for p in data["points"] if p["method"] == "field_only")
    assert field_only["recovery"] == pytest.approx(data["notes"]["field_recovery"], abs=1e-4)
    assert len(figure.data) == len({p["method"] for p in data["points"]})
    narrow, wide = (notes_map_view(sessions, session="f", all_positions=flag).data[0] for flag in (False, True))
    assert len(wide.z[0]) == len(sessions.get("f", "edit").stale.prompt.context_ids) > len(narrow.z[0])


def test_model_card_says_why_this_dtype_and_can_switch_it(registry):
    card, info = load_model_card(registry, "")
    assert "Why this dtype" in card and "Cache self-test" in card and "ok in float32" in card
    assert info["selftest"]["ok"] and info["selftest"]["checks"]
    other = type(registry)(registry.default_spec)
    before = other.get()
    card, info = load_model_card(other, "", dtype="bfloat16")
    assert other.get() is not before and other.get().dtype_reason == "bfloat16 as requested"
    assert info["selftest"]["dtype"] == "bfloat16" and "ok in bfloat16" in card
    assert other.get(dtype="bfloat16") is other.get(), "the same dtype keeps the loaded model"


def test_learn_steps_describe_what_the_model_did_beside_the_paper(registry):
    text, _ = learn_step(registry, SessionStore(), 1, session="s")
    experiment = EditExperiment(registry.get(), Scenario.load(bundled_scenarios()[NOTES_SCENARIO]))
    report = experiment.report(["field_only", "full_downstream"], fused=True)
    field = report.notes.field_recovery
    assert (
        "Recovery is undefined"
        if field is None
        else f"recovers only {field:.2f}"
        if not report.notes.field_alone_flips
        else f"recovers {field:.2f}"
    ) in text
    assert "Paper:" in text and "−0.028 Llama-3.1-8B" in text
    text, _ = learn_step(registry, SessionStore(), 2, session="s")
    assert "erratum alone recovers" in text and "Paper:" in text


def test_learn_steps_of_one_session_show_one_notes_share(registry):
    """Steps 2 and 3 read one edit: the notes share in step 2's words and both steps' headline is the same number."""
    sessions = SessionStore()
    shares = []
    for index in (1, 2):
        text, _ = learn_step(registry, sessions, index, session="s")
        shares.append(re.search(r'data-share="([-\d.]*)"', text).group(1))
    assert shares[0] == shares[1] != ""
    experiment = sessions.get("s", "learn")
    assert float(shares[0]) == pytest.approx(experiment.report(["field_only"]).notes.share, abs=5e-5)


def test_learn_reads_the_demos_strategies_as_the_notes_tab_does_so_both_show_one_number_in_bfloat16():
    """In bfloat16 a strategy read in a forward shared with other caches gets a slightly different margin (on the embedded
    model full_downstream read 0.97 on the Notes tab and 1.00 on Learn): Learn reads the demo's strategies as the Notes
    tab's default edit does, so every strategy both show has one margin and one recovery, and the cards say the same."""
    from kvscope.app.handlers.learn import LEARN_STRATEGIES
    from kvscope.engine import DEFAULT_STRATEGIES

    assert {name for names in LEARN_STRATEGIES.values() for name in names} <= set(DEFAULT_STRATEGIES)
    registry, sessions = ModelRegistry("tiny-qwen2", dtype="bfloat16"), SessionStore()
    notes = run_edit(registry, sessions, EditInputs(bundled_scenario_text(NOTES_SCENARIO)), session="s")
    shown = {}
    for index in LEARN_STRATEGIES:
        text, _ = learn_step(registry, sessions, index, session="s")
        shown |= {name: re.search(rf'data-strategy="{name}".*?</div>', text).group(0) for name in LEARN_STRATEGIES[index]}
    learned = sessions.get("s", "learn").report(list(DEFAULT_STRATEGIES), fused=True).as_dict()["strategies"]
    for name in DEFAULT_STRATEGIES:
        assert learned[name]["margin"] == notes.summary["strategies"][name]["margin"], name
        assert learned[name]["recovery"] == notes.summary["strategies"][name]["recovery"], name
        card = re.search(rf'data-strategy="{name}".*?</div>', notes.cards_html).group(0)
        assert re.sub(r"≈?\d+ ms", "", card) == re.sub(r"≈?\d+ ms", "", shown[name]), name  # the same card but its time
    assert "computed in bfloat16" in notes.cards_html


LEARN_TEXT = {  # step index → words its HTML must hold (the numbers are checked by pattern)
    0: (
        r"tiny-qwen2: with <b>expired</b> the model answers <b>\w+</b> \(margin [+−-]\d+\.\d\d\); with <b>valid</b> it answers "
        r"<b>\w+</b> \(margin [+−-]\d+\.\d\d\): a clean prefill (changes|does <b>not</b> change) the decision"
    ),
    1: r"recomputing the field alone recovers (only )?-?\d\.\d\d.*−0\.028 Llama-3\.1-8B.*data-strategy=\"full_downstream\"",
    2: r"the erratum alone recovers -?\d\.\d\d and field \+ erratum -?\d\.\d\d .*appending \d+ tokens to a \d+-token context.*"
    r"data-strategy=\"field_erratum\"",
    3: (
        r"logit cosine \d\.\d{4}, KL -?\d\.\d{4}, decision (agrees|differs); time to first token \d+ ms vs \d+ ms "
        r"\(×[\d.]+\) for \d+ spliced of \d+ context tokens.*logit cosine 0\.90–0\.999"
    ),
}


@pytest.mark.parametrize("index", range(4), ids=["decisions", "field-only", "erratum", "splicing"])
def test_every_learn_step_returns_its_text_and_a_drawn_figure(registry, monkeypatch, index):
    remedies = []
    compare = composer_handlers.compare
    monkeypatch.setattr(composer_handlers, "compare", lambda *args, **kwargs: remedies.append(kwargs["remedy"]) or compare(*args, **kwargs))
    text, figure = learn_step(registry, SessionStore(), index, session="s")
    assert re.search(LEARN_TEXT[index], text, re.S), text
    assert isinstance(figure, go.Figure) and figure.data
    assert all(trace.x is not None and len(trace.x) == len(trace.y) > 0 for trace in figure.data)
    if index == 3:  # the splice runs with the composer's default remedy, as the Composer tab does with its remedy left empty
        assert remedies == [DEFAULT_REMEDY] and [trace.name for trace in figure.data] == ["spliced", "recomputed"]
        summary = run_compose(registry, Composition(["refund_policy"], after=NOTES_SCENARIO)).summary
        assert f"{summary['skill_tokens']} spliced of {summary['context_tokens']} context tokens" in text
        assert f"logit cosine {summary['cosine']:.4f}" in text and summary["remedy"]["name"] == DEFAULT_REMEDY.name


def test_model_card_shows_this_models_row_of_the_support_matrix(registry):
    card, info = load_model_card(registry, "")
    assert f"**Family**: {markdown_literal('Qwen2 / Qwen2.5')}" in card and "Operations on this model" in card
    verdicts = info["support"]["verdicts"]
    assert all(v["supported"] and v["max_error"] <= 2e-5 for v in verdicts.values() if v["applicable"])
    assert set(verdicts) == {
        "read",
        "chunked prefill",
        "replace",
        "patch",
        "knockout",
        "move keys",
        "splice",
        "seam repair",
        "self-test",
        "images",
    }
    assert not verdicts["images"]["applicable"] and "images" not in card  # a text-only model: nothing to check, nothing said


def test_picture_splice_matches_the_recompute_from_pixels_with_a_full_seam():
    registry = ModelRegistry("tiny-qwen2_vl")
    pixels = load_picture(bundled_images()["shipping_label"])
    card, info = load_model_card(registry, "")
    assert info["support"]["verdicts"]["images"]["max_error"] <= 2e-5 and "images" in card
    moved = run_image_compose(registry, picture=pixels, before="Order 48213, placed on Monday.", after="", question="", seam=0)
    repaired = run_image_compose(registry, picture=pixels, before="Order 48213, placed on Monday.", after="", question="", seam=14)
    assert moved[2]["shift"] > 0 and moved[2]["cosine"] < 1 - 1e-6  # moved with no repair: close, not equal
    assert repaired[2]["cosine"] > 1 - 1e-6 and abs(repaired[2]["margin_error"]) < 1e-4  # all 14 tokens recomputed: a prefill
    assert "picture 14 tokens over 6 rope positions" in moved[0] and isinstance(moved[1], go.Figure)
    with pytest.raises(AppError, match="add a picture first"):
        run_image_compose(registry, picture=None, before="", after="", question="", seam=0)
    with pytest.raises(AppError, match="seam 40 must be between 0 and the picture's 14 tokens"):
        run_image_compose(registry, picture=pixels, before="", after="", question="", seam=40)
    big = fitted_picture(np.zeros((2000, 1000, 3), dtype=np.uint8))
    assert big.shape == (MAX_PICTURE_SIDE, MAX_PICTURE_SIDE // 2, 3)


def test_picture_splice_on_a_text_model_names_what_is_missing(registry):
    pixels = load_picture(bundled_images()["shipping_label"])
    with pytest.raises(AppError, match="has no vision tower"):
        run_image_compose(registry, picture=pixels, before="", after="", question="", seam=0)


@pytest.mark.parametrize("spec, reason", [("tiny-bamba", "hybrid"), ("tiny-llama4", "chunked attention")])
def test_refused_families_load_with_their_reasons_and_the_composer_refuses(spec, reason):
    registry = ModelRegistry(spec)
    card, info = load_model_card(registry, "")
    assert "refused" in card and reason in card
    assert not info["support"]["verdicts"]["splice"]["supported"]
    with pytest.raises(AppError, match=reason):
        run_compose(registry, Composition(["account_gate"]))


def test_a_hybrid_states_its_decision_read_on_its_own_cache():
    message = prepare_baseline(ModelRegistry("tiny-bamba"), None, SCENARIO)
    assert "the model answers **" in message and "hybrid (recurrent layers [0, 2])" in message and "python -m kvscope edit" in message


def test_a_failed_selftest_locks_splicing(registry, monkeypatch):
    lm = registry.get()
    failed = SpliceGate()
    failed.record(dataclasses.replace(registry.selftest(), ok=False))
    monkeypatch.setattr(lm, "splice_gate", failed)  # the engine's gate refuses; the app only reports it
    with pytest.raises(AppError, match=f"splicing stays locked on {lm.name}: its cache self-test failed"):
        run_compose(registry, Composition(["account_gate"]))


def test_computed_once_entries_are_single_flight(monkeypatch):
    """N concurrent first requests: one self-test, one support row, one baseline, and every caller the same result."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvscope.app import state
    from kvscope.engine.cache.selftest import run_selftest

    calls = {"selftest": 0, "support": 0, "baseline": 0}

    def counted(name, function):
        def slow(*args, **kwargs):
            calls[name] += 1
            time.sleep(0.3)  # every thread arrives while the first computes
            return function(*args, **kwargs)

        return slow

    monkeypatch.setattr(state, "check_model", counted("support", state.check_model))
    monkeypatch.setattr(state, "run_scenario", counted("baseline", state.run_scenario))
    fresh = ModelRegistry("tiny-qwen2")
    lm = fresh.get()
    lm.splice_gate = SpliceGate(counted("selftest", run_selftest))
    scenario, threads = Scenario.from_toml(SCENARIO), 6
    barrier = threading.Barrier(threads)

    def first_request(_):
        barrier.wait()
        return fresh.selftest(), fresh.support(), fresh.baseline(None, SCENARIO, scenario)

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(first_request, range(threads)))
    assert calls == {"selftest": 1, "support": 1, "baseline": 1}
    for kind in range(3):
        assert all(result[kind] is results[0][kind] for result in results)


def test_weight_edits_panel_states_the_trade_off_from_the_numbers(registry):
    figure, summary, data = run_weight_edits(
        registry, text=SCENARIO, field="order_status", new="pending", methods=["field_erratum", "rome"], lora_steps=3, rome_layer=1
    )
    assert set(data["methods"]) == {"field_erratum", "rome"}
    erratum = data["methods"]["field_erratum"]
    others = len(data["probes"]["others"])
    assert f"0/3 other customers now get the new decision; 0/{others} unrelated decisions changed" in summary
    assert "Paper (Llama-3.1-8B)" in summary and "**rome**" in summary
    assert [trace.name for trace in figure.data][:3] == [
        "efficacy (recovery)",
        "contamination (other customers flipped)",
        "collateral (unrelated decisions moved)",
    ]
    assert list(figure.data[1].y) == [erratum["contamination"], data["methods"]["rome"]["contamination"]]
    with pytest.raises(AppError, match="choose at least one method"):
        run_weight_edits(registry, text=SCENARIO, field="order_status", new="pending", methods=[], lora_steps=3, rome_layer=None)


def test_every_stored_benchmark_result_of_a_known_kind_gets_a_figure():
    results = benchmark_results()
    figures = result_figures(results)
    kinds = set(FIGURES)  # the kinds the registry draws (kvscope.viz.results)
    serving_edits = sum(stem.startswith("serving-") and results[stem].get("workload", "edit") == "edit" for stem in results)
    side_by_side = 1 if serving_edits > 1 else 0  # the serving engines compared, before their own figures
    assert len(figures) == sum(stem.split("-")[0] in kinds for stem in results) + side_by_side <= PLOT_SLOTS  # the tab's slots
    titles = [figure.layout.title.text for figure in figures]
    assert any("--cache-reuse vs KVScope" in title for title in titles)
    assert any("Default remedy on embedded: the short N-skill study, 8 remedies" in title for title in titles)
    assert any("Default remedy on qwen-1.5b: the short N-skill study" in title for title in titles)
    assert len(set(titles)) == len(titles)  # each stored study says which model and remedies it holds
    assert any("A picture's K/V spliced behind text" in title for title in titles)
    audits = [stem for stem in results if stem.startswith("audit-")]
    assert sum(title.startswith("Audit of ") for title in titles) == len(audits)
    assert any(title.startswith("The audit's simulated cache against real servers' own counts") for title in titles)


def test_notes_learn_and_the_locality_probe_show_one_notes_share(sessions):
    """The three places that state the notes demo's notes share read the same field_only and oracle margins: the Notes
    cards, Learn step 2 and the locality probe (tiny-llama in bfloat16, where what shares a forward used to move them)."""
    from kvscope.app.handlers.common import bundled_scenario_text
    from kvscope.app.handlers.probes import ProbeCase, run_probe

    tiny = ModelRegistry("tiny-llama", dtype="bfloat16")
    text = bundled_scenario_text(NOTES_SCENARIO)
    view = run_edit(tiny, sessions, EditInputs(text), session="one")
    learn_html, _ = learn_step(tiny, sessions, 1, session="one")
    _, locality = run_probe(tiny, ProbeCase(text, None, None, "locality"))
    notes = view.summary["notes"]
    assert locality["field_only"]["recovery"] == notes["field_recovery"] and locality["oracle_margin"] == view.summary["oracle"]["margin"]
    assert locality["field_only"]["margin"] == view.summary["strategies"]["field_only"]["margin"]
    if notes["field_recovery"] is not None:
        assert f"{notes['field_recovery']:.2f}" in learn_html and f"{notes['field_recovery']:.2f}" in view.cards_html
    else:  # the random model's gap is below min_gap: Learn says why instead of a number
        assert "Recovery is undefined here" in learn_html


def test_the_session_result_holds_the_edit_its_frontier_and_its_knockout(registry, sessions):
    from kvscope.app.handlers.notes import session_result

    assert session_result(sessions, session="whole") is None
    view = run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="pending", strategies=["erratum"]), session="whole")
    assert session_result(sessions, session="whole") == view.summary
    _, frontier = run_frontier(sessions, session="whole")
    _, _, knocked = run_knockout(sessions, session="whole", positions="3", top_k=4)
    whole = session_result(sessions, session="whole")
    assert whole == view.summary | {"frontier": frontier, "knockout": knocked} and whole["knockout"]["positions"] == [3]
    run_edit(registry, sessions, EditInputs(SCENARIO, field="order_status", new="shipped", strategies=["erratum"]), session="whole")
    assert set(session_result(sessions, session="whole")) == set(view.summary)  # a new edit starts a new result


def test_the_trigger_probe_asks_for_the_tabs_own_fields(registry):
    from kvscope.app.handlers.probes import TRIGGER_LABELS, ProbeCase, probe_sentence, run_probe

    with pytest.raises(AppError) as refused:
        run_probe(registry, ProbeCase(SCENARIO, "order_status", "pending", "trigger", {"find": "", "replace": None}))
    said = str(refused.value)
    assert TRIGGER_LABELS["find"] in said and TRIGGER_LABELS["replace"] in said and "find=" not in said and "replace=" not in said
    with pytest.raises(AppError, match=re.escape(repr(TRIGGER_LABELS["replace"]))):
        run_probe(registry, ProbeCase(SCENARIO, "order_status", "pending", "trigger", {"find": "only", "replace": " "}))
    _, data = run_probe(registry, ProbeCase(SCENARIO, "order_status", "pending", "knockout"))
    assert probe_sentence(data).startswith("Knocking out the top ") and data["headline"].endswith(".")


def test_a_cancelled_calibration_is_information_and_cancel_shows_only_while_one_may_run(registry, tmp_path, monkeypatch):
    from kvscope.app.handlers.common import AppCancelled, guarded
    from kvscope.app.handlers.composer import calibration_pending
    from kvscope.engine import Cancelled

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))  # no stored calibration
    assert calibration_pending(registry, None, "auto") and calibration_pending(registry, None, " auto ")
    assert not calibration_pending(registry, None, "seam:2") and not calibration_pending(registry, None, None)

    @guarded
    def cancelled():
        raise Cancelled("the calibration of tiny-qwen2 was cancelled at step 2 of 6")

    with pytest.raises(AppCancelled, match="cancelled at step 2 of 6"):
        cancelled()
