"""Hybrids with recurrent layers (Mamba, gated DeltaNet beside attention): the exact, append-only path.

A recurrent layer keeps one running state that sums up every earlier token, not one entry per token, so no entry
of a hybrid's cache can be replaced, hidden, patched or moved (the notebook refuses hybrids, naming the layers).
What stays exact is what a left-to-right run computes: a prefill (in chunks or at once), appending, and reading a
decision. :class:`RecurrentContext` is that append-only context, on the model's own cache. It is enough for the
repair that only appends — the erratum — and for the references it is judged against: :func:`hybrid_edit` reads
the stale context, the oracle (a clean prefill with the new value) and the stale context with the erratum
appended, and reports every strategy that rewrites entries as refused with the reason.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from engine.adapter import recurrent_cache, recurrent_forward, recurrent_layers
from engine.budget import compute_slot, forward_token_limit
from engine.decision import Decision, Recovery, answer_logprob, decide, recovery
from engine.errors import NotebookError
from engine.experiment import edit_summary
from engine.loaded import LoadedModel
from engine.runs import render_for, run_summary
from engine.scenario import RenderedPrompt, Scenario, ScenarioError
from engine.strategies import DEFAULT_ERRATUM, STRATEGIES, StrategyResult


@dataclass(frozen=True)
class RecurrentContext:
    """A hybrid's context as its own cache holds it: tokens in order and the state after them (never mutated)."""

    lm: LoadedModel
    token_ids: tuple[int, ...]
    segments: tuple[str, ...]
    cache: DynamicCache

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def prefill(cls, lm: LoadedModel, token_ids: Sequence[int], segments: Sequence[str] | str = "context",
                chunk_size: int | None = None) -> "RecurrentContext":
        """Run the tokens left to right, ``chunk_size`` (default: the forward limit) at a time."""
        if not recurrent_layers(lm.model):
            raise NotebookError(f"{lm.name} has no recurrent layers: use the notebook (engine.notebook), which can also edit")
        empty = cls(lm, (), (), recurrent_cache(lm.model))
        return empty.append(token_ids, segments, chunk_size) if len(token_ids) else empty

    def append(self, token_ids: Sequence[int], segments: Sequence[str] | str = "context", chunk_size: int | None = None) -> "RecurrentContext":
        """This context with tokens run after it (e.g. an erratum line); one label or one per token."""
        labels = [segments] * len(token_ids) if isinstance(segments, str) else list(segments)
        if not token_ids or len(labels) != len(token_ids):
            raise NotebookError(f"append needs tokens and one label each (got {len(token_ids)} tokens, {len(labels)} labels)")
        cache, step = copy.deepcopy(self.cache), chunk_size or forward_token_limit()
        for begin in range(0, len(token_ids), step):
            chunk = list(token_ids)[begin : begin + step]
            self._advance(cache, chunk, len(self) + begin)
        return RecurrentContext(self.lm, self.token_ids + tuple(token_ids), self.segments + tuple(labels), cache)

    def _advance(self, cache: DynamicCache, token_ids: Sequence[int], start: int) -> torch.Tensor:
        with compute_slot(start + len(token_ids)):
            return recurrent_forward(self.lm.model, cache, torch.tensor(list(token_ids), dtype=torch.long, device=self.lm.device), start)

    def read(self, decode_ids: Sequence[int], answers: Mapping[str, Sequence[Sequence[int]]],
             answer_texts: Mapping[str, Sequence[str]] | None = None) -> Decision:
        """Score each answer's tokens after ``decode_ids``: the question runs once, each multi-token answer on a copy
        of the state after it; the context itself is not changed."""
        if not decode_ids:
            raise NotebookError("a decision needs decode tokens (the question); got none")
        after_question = copy.deepcopy(self.cache)
        question_logits = self._advance(after_question, decode_ids, len(self))
        start = len(self) + len(decode_ids)
        texts = answer_texts or {label: [str(i) for i in range(len(seqs))] for label, seqs in answers.items()}
        string_logprobs: dict[str, dict[str, float]] = {}
        for label, sequences in answers.items():
            string_logprobs[label] = {}
            for text, answer in zip(texts[label], sequences):
                logits = question_logits[-1:]
                if len(answer) > 1:
                    logits = torch.cat([logits, self._advance(copy.deepcopy(after_question), answer[:-1], start)])
                string_logprobs[label][text] = float(answer_logprob(logits, range(len(answer)), answer))
        return decide(string_logprobs, question_logits[-1].detach().cpu().clone())

    def read_prompt(self, prompt: RenderedPrompt, answer_texts: Mapping[str, Sequence[str]] | None = None) -> Decision:
        """Read the decision for a rendered scenario's question and answers."""
        return self.read(prompt.decode_ids, prompt.answer_ids, answer_texts=answer_texts)


