"""Edit strategies on tiny models: identities against oracle and stale, errors, JSON shape."""

import json

import pytest
import torch

from kvscope.engine.cache.decision import MARGIN_NOISE
from kvscope.engine.cache.notebook import Notebook, NotebookError
from kvscope.engine.cache.patching import attribution_effects
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import STRATEGIES, EditSettings, StrategyError, check_names
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Scenario, ScenarioError
from tests.shared import SAME_LENGTH_SCENARIO


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def scenario():
    return Scenario.from_toml(SAME_LENGTH_SCENARIO)


@pytest.fixture(scope="module")
def report(lm, scenario):
    experiment = EditExperiment(lm, scenario, settings=EditSettings(cot_tokens=3, top_k=4))
    return experiment, experiment.report()


def test_full_downstream_equals_oracle(report):
    _, result = report
    assert result.strategies["full_downstream"].decision.margin == pytest.approx(result.oracle.decision.margin, abs=1e-4)
    assert result.strategies["oracle"].decision.margin == pytest.approx(result.oracle.decision.margin, abs=1e-5)


def test_stale_strategy_equals_stale_reference(report):
    _, result = report
    assert result.strategies["stale"].decision.margin == result.stale.decision.margin


def test_field_only_with_same_value_equals_stale(lm, scenario):
    field = scenario.field()
    experiment = EditExperiment(lm, scenario, new=field.old)
    assert experiment.run("field_only").decision.margin == pytest.approx(experiment.stale.decision.margin, abs=1e-4)
    assert experiment.run("field_only").recovery.value is None  # no gap between stale and oracle


def test_every_strategy_reports_its_cost(report):
    experiment, result = report
    field_tokens = len(experiment.field_positions)
    assert set(result.strategies) == set(STRATEGIES)
    assert result.strategies["field_only"].tokens_recomputed == field_tokens
    assert result.strategies["field_topk"].tokens_recomputed == field_tokens + 4
    assert result.strategies["full_downstream"].tokens_recomputed == field_tokens + len(experiment.downstream_positions)
    assert result.strategies["erratum"].notebook.visible_segments()[-1] == "erratum"
    restated = result.strategies["restate"]  # the field restated after the context, the stale cache kept before it
    assert restated.notebook.visible_segments()[-1] == "restate" and restated.detail["text"] == "order_status: pending"
    assert restated.tokens_recomputed == len(experiment.line_ids(EditSettings.restate))
    # field_only computes the fewest tokens (the field's) and reads field_erratum's label: auto takes it
    assert result.strategies["field_only"].decision.label == result.strategies["field_erratum"].decision.label
    assert result.strategies["auto"].detail == {"chosen": "field_only", "reference": "field_erratum"}
    assert result.strategies["auto"].tokens_recomputed == field_tokens


def test_field_topk_recompute_of_everything_equals_full_downstream(lm, scenario):
    experiment = EditExperiment(lm, scenario)
    everything = len(experiment.downstream_positions)
    topk = EditExperiment(lm, scenario, settings=EditSettings(top_k=everything)).run("field_topk")
    full = experiment.run("full_downstream")
    assert topk.decision.margin == pytest.approx(full.decision.margin, abs=1e-4)
    deviation = EditExperiment(lm, scenario, settings=EditSettings(top_k=everything, ranking="deviation")).run("field_topk")
    assert deviation.decision.margin == pytest.approx(full.decision.margin, abs=1e-4)


def test_length_changing_value_makes_in_place_strategies_not_applicable(lm, scenario):
    field = scenario.field()
    longer = field.new + " and also confirmed by the manager"
    experiment = EditExperiment(lm, scenario, new=longer)
    for name in ("field_only", "field_topk", "field_erratum", "field_only_cot"):
        result = experiment.run(name)
        assert not result.applicable and "tokens" in result.reason
    assert experiment.run("erratum").applicable
    full = experiment.run("full_downstream")
    assert full.decision.margin == pytest.approx(experiment.oracle.decision.margin, abs=1e-4)
    assert experiment.run("auto").detail["reference"] == "erratum"


def test_bad_inputs_have_specific_errors(lm, scenario):
    with pytest.raises(ScenarioError, match="unknown field 'nope'"):
        EditExperiment(lm, scenario, field_name="nope")
    experiment = EditExperiment(lm, scenario)
    with pytest.raises(ValueError, match="unknown strategy 'magic'"):
        experiment.run("magic")
    with pytest.raises(NotebookError, match="K=5000 is larger than"):
        EditExperiment(lm, scenario, settings=EditSettings(top_k=5000)).run("field_topk")
    with pytest.raises(ValueError, match="unknown ranking"):
        EditSettings(ranking="vibes")
    with pytest.raises(ScenarioError, match="no braces"):
        EditExperiment(lm, scenario, new="{x}")


