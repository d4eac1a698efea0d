"""Decision readout arithmetic: label aggregation, margin, recovery, logit agreement."""

import math

import pytest
import torch

from kvscope.engine.cache.decision import (
    RECOVERY_MIN_GAP,
    decide,
    kl_divergence,
    logit_agreement,
    margin_noise,
    noise_words,
    recovery,
    recovery_gap,
)


def test_label_score_is_logsumexp_of_its_strings_and_margin_is_first_minus_best_other():
    decision = decide(
        {"yes": {"yes": math.log(0.2), "Yes": math.log(0.3)}, "no": {"no": math.log(0.1)}, "maybe": {"m": math.log(0.4)}}, torch.zeros(3)
    )
    assert decision.scores["yes"] == pytest.approx(math.log(0.5))
    assert decision.margin == pytest.approx(math.log(0.5) - math.log(0.4))
    assert decision.label == "yes"


def test_recovery_arithmetic_and_small_gap():
    assert recovery(state=1.0, stale=-1.0, oracle=3.0).value == pytest.approx(0.5)
    assert recovery(state=-1.0, stale=-1.0, oracle=3.0).value == 0.0
    assert recovery(state=3.0, stale=-1.0, oracle=3.0).value == 1.0
    assert recovery(state=5.0, stale=1.0, oracle=-1.0).value == pytest.approx(-2.0)
    small = recovery(state=0.1, stale=0.0, oracle=0.2)
    assert small.value is None and "0.200" in small.reason


def test_logit_agreement_identity_and_shift_invariance():
    logits = torch.randn(50)
    same = logit_agreement(logits, logits + 3.0)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["top1_agree"] == 1.0 and same["top5_agree"] == 1.0
    assert logit_agreement(logits, -logits)["top1_agree"] == 0.0


def test_kl_is_computed_once_clamped_at_zero_and_equals_its_definition():
    log_p, log_q = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), -1), torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), -1)
    p, q = log_p.exp().tolist(), log_q.exp().tolist()
    assert kl_divergence(log_p, log_q) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-6)
    assert kl_divergence(log_p, log_p + 1e-7) == 0.0  # rounding below zero is no divergence
    same = torch.tensor([0.1, 0.2, 0.3]).log()  # not normalised: the raw sum is negative, the KL is not
    assert float((same.exp() * (same - (same + 1e-3))).sum()) < 0 and kl_divergence(same, same + 1e-3) == 0.0


def test_the_noise_floor_widens_the_recovery_bar_and_is_said_only_outside_float32():
    floor = margin_noise("bfloat16")
    assert margin_noise("float32") == 0.0 and recovery_gap("float32") == RECOVERY_MIN_GAP and noise_words("float32", 0.01) == ""
    assert 0 < floor < 1 and recovery_gap("bfloat16") == pytest.approx(RECOVERY_MIN_GAP + floor)
    # issue 64's audited account_tier change: float32 moves the margin by +0.08, bfloat16 by +0.31; neither has anything to recover
    assert recovery(0.4, 0.317, 0.317 + RECOVERY_MIN_GAP + floor / 2, recovery_gap("bfloat16")).value is None
    assert "within that floor" in noise_words("bfloat16", floor / 2) and "within that floor" not in noise_words("bfloat16", 2 * floor)
    assert "float32 (the Model tab's dtype)" in noise_words("bfloat16", 2 * floor)
