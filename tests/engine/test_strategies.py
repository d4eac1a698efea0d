"""Edit strategies on tiny models: identities against oracle and stale, errors, JSON shape."""
import json

import pytest

from engine.notebook import NotebookError
from engine.scenario import Scenario, ScenarioError
from engine.strategies import STRATEGIES, EditExperiment, EditSettings
from engine.tiny import tiny_model
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
    assert result.strategies["auto"].detail["chosen"] in ("field_only", "erratum", "hoist", "field_erratum")


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
