"""Reading a decision: answer log-probs, margin, label, and recovery between cache states.

A label's score is log Σ_s P(s | context, question) over its surface strings s, each scored as the full
token sequence of a continuation. The margin compares the first label against the best other one, so it
is the signed *decision score* the paper's recovery uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvscope.engine.jsonable import rounded

RECOVERY_MIN_GAP = 0.25
DECISIVE_MARGIN = RECOVERY_MIN_GAP  # a reference margin closer to 0 than this is a tie: agreement with it says little

MARGIN_NOISE = {"bfloat16": 0.15, "float16": 0.15}  # measured 0.1464 (event_ticket_json), rounded up
"""The noise floor of a margin read in a dtype: the largest |margin − float32's margin| its layers leave (the readout
itself runs in float32, :func:`kvscope.engine.cache.adapter.install_float32_readout`), over the stale, oracle and
field_only margins and the effect (oracle − stale) of every bundled scenario on the embedded model
(``benchmarks/studies/readout_noise.py``, its result in ``benchmarks/studies/results/readout_noise-embedded-cpu.json``).
float16 is not measured: it keeps 3 more mantissa bits than bfloat16, whose floor stands for it."""


def margin_noise(dtype: str) -> float:
    """The noise floor of a margin read in ``dtype`` (a dtype name, :data:`MARGIN_NOISE`); 0.0 in float32, the reference."""
    return MARGIN_NOISE.get(dtype, 0.0)


def recovery_gap(dtype: str, min_gap: float = RECOVERY_MIN_GAP) -> float:
    """The smallest stale → oracle margin change a recovery is measured against in ``dtype``: ``min_gap`` plus the
    dtype's noise floor, so a change its rounding alone could make is never a finding (a bfloat16 read and a float32
    one then agree on whether there is anything to recover)."""
    return min_gap + margin_noise(dtype)


def noise_words(dtype: str, effect: float | None = None) -> str:
    """What the noise floor means for margins read in ``dtype`` (plain text; empty in float32), and where ``effect`` (a
    margin change) is within it, that it is and how to read it exactly."""
    floor = margin_noise(dtype)
    if floor == 0.0:
        return ""
    words = f"Margins read in {dtype} sit within ±{floor:.2f} of float32's (the noise floor measured on the bundled scenarios)"
    if effect is not None and abs(effect) <= floor:
        return (
            f"{words}; this change moves the margin by {effect:+.2f}, within that floor, so it may be {dtype}'s rounding "
            "rather than an effect: load the model in float32 (the Model tab's dtype) to read it exactly."
        )
    return words + "; load the model in float32 (the Model tab's dtype) for exact margins."


@dataclass
class Decision:
    """What the model would answer from one cache state, with the evidence."""

    scores: dict[str, float]  # label -> log-prob (log-sum-exp over its surface strings)
    string_logprobs: dict[str, dict[str, float]]  # label -> surface string -> log-prob
    margin: float  # score(first label) − max(score(other labels))
    label: str
    next_token_logits: torch.Tensor = field(repr=False)  # (vocab,) float32, after the last decode token
    attention: torch.Tensor | None = field(default=None, repr=False)  # (layers, heads, decode, entries + decode)

    def as_dict(self) -> dict:
        """JSON-ready summary (no tensors)."""
        return {
            "scores": {k: round(v, 4) for k, v in self.scores.items()},
            "string_logprobs": {label: {s: round(v, 4) for s, v in strings.items()} for label, strings in self.string_logprobs.items()},
            "margin": round(self.margin, 4),
            "decision": self.label,
        }


def answer_logprob(logits: torch.Tensor, rows: Sequence[int], answer: Sequence[int]) -> torch.Tensor:
    """log P(answer): Σ_i log-softmax(logits[rows[i]])[answer[i]], over logits (..., rows, vocab) -> (...)."""
    steps = torch.log_softmax(logits[..., list(rows), :].float(), -1)
    index = torch.arange(len(answer), device=steps.device), torch.tensor(list(answer), device=steps.device)
    return steps[..., index[0], index[1]].sum(-1)


def label_scores(string_logprobs: torch.Tensor) -> torch.Tensor:
    """(..., strings) -> (...): a label's score, log Σ_s P(s) over its surface strings."""
    return torch.logsumexp(string_logprobs, -1)