def test_report_is_json_with_the_cli_shape(report):
    _, result = report
    data = json.loads(json.dumps(result.as_dict()))
    assert {"model", "scenario", "field", "old", "new", "flips", "stale", "oracle", "strategies"} <= set(data)
    for entry in data["strategies"].values():
        assert {"applicable", "scores", "margin", "decision", "recovery", "tokens_recomputed", "ms"} <= set(entry)


@pytest.mark.parametrize("longer", [False, True])
def test_fused_report_equals_strategy_by_strategy(lm, scenario, longer):
    new = scenario.field().new + (" and also confirmed by the manager" if longer else "")
    names = ["stale", "field_only", "erratum", "field_erratum", "restate", "full_downstream", "field_topk", "auto"]
    settings = EditSettings(top_k=4)
    sequential = EditExperiment(lm, scenario, new=new, settings=settings).report(names)
    fused_experiment = EditExperiment(lm, scenario, new=new, settings=settings)
    fused = fused_experiment.report(names, fused=True)
    assert fused.oracle.decision.margin == pytest.approx(sequential.oracle.decision.margin, abs=1e-4)
    for name in names:
        one, together = sequential.strategies[name], fused.strategies[name]
        assert one.applicable == together.applicable, name
        if one.applicable:
            assert together.decision.margin == pytest.approx(one.decision.margin, abs=1e-4), name
            assert together.tokens_recomputed == one.tokens_recomputed, name
    alone = ("auto", "field_only", "full_downstream")  # auto runs its own; field_only and full_downstream: forwards of their own
    fused_only = [r for n, r in fused.strategies.items() if r.applicable and n not in alone]
    assert all("fused forward" in r.detail["timing"] for r in fused_only)
    assert "timing" not in fused.strategies["field_only"].detail  # a reference: read and timed on its own
    assert "timing" not in fused.strategies["full_downstream"].detail
    assert fused.strategies["full_downstream"].decision.scores == fused.oracle.decision.scores  # the oracle's computation


@pytest.mark.parametrize("suffix", ["", " and also confirmed by the manager"])
def test_oracle_reuses_the_stale_prefix_and_equals_a_clean_prefill(lm, scenario, suffix):
    experiment = EditExperiment(lm, scenario, new=scenario.field().new + suffix)
    oracle, field_start = experiment.oracle, experiment.field_positions[0]
    clean = Notebook.from_prompt(lm, oracle.prompt)
    assert oracle.computed_tokens == len(oracle.prompt.context_ids) - field_start
    assert oracle.notebook.visible_token_ids() == clean.visible_token_ids()
    assert oracle.notebook.visible_segments() == clean.visible_segments()
    order = oracle.notebook.order
    for mine, theirs in zip(oracle.notebook.keys + oracle.notebook.values, clean.keys + clean.values):
        assert float((mine[:, :, order] - theirs).abs().max()) < 2e-5
    assert oracle.decision.margin == pytest.approx(clean.read_prompt(oracle.prompt).margin, abs=1e-4)


def test_a_cached_stale_run_is_reused_and_checked(lm, scenario):
    first = EditExperiment(lm, scenario)
    again = EditExperiment(lm, scenario, stale=first.stale)
    assert again.stale is first.stale
    assert again.run("erratum").decision.margin == pytest.approx(first.run("erratum").decision.margin, abs=1e-5)
    other = Scenario.from_toml(SAME_LENGTH_SCENARIO.replace("Refund test", "Other test"))
    with pytest.raises(ScenarioError, match="cached stale run"):
        EditExperiment(lm, other, stale=first.stale)


def test_cached_gradients_make_attribution_free_and_are_checked(lm, scenario):
    experiment = EditExperiment(lm, scenario)
    candidates = experiment.field_positions + experiment.downstream_positions
    fresh = attribution_effects(experiment.stale.notebook, experiment.oracle.notebook, experiment.prompt, candidates)
    cached = attribution_effects(
        experiment.stale.notebook, experiment.oracle.notebook, experiment.prompt, candidates, gradients=experiment.stale.gradients
    )
    assert torch.allclose(fresh.effects, cached.effects, atol=1e-6) and fresh.base_margin == pytest.approx(cached.base_margin, abs=1e-6)
    longer = experiment.stale.notebook.append([5, 6])
    with pytest.raises(NotebookError, match="computed for another notebook"):
        attribution_effects(longer, longer, experiment.prompt, candidates, gradients=experiment.stale.gradients)


def test_notes_share_is_one_minus_field_only_and_the_downstream_patch_is_exact(lm, scenario):
    experiment = EditExperiment(lm, scenario, settings=EditSettings(min_gap=0.01))
    report = experiment.report(["erratum"], fused=True, downstream_patch=True)
    field_only = EditExperiment(lm, scenario, settings=EditSettings(min_gap=0.01)).run("field_only")
    notes = report.notes
    assert notes.field_recovery == pytest.approx(field_only.recovery.value, abs=1e-4)
    assert notes.share == pytest.approx(1 - field_only.recovery.value, abs=1e-4)
    assert notes.field_only_label == field_only.decision.label
    # independent: a clean prefill with the new value, its downstream K/V copied into a clean stale prefill
    new_prompt = experiment.oracle.prompt
    clean_new, clean_old = Notebook.from_prompt(lm, new_prompt), Notebook.from_prompt(lm, experiment.stale.prompt)
    patched = clean_old.patch(clean_new, experiment.downstream_positions).read_prompt(new_prompt)
    stale, oracle = report.stale.decision.margin, report.oracle.decision.margin
    assert notes.downstream_recovery == pytest.approx((patched.margin - stale) / (oracle - stale), abs=1e-3)
    data = report.as_dict()["notes"]
    assert data["share"] == pytest.approx(notes.share, abs=1e-4) and data["headline"].startswith("Notes carry")


