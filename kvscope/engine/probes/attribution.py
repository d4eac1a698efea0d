"""Captum attribution of a run's decision to parts of its context.

The attributed function is a plain HF forward of the whole sequence — context + question, and for each
multi-token answer its leading tokens — returning the decision target: the ``margin`` (first label's score
minus the best other, as :mod:`kvscope.engine.cache.decision` defines it) or the chosen label's log-prob (``answer``).

| method | what it does | cost | caveat |
|---|---|---|---|
| ``ablation`` | captum ``FeatureAblation``: a feature's tokens replaced by a neutral token id, re-scored | one forward per feature | interactions: scores need not add up to the all-ablated effect |
| ``gradient`` | captum ``IntegratedGradients`` on the features' input embeddings, from the neutral token's embedding | ``steps`` forwards + backwards | a path approximation; ``delta`` is the completeness gap |

Features: ``segments`` are the lines of the scenario context (split after tokens holding a newline), the
field its own feature; ``tokens`` is every context token. The chat template and system prompt (segment
"template") stay fixed. captum's ``LLMAttribution`` is not used: in 0.9 it scores the log-prob of one target
string (no margin between labels) and rebuilds its inputs from text, while KVScope renders ids piece by
piece (chat template included), which need not round-trip through the tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.cache.decision import answer_logprob, decision_margin, label_scores
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.runs import ScenarioRun
from kvscope.engine.errors import KVScopeError
from kvscope.engine.jsonable import attributes
from kvscope.engine.progress import StepProgress, Tick, ticker
from kvscope.engine.scenario import RenderedPrompt
from kvscope.engine.timing import Stopwatch

METHODS = ("ablation", "gradient")
GRANULARITIES = ("segments", "tokens")
TARGETS = ("margin", "answer")
RUNS = ("stale", "oracle")
MAX_ABLATION_FEATURES = 512
_GRADIENT_BATCH = 4


class AttributionError(KVScopeError):
    """An attribution request that cannot run; the message says which argument and what to use instead."""


@dataclass(frozen=True)
class Feature:
    """One attributed piece of the context: token range [start, end) of the context ids, text, score."""

    start: int
    end: int
    text: str
    kind: str  # "context" or "field:NAME"
    score: float

    def as_dict(self) -> dict:
        return {**attributes(self, "start", "end", "text", "kind"), "score": round(self.score, 4)}


@dataclass
class AttributionResult:
    """Per-feature attribution of one run's decision target, with the scores it is measured against."""

    model: str
    scenario: str
    run: str
    method: str
    granularity: str
    target: str
    baseline_token: str
    full_score: float  # target on the real context
    baseline_score: float  # target with every feature replaced by the baseline token
    features: list[Feature]
    ms: float
    steps: int | None = None  # integration steps (gradient)

    @property
    def total(self) -> float:
        """Sum of feature scores (compare with ``full_score - baseline_score``)."""
        return sum(feature.score for feature in self.features)

    @property
    def delta(self) -> float:
        """Sum of scores minus the all-ablated effect: interactions (ablation) or the completeness gap (gradient)."""
        return self.total - (self.full_score - self.baseline_score)

    def headline(self) -> str:
        """What the attribution found, in one sentence: the feature with the largest score, against the whole effect."""
        if not self.features:
            return f"No context feature to attribute ({self.method}, {self.run} run)."
        top = max(self.features, key=lambda feature: abs(feature.score))
        text = top.text.strip()
        text = text if len(text) <= 60 else text[:59] + "…"
        whole = self.full_score - self.baseline_score
        return (
            f"In the {self.run} run, {self.method} attribution of {self.target} puts the most on {text!r} "
            f"({top.kind}): {top.score:+.2f} of the {whole:+.2f} that replacing every feature with {self.baseline_token!r} moves it."
        )

    def as_dict(self) -> dict:
        return {
            **attributes(self, "model", "scenario"),
            "headline": self.headline(),
            **attributes(self, "run", "method", "granularity", "target", "baseline_token"),
            "full_score": round(self.full_score, 4),
            "baseline_score": round(self.baseline_score, 4),
            "total": round(self.total, 4),
            "delta": round(self.delta, 4),
            **attributes(self, "steps", "features"),
            "ms": round(self.ms, 1),
        }


