"""Shared engine results on a tiny model for the figure tests (built once per session)."""

import pytest

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Scenario, bundled_scenarios


@pytest.fixture(scope="session")
def lm():
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def experiment(lm):
    """Same-length edit (REQ-1042 → REQ-7719); a small min_gap so recovery is defined on the tiny model."""
    return EditExperiment(lm, Scenario.load(bundled_scenarios()["request_id_control"]), settings=EditSettings(min_gap=0.01))


@pytest.fixture(scope="session")
def length_change(lm):
    """refund_gate's false → true changes the token count in the tiny tokenizer: in-place strategies do not apply."""
    return EditExperiment(lm, Scenario.load(bundled_scenarios()["refund_gate"]))