def test_notes_share_is_undefined_for_a_length_change(lm):
    from kvscope.engine.scenario import bundled_scenarios

    experiment = EditExperiment(lm, Scenario.load(bundled_scenarios()["refund_gate"]))
    notes = experiment.report(["erratum"], fused=True, downstream_patch=True).notes
    assert notes.share is None and notes.downstream_recovery is None and "not applicable" in notes.reason
    assert notes.headline().startswith("Notes share undefined")


def test_a_change_too_small_to_recover_says_so_in_a_sentence(lm, scenario):
    """Where the clean prefill barely moves the margin (below min_gap), the headline says the change does not move the
    decision, with the margin change; never "Notes share undefined … nothing to recover"."""
    experiment = EditExperiment(lm, scenario, settings=EditSettings(min_gap=1e6))
    report = experiment.report(["field_only"])
    notes, change = report.notes, report.oracle.decision.margin - report.stale.decision.margin
    assert notes.share is None and notes.unmoved_by == pytest.approx(change, abs=1e-6)
    headline = notes.headline()
    assert headline.startswith("Notes not measurable here: this change does not move the decision. A clean prefill with the new value")
    assert f"{change:+.3f}" in headline and "undefined" not in headline and "nothing to recover" not in headline
    assert report.as_dict()["notes"]["headline"] == headline


def test_frontier_points_equal_each_strategy_read_on_its_own(lm, scenario):
    from kvscope.engine.probes.frontier import probe_frontier

    settings = EditSettings(min_gap=0.01)
    result = probe_frontier(EditExperiment(lm, scenario, settings=settings), ks=[1, 3])
    context = result.context_tokens
    assert context == len(EditExperiment(lm, scenario).prompt.context_ids)
    for point in result.points:
        name = "field_topk" if point.k is not None else point.method
        ranking = "deviation" if "deviation" in point.method else "causal"
        alone = EditExperiment(lm, scenario, settings=EditSettings(min_gap=0.01, top_k=point.k or 1, ranking=ranking)).run(name)
        assert point.margin == pytest.approx(alone.decision.margin, abs=1e-4), point.method
        assert point.tokens_computed == alone.tokens_recomputed and point.fraction == pytest.approx(point.tokens_computed / context)
    assert [p.k for p in result.points if p.method == "field_topk (causal)"] == [1, 3]
    cheapest = result.cheapest_correct()
    assert cheapest.correct and all(p.tokens_computed >= cheapest.tokens_computed for p in result.points if p.correct)


def test_an_old_strategy_name_is_refused_with_its_new_one():
    with pytest.raises(StrategyError, match=r"unknown strategy 'hoist' \('hoist' is now 'restate'\)"):
        check_names(["erratum", "hoist"])
    assert check_names(["restate"]) == ["restate"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_notes_share_is_one_number_whatever_is_read_beside_it(scenario, arch, monkeypatch):
    """The Notes tab (four strategies fused), Learn (two fused), the locality probe and a strategy-by-strategy report read
    the same oracle and field_only margins, bit for bit, in bfloat16 too (where what shares a forward moves a margin)."""
    from kvscope.engine.probes.locality import probe_locality

    monkeypatch.setitem(MARGIN_NOISE, "bfloat16", 0.0)  # the embedded model's floor would leave a tiny model nothing to recover

    lm = tiny_model(arch, dtype=torch.bfloat16)  # tiny-llama's oracle moved by 0.006 with its forward's company before
    settings = EditSettings(min_gap=0.01)
    stale = EditExperiment(lm, scenario, settings=settings, capture_attention=True).stale
    made = lambda: EditExperiment(lm, scenario, settings=settings, capture_attention=True, stale=stale)  # noqa: E731
    notes = made().report(["field_only", "erratum", "field_erratum", "full_downstream"], fused=True)
    learn = made().report(["field_only", "full_downstream"], fused=True)
    apart = made().report(["erratum", "field_only"])
    locality = probe_locality(made())
    assert notes.notes.field_recovery is not None
    for other in (learn, apart):
        assert other.oracle.decision.margin == notes.oracle.decision.margin
        assert other.notes.as_dict() == notes.notes.as_dict()
    assert locality.gap.oracle == notes.oracle.decision.margin
    assert locality.field_only.margin == notes.strategies["field_only"].decision.margin
    assert locality.field_only.recovery == notes.notes.field_recovery
