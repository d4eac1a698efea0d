"""Weight editing beside the erratum: private copies leave the shared model untouched, the closed forms hold,
and every method is measured the same way."""

import hashlib
import json

import pytest
import torch

from kvscope.engine.cli import main
from kvscope.engine.edit import rome
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.lora import LoraSettings, lora_edit
from kvscope.engine.edit.rome import RomeSettings, down_projection, rank_one_insert, rome_edit
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.edit.weight_edit import compare_edits
from kvscope.engine.edit.weight_update import WeightEditError, decision_margin_of, private_copy
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Scenario, bundled_scenarios
from tests.shared import SAME_LENGTH_SCENARIO

FAST_LORA = LoraSettings(rank=2, steps=3)
FAST_ROME = RomeSettings(layer=1, steps=3, corpus_tokens=256)


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def experiment(lm):
    return EditExperiment(lm, Scenario.from_toml(SAME_LENGTH_SCENARIO))


def _digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()


def test_private_copy_shares_parameters_and_keeps_the_original_tree(lm):
    name = "model.layers.1.mlp.down_proj"
    private = private_copy(lm.model, [name])
    private.get_submodule("model.layers.1.mlp")._modules["down_proj"] = torch.nn.Identity()
    assert isinstance(lm.model.get_submodule(name), torch.nn.Linear)
    assert private.get_submodule("model.layers.0.mlp.down_proj") is lm.model.get_submodule("model.layers.0.mlp.down_proj")
    assert private.get_submodule("model.embed_tokens").weight.data_ptr() == lm.model.get_submodule("model.embed_tokens").weight.data_ptr()


def test_plain_forward_margin_equals_the_notebook_read(lm, experiment):
    margin = decision_margin_of(lm.model, experiment.stale.prompt)
    assert float(margin) == pytest.approx(experiment.stale.decision.margin, abs=1e-4)


def test_rank_one_insert_writes_the_shift_at_the_key_only():
    generator = torch.Generator().manual_seed(0)
    weight, keys = torch.randn(6, 10, generator=generator), torch.randn(200, 10, generator=generator)
    moment, key, shift = keys.T @ keys / 200, keys[3], torch.randn(6, generator=generator)
    edited = rank_one_insert(weight, key, shift, moment, ridge=0.0)
    assert torch.allclose(edited @ key, weight @ key + shift, atol=1e-4)
    assert torch.linalg.matrix_rank(edited - weight) == 1
    orthogonal = torch.linalg.solve(moment, key)  # C-orthogonal to k: (C⁻¹k)ᵀ x = 0
    other = torch.randn(10, generator=generator)
    other -= (orthogonal @ other) / (orthogonal @ orthogonal) * orthogonal
    assert torch.allclose(edited @ other, weight @ other, atol=1e-4)


@pytest.mark.parametrize("method", ["lora", "rome"])
def test_edits_move_the_decision_and_never_touch_the_shared_model(lm, experiment, method):
    before = _digest(lm.model)
    seen_during = []

    def read_shared(done, total):  # another request reading the shared model mid-edit
        seen_during.append(run_scenario(lm, experiment.scenario).decision.margin)

    edit = lora_edit(lm, experiment, FAST_LORA, read_shared) if method == "lora" else rome_edit(lm, experiment, FAST_ROME, read_shared)
    assert _digest(lm.model) == before
    assert not any("lora" in name for name, _ in lm.model.named_modules())
    assert all(m == pytest.approx(experiment.stale.decision.margin, abs=1e-5) for m in seen_during)
    direction = 1 if experiment.oracle.decision.margin > experiment.stale.decision.margin else -1
    edited = run_scenario(edit.lm, experiment.scenario).decision.margin
    assert direction * (edited - experiment.stale.decision.margin) > 0
    assert edit.lm.fingerprint != lm.fingerprint and edit.memory_bytes > 0


@pytest.mark.parametrize("method", ["lora", "rome"])
def test_an_edit_that_fails_half_way_leaves_nothing_behind(lm, experiment, method):
    before = _digest(lm.model)

    def fail(done, total):
        if done == 2:
            raise RuntimeError("stopped half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        lora_edit(lm, experiment, FAST_LORA, fail) if method == "lora" else rome_edit(lm, experiment, FAST_ROME, fail)
    assert _digest(lm.model) == before
    assert run_scenario(lm, experiment.scenario).decision.margin == pytest.approx(experiment.stale.decision.margin, abs=1e-6)


def test_comparison_measures_every_method_and_the_erratum_never_contaminates(lm):
    scenario = Scenario.from_toml(SAME_LENGTH_SCENARIO)
    others = [Scenario.load(bundled_scenarios()[name]) for name in ("refund_gate", "access_control")]
    report = compare_edits(lm, scenario, others, lora=FAST_LORA, rome=FAST_ROME).as_dict()
    assert set(report["methods"]) == {"rome", "lora", "field_erratum"}
    erratum = report["methods"]["field_erratum"]
    assert erratum["contamination"] == 0.0 and erratum["collateral"] == 0.0 and erratum["collateral_mean_abs_delta"] == 0.0
    for outcome in report["methods"].values():
        assert 0.0 <= outcome["contamination"] <= 1.0 and 0.0 <= outcome["collateral"] <= 1.0
        assert outcome["edit_ms"] >= 0 and outcome["memory_bytes"] >= 0
    assert report["methods"]["rome"]["setup_ms"] > 0 and report["methods"]["rome"]["details"]["layer"] == 1
    assert len(report["probes"]["variants"]) == 3 and report["probes"]["others"] == [other.name for other in others]


def test_refusals_name_the_problem(lm, experiment):
    with pytest.raises(WeightEditError, match="layer 99 does not exist"):
        down_projection(lm, 99)
    with pytest.raises(WeightEditError, match="single dense MLP"):
        down_projection(tiny_model("deepseek_v3"), 2)  # a mixture-of-experts layer
    with pytest.raises(WeightEditError, match="no linear module named nowhere"):
        lora_edit(lm, experiment, LoraSettings(modules=("nowhere",)))
    with pytest.raises(WeightEditError, match="unknown method 'finetune'"):
        compare_edits(lm, experiment.scenario, [], methods=["finetune"])


def test_cli_weights_json(tmp_path, capsys):
    path = tmp_path / "refund.toml"
    path.write_text(SAME_LENGTH_SCENARIO)
    others = ",".join(str(bundled_scenarios()[name]) for name in ("refund_gate", "access_control"))
    code = main(
        [
            "weights",
            "--json",
            "--model",
            "tiny-qwen2",
            "--scenario",
            str(path),
            "--methods",
            "field_erratum,rome",
            "--rome-layer",
            "1",
            "--rome-steps",
            "2",
            "--others",
            others,
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and set(result["methods"]) == {"field_erratum", "rome"}
    assert {"efficacy", "contamination", "collateral", "collateral_mean_abs_delta", "edit_ms", "setup_ms", "memory_bytes"} <= set(
        result["methods"]["rome"]
    )
    assert {"model", "scenario", "field", "old", "new"} <= set(result) and len(result["probes"]["others"]) == 2


def test_key_covariances_are_bounded_and_symmetric(lm):
    moments = [rome.key_moment(lm, down_projection(lm, layer), 64)[0] for layer in range(3)]
    assert len(rome._COVARIANCES) <= rome.KEPT_COVARIANCES
    assert all(torch.allclose(m, m.T) and float(torch.linalg.eigvalsh(m).min()) > -1e-5 for m in moments)