# ---------------------------------------------------------------------------- features
def context_features(segments: Sequence[str], token_texts: Sequence[str], granularity: str) -> list[tuple[int, int, str]]:
    """(start, end, kind) of each feature over the non-template context tokens, in order."""
    if granularity not in GRANULARITIES:
        raise AttributionError(f"unknown granularity {granularity!r}; choose one of {', '.join(GRANULARITIES)}")
    if len(segments) != len(token_texts):
        raise AttributionError(f"{len(segments)} segment labels for {len(token_texts)} tokens")
    features: list[tuple[int, int, str]] = []
    for position, segment in enumerate(segments):
        if segment == "template":
            continue
        if features:
            start, end, kind = features[-1]
            line_open = "\n" not in token_texts[end - 1]
            if granularity == "segments" and end == position and kind == segment and line_open:
                features[-1] = (start, position + 1, kind)
                continue
        features.append((position, position + 1, segment))
    return features


# ---------------------------------------------------------------------------- the scored forward
def _forward_label_scores(lm: LoadedModel, embeds: torch.Tensor, answer_ids: dict[str, tuple[tuple[int, ...], ...]]) -> torch.Tensor:
    """(B, labels) log Σ_s P(s | sequence) over each label's answers, from plain forwards of ``embeds`` (B, T, hidden)."""
    model, embedding = lm.model, lm.model.get_input_embeddings()
    last: torch.Tensor | None = None
    labels = []
    for sequences in answer_ids.values():
        strings = []
        for ids in sequences:
            if len(ids) == 1:
                if last is None:
                    with compute_slot(embeds.shape[1]):
                        last = model(inputs_embeds=embeds, logits_to_keep=1).logits
                strings.append(answer_logprob(last, [0], ids))
                continue
            lead = embedding(torch.tensor(ids[:-1], device=embeds.device))[None].expand(len(embeds), -1, -1)
            with compute_slot(embeds.shape[1] + len(ids) - 1):
                logits = model(inputs_embeds=torch.cat([embeds, lead], 1), logits_to_keep=len(ids)).logits
            strings.append(answer_logprob(logits, range(len(ids)), ids))
        labels.append(label_scores(torch.stack(strings, -1)))
    return torch.stack(labels, -1)


