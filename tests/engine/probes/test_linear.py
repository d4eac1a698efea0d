"""Linear probe: the logistic regression, position groups, logit lens and the whole probe on tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from kvscope.engine.cache.generation import hidden_states
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.probes import linear as linear_probe
from kvscope.engine.probes.linear import (
    GROUPS,
    ProbeError,
    balanced_commit_layer,
    commit_layer,
    cv_accuracy,
    lens_agreement,
    lens_labels,
    position_groups,
    probe_linear,
    stratified_folds,
    surface_variants,
)
from kvscope.engine.scenario import Scenario, Span, bundled_scenarios, is_aggregator


@pytest.fixture(scope="module")
def experiment():
    return EditExperiment(tiny_model("qwen2"), Scenario.load(bundled_scenarios()["refund_gate"]))


def test_logistic_regression_decodes_separable_data():
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(80, 30, generator=generator)
    labels = ["a" if value > 0 else "b" for value in (features[:, 0] + 0.5 * features[:, 1]).tolist()]
    features[:, 0] += torch.tensor([2.0 if label == "a" else -2.0 for label in labels])  # a clear margin
    assert cv_accuracy(features, labels, folds=4) >= 0.95


def test_logistic_regression_on_random_labels_is_near_chance():
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(200, 10, generator=generator)
    labels = torch.randint(0, 2, (200,), generator=generator).tolist()
    assert 0.35 <= cv_accuracy(features, labels, folds=5) <= 0.65


def test_constant_features_decode_nothing():
    labels = ["x"] * 8 + ["y"] * 8
    assert cv_accuracy(torch.ones(16, 5), labels, folds=4) == 0.5


def test_three_classes_decode():
    centers = torch.eye(3) * 4
    labels = [i % 3 for i in range(30)]
    features = centers[labels] + 0.1 * torch.randn(30, 3, generator=torch.Generator().manual_seed(3))
    assert cv_accuracy(features, labels, folds=3) == 1.0


def test_stratified_folds_are_balanced_and_deterministic():
    labels = [0] * 8 + [1] * 8
    folds = stratified_folds(labels, 4, seed=0)
    assert folds == stratified_folds(labels, 4, seed=0)
    for fold in range(4):
        members = [labels[i] for i in range(16) if folds[i] == fold]
        assert sorted(members) == [0, 0, 1, 1]


def test_cv_accuracy_rejects_bad_folds():
    with pytest.raises(ProbeError, match="folds"):
        cv_accuracy(torch.zeros(3, 2), [0, 1, 0], folds=4)


def test_aggregators_are_punctuation_and_whitespace():
    assert all(is_aggregator(text) for text in ["\n", "\n\n", ".", ".\n", ")\n\n", " ,", ";", ":"])
    assert not any(is_aggregator(text) for text in [" false", "ICY", "4", "<|im_end|>", " a."])


def test_position_groups_split_downstream_tokens():
    texts = ["<s>", "status", ":", " shipped", "\n", "Refund", " only", " if", ".\n", "\n\n"]
    groups = position_groups(texts, Span(3, 4))
    assert groups == {"field": [3], "aggregators": [4, 8, 9], "others": [5, 6, 7]}


def test_surface_variants_mildest_first_without_duplicates():
    variants = surface_variants("false")
    assert variants[:2] == ["False", "FALSE"]
    assert "false" not in variants and len(variants) == len(set(variants))
    assert {'"false"', "'false'", "`false`", "(false)", "false.", '"FALSE".'} <= set(variants)


def test_commit_layer_is_the_last_switch():
    assert commit_layer(["no", "yes", "no", "no"]) == 2
    assert commit_layer(["yes", "yes", "yes"]) == 0
    assert commit_layer(["no", "no", "yes"]) == 2


def test_commit_is_balanced_over_conclusions():
    # the lens favours "yes" from layer 1: "yes" samples look committed early, "no" ones flip only at the end
    lens = [list("nyyy"), list("nyyy"), list("nyyy"), list("yyyn"), list("nnyn"), list("nnnn")]
    classes = ["yes", "yes", "yes", "no", "no", "no"]
    assert [commit_layer(labels) for labels in lens] == [1, 1, 1, 3, 3, 0]
    assert lens_agreement(lens, classes) == {"no": [2 / 3, 2 / 3, 1 / 3, 1.0], "yes": [0.0, 1.0, 1.0, 1.0]}
    assert balanced_commit_layer(lens, classes) == 3
    assert balanced_commit_layer(lens[:3], classes[:3]) == 1


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_logit_lens_last_layer_is_the_models_answer(arch):
    lm = tiny_model(arch)
    context, decode = list(range(20, 50)), [5, 6, 7]
    answers = {"a": ((8,), (12, 13)), "b": ((9,),)}
    states = hidden_states(Notebook.empty(lm), context + decode)[:, -1]
    logits = Notebook.prefill(lm, context).read(decode, answers).next_token_logits
    expected = "a" if max(logits[8], logits[12]) > logits[9] else "b"
    labels = lens_labels(lm, states, answers)
    assert len(labels) == lm.model.config.num_hidden_layers + 1
    assert labels[-1] == expected


def test_probe_runs_on_a_tiny_model(experiment):
    calls = []
    result = probe_linear(experiment, min_samples=16, progress=lambda done, total: calls.append((done, total)))
    layers = experiment.lm.model.config.num_hidden_layers
    assert result.n_samples >= 16 and len({s.text for s in result.samples}) == result.n_samples
    assert {s.origin for s in result.samples} == {"false", "true"}
    for group in GROUPS:
        assert len(result.value[group]) == layers + 1
        assert all(0.0 <= acc <= 1.0 for acc in result.value[group])
    assert len(result.commit_layers) == result.n_samples and 0 <= result.commit_layer <= layers
    assert all(len(labels) == layers + 1 for labels in result.lens)
    assert calls[-1][0] == calls[-1][1]
    if not result.conclusion_decodable:  # random weights usually answer the same for every value
        assert "one conclusion class" in result.reason and result.write_layer is None
        assert all(row is None for row in result.conclusion.values())
    json.dumps(result.as_dict())


def test_write_layer_from_decodable_conclusions(experiment, monkeypatch):
    monkeypatch.setattr(linear_probe, "_conclusion", lambda exp, text, prompt: "yes" if text.lower().strip("\"'`().") == "true" else "no")
    result = probe_linear(experiment, min_samples=16)
    layers = experiment.lm.model.config.num_hidden_layers
    assert result.conclusion_decodable and result.class_counts == {"no": 8, "yes": 8}
    aggregators = result.conclusion["aggregators"]
    assert len(aggregators) == layers + 1
    assert aggregators[0] == 0.5  # before any attention every sample's aggregators are the same tokens
    expected = next((layer for layer, acc in enumerate(aggregators) if acc >= 0.9), None)
    assert result.write_layer == expected
    summary = result.as_dict()
    assert summary["write_depth"] == (None if expected is None else round(expected / layers, 3))


def test_probe_needs_enough_samples(experiment):
    with pytest.raises(ProbeError, match="folds"):
        probe_linear(experiment, min_samples=2, folds=3)
