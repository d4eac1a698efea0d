"""The cost–quality frontier of one edit: decision recovery against the fraction of context tokens computed.

The paper's frontier (Qwen3-8B): CacheBlend-style selection reaches P(correct) 0.13 at 14.5% recomputed,
field + erratum 1.00 at 12.6%. Here, on the loaded model and the user's own edit:

| method | tokens computed |
|---|---|
| ``field_topk`` × K, causal ranking (attribution patching on the field-edited cache) | field + K |
| ``field_topk`` × K, deviation ranking (‖ΔK/V‖ against the oracle, CacheBlend-style) | field + K |
| ``field_only``, ``erratum``, ``field_erratum``, ``restate``, ``full_downstream`` | as in ``kvscope.engine.edit.strategies`` |

K runs 1, 2, 4, … up to every downstream token. The named strategies and the oracle are read in one fused
forward, every top-K fork of both rankings in one more (plus one backward for the causal ranking).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvscope.engine.cache.decision import Decision
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.report import NotesShare
from kvscope.engine.edit.strategies import RANKINGS, NotApplicable
from kvscope.engine.jsonable import attributes, rounded
from kvscope.engine.probes.common import Gap, k_ladder, probe_json
from kvscope.engine.progress import StepProgress
from kvscope.engine.timing import Stopwatch
from kvscope.engine.words import counted

FRONTIER_STRATEGIES = ("field_only", "erratum", "field_erratum", "restate", "full_downstream")


@dataclass(frozen=True)
class FrontierPoint:
    """One cache state on the frontier: its cost and how much of the decision it recovers."""

    method: str  # a strategy name, or "field_topk (causal)" / "field_topk (deviation)"
    k: int | None  # top-K (field_topk only)
    tokens_computed: int
    fraction: float  # tokens_computed / context tokens
    margin: float
    label: str
    recovery: float | None
    correct: bool  # the decision equals the oracle's

    def as_dict(self) -> dict:
        return {
            **attributes(self, "method", "k", "tokens_computed"),
            "fraction": round(self.fraction, 4),
            "margin": round(self.margin, 4),
            "decision": self.label,
            "recovery": rounded(self.recovery),
            "correct": self.correct,
        }


@dataclass
class FrontierResult:
    """Every frontier point of one edit, with the stale/oracle gap and the notes share."""

    gap: Gap
    context_tokens: int
    points: list[FrontierPoint]
    notes: NotesShare
    not_applicable: dict[str, str] = field(default_factory=dict)
    ms: float = 0.0

    def methods(self) -> list[str]:
        """Method names in the order their points were added."""
        return list(dict.fromkeys(point.method for point in self.points))

    def cheapest_correct(self) -> FrontierPoint | None:
        """The point with the fewest computed tokens whose decision equals the oracle's."""
        correct = [point for point in self.points if point.correct]
        return min(correct, key=lambda point: point.tokens_computed) if correct else None

    def headline(self) -> str:
        """What the frontier found, in one sentence: the cheapest cache that reaches the new-value decision."""
        cheapest = self.cheapest_correct()
        if cheapest is None:
            return f"No cache on the frontier reaches {self.gap.oracle_label} ({self.gap.words()})."
        recovered = "" if cheapest.recovery is None else f", recovery {cheapest.recovery:.2f}"
        return (
            f"The cheapest cache that reaches {cheapest.label} is {cheapest.method}"
            + ("" if cheapest.k is None else f" with K={cheapest.k}")
            + f": {counted(cheapest.tokens_computed, 'token')} computed, {cheapest.fraction:.0%} of the context{recovered}."
        )

    def as_dict(self) -> dict:
        cheapest = self.cheapest_correct()
        return probe_json(
            self,
            {
                **attributes(self, "context_tokens", "notes"),
                "cheapest_correct": None if cheapest is None else cheapest.as_dict(),
                **attributes(self, "points", "not_applicable"),
                "ms": round(self.ms, 1),
            },
        )


def _point(method: str, k: int | None, tokens: int, decision: Decision, gap: Gap, context_tokens: int) -> FrontierPoint:
    return FrontierPoint(
        method,
        k,
        tokens,
        tokens / context_tokens,
        decision.margin,
        decision.label,
        gap.recovery(decision.margin),
        decision.label == gap.oracle_label,
    )


def _topk_points(experiment: EditExperiment, ks: Sequence[int] | None, gap: Gap, context_tokens: int) -> list[FrontierPoint]:
    """field_topk for every K under both rankings, read in one fused forward."""
    if not experiment.downstream_positions:
        raise NotApplicable(f"no context tokens follow field {experiment.field!r}: there is nothing to rank")
    edited = experiment.field_edited()
    ladder = k_ladder(ks, len(experiment.downstream_positions))
    forks: list[tuple[str, int, Notebook]] = []
    for ranking in RANKINGS:
        effects = experiment.downstream_effects(edited, ranking)
        forks += [(f"field_topk ({ranking})", k, edited.recompute(experiment.top_downstream(effects, k))) for k in ladder]
    prompt = experiment.prompt
    decisions = Notebook.read_many(
        [notebook for *_, notebook in forks], prompt.decode_ids, prompt.answer_ids, answer_texts=experiment.scenario.answers
    )
    field_tokens = len(experiment.field_positions)
    return [_point(method, k, field_tokens + k, decision, gap, context_tokens) for (method, k, _), decision in zip(forks, decisions)]


def probe_frontier(experiment: EditExperiment, *, progress: StepProgress = None, ks: Sequence[int] | None = None) -> FrontierResult:
    """Recovery against computed tokens for field_topk over K (both rankings) and the named strategies."""
    watch = Stopwatch()
    experiment.read_together(FRONTIER_STRATEGIES)
    gap, context_tokens = Gap.of(experiment), len(experiment.prompt.context_ids)
    points, skipped = [], {}
    for name in FRONTIER_STRATEGIES:
        result = experiment.run(name)
        if result.applicable:
            points.append(_point(name, None, result.tokens_recomputed, result.decision, gap, context_tokens))
        else:
            skipped[name] = result.reason
    if progress:
        progress(1, 3)
    try:
        points += _topk_points(experiment, ks, gap, context_tokens)
    except NotApplicable as reason:
        skipped["field_topk"] = str(reason)
    if progress:
        progress(2, 3)
    notes = experiment.notes_share(downstream_patch=True)
    if progress:
        progress(3, 3)
    return FrontierResult(gap, context_tokens, points, notes, skipped, watch.ms)