def decision_margin(scores: torch.Tensor) -> torch.Tensor:
    """(..., labels) -> (...): the first label's score minus the best other one's."""
    return scores[..., 0] - scores[..., 1:].max(-1).values


def decide(string_logprobs: dict[str, dict[str, float]], next_token_logits: torch.Tensor) -> Decision:
    """Aggregate per-string log-probs into label scores, margin and the chosen label."""
    scores = {label: float(label_scores(torch.tensor(list(s.values())))) for label, s in string_logprobs.items()}
    return Decision(
        scores=scores,
        string_logprobs=string_logprobs,
        margin=float(decision_margin(torch.tensor(list(scores.values()), dtype=torch.float64))),
        label=max(scores, key=scores.get),
        next_token_logits=next_token_logits,
    )


RECOVERY_WORDS = (
    "Recovery: how far an edit moves the decision margin from the stale cache's (0) to a clean prefill's with the new "
    "value (1); above 1 it overshoots the clean prefill's margin, below 0 it moves the margin the other way."
)


@dataclass(frozen=True)
class Recovery:
    """(s − s_stale) / (s_oracle − s_stale), or None with the reason when the gap is too small (:data:`RECOVERY_WORDS`)."""

    value: float | None
    reason: str | None = None

    def as_dict(self) -> dict:
        return {"recovery": rounded(self.value), "reason": self.reason}


def recovery(state: float, stale: float, oracle: float, min_gap: float = RECOVERY_MIN_GAP) -> Recovery:
    """Decision recovery of a cache state: 0 is the stale cache, 1 is a clean prefill with the new value."""
    gap = oracle - stale
    if not math.isfinite(gap) or abs(gap) < min_gap:
        return Recovery(None, f"oracle and stale margins differ by {gap:.3f} (< {min_gap}): nothing to recover")
    return Recovery((state - stale) / gap)


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """KL(p‖q) of two log-probability vectors, in nats; clamped at 0, where float rounding of two equal distributions
    can land a hair below it (the one place a KL is computed)."""
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def logit_agreement(a: torch.Tensor, b: torch.Tensor, top_k: int = 5) -> dict[str, float]:
    """Cosine, KL(a‖b) of softmaxes (:func:`kl_divergence`), top-1 and top-k overlap between two next-token logit vectors."""
    a, b = a.float(), b.float()
    top_a, top_b = set(a.topk(top_k).indices.tolist()), set(b.topk(top_k).indices.tolist())
    return {
        "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
        "kl": kl_divergence(torch.log_softmax(a, -1), torch.log_softmax(b, -1)),
        "top1_agree": float(a.argmax() == b.argmax()),
        f"top{top_k}_agree": len(top_a & top_b) / top_k,
    }


@dataclass(frozen=True)
class DecisionMatch:
    """A decision read from an approximate cache against the reference's, aware of ties.

    ``agree`` is None when the reference is a tie (|margin| < ``DECISIVE_MARGIN``): both labels are then
    within noise of each other, and the margin error is the number to look at.
    """

    margin_error: float  # approximate − reference margin
    reference_margin: float
    same_label: bool

    @classmethod
    def of(cls, approximate: Decision, reference: Decision) -> "DecisionMatch":
        return cls(approximate.margin - reference.margin, reference.margin, approximate.label == reference.label)

    @property
    def decisive(self) -> bool:
        return abs(self.reference_margin) >= DECISIVE_MARGIN

    @property
    def agree(self) -> bool | None:
        return self.same_label if self.decisive else None

    def as_dict(self) -> dict:
        return {
            "margin_error": round(self.margin_error, 4),
            "decisive": self.decisive,
            "decision_agree": self.agree,
            "same_label": self.same_label,
        }
