"""Models side by side on tiny models: every compared number is the single-model run of the same analysis."""

import contextlib
import io
import json

import pytest

from kvscope.engine.cli import main
from kvscope.engine.comparison import (
    COMPARED_STRATEGIES,
    MAX_MODELS,
    READ_HEAD_MASS,
    ComparisonError,
    compare_models,
)
from kvscope.engine.comparison.models import NOTES_TOP
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.remedy import DEFAULT_REMEDY
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.models import load_model
from kvscope.engine.probes.heads import probe_heads
from kvscope.engine.probes.notes_map import probe_notes_map
from kvscope.engine.scenario import Scenario
from tests.shared import SAME_LENGTH_SCENARIO

MODELS = ("tiny-llama", "tiny-gpt2")  # GPT-2 has learned positions: its splice is refused, and the row says why
SKILL = "account_gate"  # the shortest bundled skill
SETTINGS = EditSettings(min_gap=1e-6)  # tiny random models move margins by little: keep recovery defined
KEYS = {"model", "parameters", "notes_share", "recoveries", "notes_depth", "read_heads", "splice_cosine"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    path = tmp_path_factory.mktemp("compare") / "refund.toml"
    path.write_text(SAME_LENGTH_SCENARIO)
    return Scenario.load(path)


@pytest.fixture(scope="module")
def models():
    return {spec: load_model(spec) for spec in MODELS}


@pytest.fixture(scope="module")
def comparison(models, scenario):
    messages, steps = [], []
    result = compare_models(
        MODELS, models.__getitem__, scenario, skill=SKILL, settings=SETTINGS, progress=messages.append, steps=lambda *s: steps.append(s)
    )
    assert steps[-1] == (len(MODELS) * 5, len(MODELS) * 5) and any("loading tiny-gpt2" in m for m in messages)
    return result


def _depth(lm, experiment: EditExperiment) -> float:
    """The notes map's NOTES_TOP strongest cells after the field (towards the oracle), mean layer / layers."""
    result = probe_notes_map(experiment, top=NOTES_TOP)
    layers = len(result.effects)
    cells = [
        (result.gap.direction * result.effects[layer][index], layer)
        for layer in range(layers)
        for index, position in enumerate(result.positions)
        if position not in experiment.field_positions
    ]
    strongest = sorted(cells, key=lambda cell: -cell[0])[:NOTES_TOP]
    return sum(layer / layers for _, layer in strongest) / len(strongest)


def _read_heads(experiment: EditExperiment) -> int:
    """The fewest heads holding READ_HEAD_MASS of the last decision token's attention on the heads probe's notes."""
    masses = sorted((m for row in probe_heads(experiment).mass_last for m in row), reverse=True)
    held, total = 0.0, sum(masses)
    for count, mass in enumerate(masses, start=1):
        held += mass
        if held >= READ_HEAD_MASS * total - 1e-12:
            return count
    raise AssertionError("the masses never reach the share")


def test_each_compared_number_equals_the_single_model_run(models, scenario, comparison):
    assert [row.spec for row in comparison.rows] == list(MODELS)
    for row in comparison.rows:
        lm = models[row.spec]
        report = EditExperiment(lm, scenario, settings=SETTINGS).report(COMPARED_STRATEGIES, fused=True)
        assert row.model == lm.fingerprint.name and row.parameters == lm.info()["parameters"]
        assert row.notes_share == pytest.approx(report.notes.share, abs=1e-5)
        assert row.recoveries == pytest.approx({name: report.strategies[name].recovery.value for name in COMPARED_STRATEGIES}, abs=1e-5)
        assert row.notes_depth == pytest.approx(_depth(lm, EditExperiment(lm, scenario, settings=SETTINGS)), abs=1e-9)
        assert row.read_heads == _read_heads(EditExperiment(lm, scenario, settings=SETTINGS))
        assert 1 <= row.read_heads <= row.heads == lm.info()["layers"] * lm.info()["attention_heads"]
    spliced = compare(models["tiny-llama"], with_skills(scenario, [SKILL], "start"), SkillStore(), remedy=DEFAULT_REMEDY)
    llama, gpt2 = comparison.rows
    assert llama.splice_cosine == pytest.approx(spliced.agreement["cosine"], abs=1e-6) and "splice_cosine" not in llama.missing
    assert gpt2.splice_cosine is None and "rotary" in gpt2.missing["splice_cosine"]


def test_the_json_holds_what_the_cli_promises(comparison):
    data = json.loads(json.dumps(comparison.as_dict()))
    assert [row["model"] for row in data["models"]] == list(MODELS)
    for row in data["models"]:
        assert KEYS <= set(row) and set(row["recoveries"]) == set(COMPARED_STRATEGIES)
        assert 0 <= row["notes_depth"] < 1 and row["details"]["layers"] == 3
    # the paper's field-only recoveries (arXiv 2606.17107, probe 1: locality) as it prints them, and their notes shares
    assert {p["model"]: (p["field_only_recovery"], p["notes_share"]) for p in data["paper"]} == {
        "Mistral-7B": (0.137, 0.863),
        "Llama-3.1-8B": (-0.028, 1.028),
        "Gemma-2-9B": (0.005, 0.995),
    }
    assert data["field"] == "order_status" and data["new"] == "pending" and data["splice_skill"] == SKILL


def test_cli_compare_models_prints_one_json_object(scenario, tmp_path):
    path = tmp_path / "refund.toml"
    path.write_text(SAME_LENGTH_SCENARIO)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["compare-models", "--models", "tiny-qwen2", "--scenario", str(path), "--skill", SKILL, "--json"])
    assert code == 0
    (line,) = [line for line in out.getvalue().splitlines() if line.strip()]
    data = json.loads(line)
    assert [row["model"] for row in data["models"]] == ["tiny-qwen2"] and KEYS <= set(data["models"][0])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["compare-models", "--models", "tiny-qwen2,tiny-qwen2", "--scenario", str(path), "--json"])
    assert code == 2 and "named twice" in json.loads(out.getvalue())["error"]


def test_refusals_come_before_any_model_loads(scenario):
    def never(spec):
        raise AssertionError("must not load")

    with pytest.raises(ComparisonError, match=f"1 to {MAX_MODELS} models"):
        compare_models(["a", "b", "c", "d"], never, scenario)
    with pytest.raises(ComparisonError, match="1 to"):
        compare_models([" ", ""], never, scenario)
    with pytest.raises(Exception, match="no_such_field"):
        compare_models(["tiny-llama"], never, scenario, "no_such_field")


def test_a_hybrid_is_refused_with_its_reason(scenario):
    with pytest.raises(ComparisonError, match="hybrid"):
        compare_models(["tiny-bamba"], load_model, scenario, skill=SKILL)