@dataclass(frozen=True)
class RecurrentRun:
    """A scenario prefilled on a hybrid with given field values, and the decision it leads to."""

    scenario: Scenario
    prompt: RenderedPrompt
    context: RecurrentContext
    decision: Decision
    ms: float

    def as_dict(self) -> dict:
        return run_summary(self.scenario, self.prompt, self.decision)


def read_scenario(lm: LoadedModel, scenario: Scenario, values: Mapping[str, str] | None = None) -> RecurrentRun:
    """Render the scenario with ``values``, prefill it on the hybrid's own cache and read the decision."""
    started = time.perf_counter()
    prompt = render_for(lm, scenario, values)
    context = RecurrentContext.prefill(lm, prompt.context_ids, prompt.context_segments)
    decision = context.read_prompt(prompt, scenario.answers)
    return RecurrentRun(scenario, prompt, context, decision, (time.perf_counter() - started) * 1000)


def _in_place_reason(lm: LoadedModel) -> str:
    layers = recurrent_layers(lm.model)
    return (f"{type(lm.model).__name__} is a hybrid: layers {layers} keep a recurrent state that sums up every earlier token, "
            "so an entry cannot be rewritten or hidden in place; only appending (erratum) is exact on it")


@dataclass
class HybridEditReport:
    """A field change on a hybrid: stale, oracle and the erratum read exactly; in-place strategies refused."""

    model: str
    scenario: str
    field: str
    old: str
    new: str
    context_tokens: int
    stale: StrategyResult
    oracle: StrategyResult
    strategies: dict[str, StrategyResult]

    def as_dict(self) -> dict:
        return edit_summary(self, self.context_tokens) | {"hybrid": True}


def hybrid_edit(lm: LoadedModel, scenario: Scenario, field_name: str | None = None, new: str | None = None,
                names: Sequence[str] = STRATEGIES, erratum: str = DEFAULT_ERRATUM) -> HybridEditReport:
    """Change a field old → new on a hybrid: the erratum against stale and oracle; other strategies refused by name."""
    chosen = scenario.field(field_name)
    value = chosen.new if new is None else new
    if not value or "{" in value or "}" in value:
        raise ScenarioError(f"new value for field {chosen.name!r} must be non-empty and contain no braces, got {value!r}")

    stale, oracle = read_scenario(lm, scenario, {chosen.name: chosen.old}), read_scenario(lm, scenario, {chosen.name: value})
    references = {
        "stale": StrategyResult("stale", True, stale.decision, Recovery(0.0), tokens_recomputed=len(stale.context), ms=stale.ms),
        "oracle": StrategyResult("oracle", True, oracle.decision, Recovery(1.0), tokens_recomputed=len(oracle.context), ms=oracle.ms),
    }
    strategies: dict[str, StrategyResult] = {}
    reason = _in_place_reason(lm)
    for name in names:
        if name in references:
            strategies[name] = references[name]
        elif name != "erratum":
            strategies[name] = StrategyResult(name, applicable=False, reason=reason)
        else:
            started = time.perf_counter()
            line = lm.tokenizer(erratum.format(field=chosen.name, new=value, old=chosen.old) + "\n\n", add_special_tokens=False).input_ids
            decision = stale.context.append(line, "erratum").read_prompt(stale.prompt, scenario.answers)
            strategies[name] = StrategyResult(name, True, decision, recovery(decision.margin, stale.decision.margin, oracle.decision.margin),
                                              tokens_recomputed=len(line), ms=(time.perf_counter() - started) * 1000)
    return HybridEditReport(
        model=lm.fingerprint.name, scenario=scenario.name, field=chosen.name, old=chosen.old, new=value, context_tokens=len(stale.context),
        stale=references["stale"],
        oracle=references["oracle"],
        strategies=strategies,
    )