def decision_target(lm: LoadedModel, prompt: RenderedPrompt, target: str, chosen: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """embeds (B, T, hidden) of context + question -> (B,) target: the margin, or the ``chosen`` label's score."""
    if target not in TARGETS:
        raise AttributionError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    labels = list(prompt.answer_ids)

    def score(embeds: torch.Tensor) -> torch.Tensor:
        scores = _forward_label_scores(lm, embeds, prompt.answer_ids)
        if target == "answer":
            return scores[:, labels.index(chosen)]
        return decision_margin(scores)

    return score


def _describe(target: str, labels: Sequence[str], chosen: str) -> str:
    """The target in words, e.g. "margin: log P(yes) − log P(no)"."""
    if target == "answer":
        return f"log P({chosen}) (the chosen answer)"
    others = labels[1] if len(labels) == 2 else f"max({', '.join(labels[1:])})"
    return f"margin: log P({labels[0]}) − log P({others})"


def _baseline_id(lm: LoadedModel, baseline_id: int | None) -> int:
    """The neutral token: the given id, else the tokenizer's pad token, else its EOS token."""
    tokenizer = lm.tokenizer
    chosen = next((i for i in (baseline_id, tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), None)
    if chosen is None:
        raise AttributionError("the tokenizer has no pad or EOS token to ablate with; pass baseline_id")
    if not 0 <= chosen < lm.model.get_input_embeddings().num_embeddings:
        raise AttributionError(f"baseline_id {chosen} is outside the vocabulary")
    return chosen


def _pick_run(source: EditExperiment | ScenarioRun, run: str | None) -> tuple[ScenarioRun, str]:
    """The run to attribute and its name ("stale", "oracle", or "given" for a ScenarioRun)."""
    if isinstance(source, ScenarioRun):
        if run is not None:
            raise AttributionError("run= chooses between an EditExperiment's stale and oracle runs; a ScenarioRun is already one run")
        return source, "given"
    if isinstance(source, EditExperiment):
        run = run or "stale"
        if run not in RUNS:
            raise AttributionError(f"unknown run {run!r}; choose one of {', '.join(RUNS)}")
        return getattr(source, run), run
    raise AttributionError(f"expected an EditExperiment or a ScenarioRun, got {type(source).__name__}")


# ---------------------------------------------------------------------------- methods
def _ablation_scores(
    score: Callable[[torch.Tensor], torch.Tensor],
    embedding: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    baseline: int,
    tick: Tick,
) -> torch.Tensor:
    """captum FeatureAblation over the tokens at ``positions`` of ``ids`` (T,), grouped by ``mask`` (P,): (P,) scores."""

    def forward(chosen: torch.Tensor) -> torch.Tensor:  # (B, P) token ids -> (B,)
        batch = ids.expand(len(chosen), -1).clone()
        batch[:, positions] = chosen
        tick()
        return score(embedding(batch))

    from captum.attr import (
        FeatureAblation,  # imported on use: captum adds seconds to every CLI start
    )

    with torch.no_grad():
        scores = FeatureAblation(forward).attribute(ids[positions][None], baselines=baseline, feature_mask=mask[None])
    return scores[0].float()


def _gradient_scores(
    score: Callable[[torch.Tensor], torch.Tensor],
    embedding: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    baseline: int,
    steps: int,
    tick: Tick,
) -> torch.Tensor:
    """captum IntegratedGradients on the embeddings at ``positions``, summed over the hidden dim: (P,) scores."""
    with torch.no_grad():
        full = embedding(ids[None])  # (1, T, hidden)
        start = embedding(torch.tensor([baseline], device=ids.device))[None].expand(1, len(positions), -1)

    def forward(chosen: torch.Tensor) -> torch.Tensor:  # (B, P, hidden) -> (B,)
        batch = full.expand(len(chosen), -1, -1).clone()
        batch[:, positions] = chosen.to(batch.dtype)
        tick()
        return score(batch)

    from captum.attr import IntegratedGradients  # imported on use, as above

    with torch.enable_grad():
        attributions = IntegratedGradients(forward).attribute(
            full[:, positions].detach(), baselines=start, n_steps=steps, internal_batch_size=_GRADIENT_BATCH
        )
    return attributions[0].float().sum(-1).detach()


def captum_attribution(
    source: EditExperiment | ScenarioRun,
    *,
    method: str = "ablation",
    granularity: str = "segments",
    run: str | None = None,
    target: str = "margin",
    baseline_id: int | None = None,
    steps: int = 8,
    progress: StepProgress = None,
) -> AttributionResult:
    """Attribute a run's decision (an experiment's stale run by default, or ``run="oracle"``) to context features."""
    watch = Stopwatch()
    if method not in METHODS:
        raise AttributionError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "gradient" and steps < 1:
        raise AttributionError(f"steps must be ≥ 1, got {steps}")
    chosen_run, run_name = _pick_run(source, run)
    lm, prompt = chosen_run.notebook.lm, chosen_run.prompt
    texts = [lm.tokenizer.decode([token]) for token in prompt.context_ids]
    spans = context_features(prompt.context_segments, texts, granularity)
    if not spans:
        raise AttributionError("the context has no non-template tokens to attribute")
    if method == "ablation" and len(spans) > MAX_ABLATION_FEATURES:
        raise AttributionError(
            f"token-level ablation needs one forward per token and this context has {len(spans)} "
            f"(limit {MAX_ABLATION_FEATURES}); use granularity='segments' or method='gradient'"
        )
    baseline = _baseline_id(lm, baseline_id)
    score = decision_target(lm, prompt, target, chosen_run.decision.label)
    embedding = lm.model.get_input_embeddings()
    ids = torch.tensor([*prompt.context_ids, *prompt.decode_ids], device=lm.device)
    positions = torch.tensor([p for start, end, _ in spans for p in range(start, end)], device=lm.device)
    mask = torch.tensor([index for index, (start, end, _) in enumerate(spans) for _ in range(start, end)], device=lm.device)

    tick = ticker(progress, len(spans) + 1 if method == "ablation" else math.ceil(steps / _GRADIENT_BATCH))

    if method == "ablation":
        per_token = _ablation_scores(score, embedding, ids, positions, mask, baseline, tick)
    else:
        per_token = _gradient_scores(score, embedding, ids, positions, baseline, steps, tick)
    with torch.no_grad():
        ablated = ids.clone()
        ablated[positions] = baseline
        full_score, baseline_score = score(embedding(torch.stack([ids, ablated]))).tolist()
    if method == "ablation":
        lengths = torch.tensor([end - start for start, end, _ in spans])
        per_feature = per_token.cpu()[lengths.cumsum(0) - lengths]  # every token of a feature carries its score
    else:
        per_feature = torch.zeros(len(spans)).index_add_(0, mask.cpu(), per_token.cpu())
    features = [
        Feature(start, end, lm.tokenizer.decode(list(prompt.context_ids[start:end])), kind, float(value))
        for (start, end, kind), value in zip(spans, per_feature.tolist(), strict=True)
    ]
    return AttributionResult(
        model=lm.fingerprint.name,
        scenario=chosen_run.scenario.name,
        run=run_name,
        method=method,
        granularity=granularity,
        target=_describe(target, list(prompt.answer_ids), chosen_run.decision.label),
        baseline_token=lm.tokenizer.decode([baseline]),
        full_score=full_score,
        baseline_score=baseline_score,
        features=features,
        ms=watch.ms,
        steps=steps if method == "gradient" else None,
    )
