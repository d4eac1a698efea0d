"""Captum attribution: features, the scored forward against hand-made forwards, both methods, errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.probes import attribution
from kvscope.engine.probes.attribution import (
    AttributionError,
    captum_attribution,
    context_features,
)
from kvscope.engine.scenario import Scenario, bundled_scenarios


@pytest.fixture(scope="module")
def experiment():
    return EditExperiment(tiny_model("qwen2"), Scenario.load(bundled_scenarios()["refund_gate"]))


def _hand_margin(lm, ids, answers):
    """First label's log Σ P(answer) minus the other's, one plain forward per answer string."""
    scores = []
    for sequences in answers.values():
        strings = []
        for answer in sequences:
            full = torch.tensor([list(ids) + list(answer)])
            with torch.no_grad():
                log_probs = torch.log_softmax(lm.model(input_ids=full).logits[0].float(), -1)
            start = len(ids) - 1
            strings.append(sum(log_probs[start + i, token] for i, token in enumerate(answer)))
        scores.append(torch.logsumexp(torch.stack(strings), 0))
    return float(scores[0] - max(scores[1:]))


def _ablated(prompt, start, end, baseline):
    ids = list(prompt.context_ids) + list(prompt.decode_ids)
    ids[start:end] = [baseline] * (end - start)
    return ids


def test_segments_are_lines_with_the_field_apart():
    segments = ["template"] * 2 + ["context"] * 3 + ["field:x"] + ["context"] * 4 + ["template"]
    texts = ["<s>", "user\n", "SESSION", "\n", "x:", " false", "\n", "Policy", " here", ".\n", "\n\n"]
    assert context_features(segments, texts, "segments") == [
        (2, 4, "context"),
        (4, 5, "context"),
        (5, 6, "field:x"),
        (6, 7, "context"),
        (7, 10, "context"),
    ]
    tokens = context_features(segments, texts, "tokens")
    assert [start for start, _, _ in tokens] == list(range(2, 10)) and all(end == start + 1 for start, end, _ in tokens)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_full_score_is_the_runs_margin(arch):
    experiment = EditExperiment(tiny_model(arch), Scenario.load(bundled_scenarios()["refund_gate"]))
    result = captum_attribution(experiment, method="gradient", steps=1)
    assert result.full_score == pytest.approx(experiment.stale.decision.margin, abs=1e-4)


def test_ablation_scores_match_hand_made_forwards(experiment):
    lm, prompt = experiment.lm, experiment.stale.prompt
    result = captum_attribution(experiment)
    baseline = lm.tokenizer.pad_token_id
    full = _hand_margin(lm, list(prompt.context_ids) + list(prompt.decode_ids), prompt.answer_ids)
    assert result.full_score == pytest.approx(full, abs=1e-4)
    everything = list(prompt.context_ids) + list(prompt.decode_ids)
    for feature in result.features:
        everything[feature.start : feature.end] = [baseline] * (feature.end - feature.start)
    assert result.baseline_score == pytest.approx(_hand_margin(lm, everything, prompt.answer_ids), abs=1e-4)
    field = next(f for f in result.features if f.kind == "field:refund_eligible")
    assert field.text == " false"
    without_field = _hand_margin(lm, _ablated(prompt, field.start, field.end, baseline), prompt.answer_ids)
    assert field.score == pytest.approx(full - without_field, abs=1e-4)


def test_ablating_with_the_tokens_own_id_scores_zero(experiment):
    prompt = experiment.stale.prompt
    features = captum_attribution(experiment).features
    single = next(f for f in features if f.end - f.start == 1 and f.kind == "context")
    result = captum_attribution(experiment, baseline_id=prompt.context_ids[single.start])
    assert next(f for f in result.features if f.start == single.start).score == 0.0


def test_answer_target_and_oracle_run(experiment):
    result = captum_attribution(experiment, run="oracle", target="answer")
    decision = experiment.oracle.decision
    assert result.run == "oracle" and result.target.startswith(f"log P({decision.label})")
    assert result.full_score == pytest.approx(decision.scores[decision.label], abs=1e-4)
    assert any(f.text == " true" for f in result.features)


def test_gradient_gives_one_finite_score_per_feature(experiment):
    calls = []
    segments = captum_attribution(experiment, method="gradient", steps=64, progress=lambda d, t: calls.append((d, t)))
    lines = context_features(
        experiment.stale.prompt.context_segments,
        [experiment.lm.tokenizer.decode([t]) for t in experiment.stale.prompt.context_ids],
        "segments",
    )
    assert [(f.start, f.end) for f in segments.features] == [(s, e) for s, e, _ in lines]
    assert all(math.isfinite(f.score) for f in segments.features)
    assert abs(segments.delta) < 0.05  # integrated gradients: scores sum to the full − baseline effect
    assert calls[-1] == (16, 16)  # 64 steps in batches of 4
    tokens = captum_attribution(experiment, method="gradient", granularity="tokens", steps=4)
    assert sum(f.end - f.start for f in tokens.features) == sum(f.end - f.start for f in segments.features)
    json.dumps(segments.as_dict())


def test_works_on_a_scenario_run(experiment):
    result = captum_attribution(experiment.stale, method="gradient", steps=1)
    assert result.run == "given"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "shap"}, "unknown method"),
        ({"granularity": "words"}, "unknown granularity"),
        ({"target": "prob"}, "unknown target"),
        ({"run": "fresh"}, "unknown run"),
        ({"method": "gradient", "steps": 0}, "steps"),
        ({"baseline_id": 10**9}, "outside the vocabulary"),
    ],
)
def test_bad_arguments_fail_clearly(experiment, kwargs, message):
    with pytest.raises(AttributionError, match=message):
        captum_attribution(experiment, **kwargs)


def test_run_choice_needs_an_experiment(experiment):
    with pytest.raises(AttributionError, match="already one run"):
        captum_attribution(experiment.stale, run="oracle")
    with pytest.raises(AttributionError, match="EditExperiment or a ScenarioRun"):
        captum_attribution("stale")


def test_long_token_ablation_suggests_segments(experiment, monkeypatch):
    monkeypatch.setattr(attribution, "MAX_ABLATION_FEATURES", 10)
    with pytest.raises(AttributionError, match="granularity='segments'"):
        captum_attribution(experiment, granularity="tokens")
