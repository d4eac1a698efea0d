"""Unified edit + compose agent: compose the policy once, send state changes as errata, reuse the cache.

Every turn the cached path appends only the new erratum line to the notebook it already has (the longest
cached prefix) and reads the decision; the reference path re-prefills the whole token sequence. Both see
identical tokens, so any difference comes from splicing (seam) and never from the errata themselves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.compose import splice_prompt
from engine.decision import Decision, logit_agreement
from engine.loaded import LoadedModel
from engine.notebook import Notebook
from engine.progress import StepProgress
from engine.runs import render_for
from engine.scenario import Scenario, ScenarioError
from engine.strategies import DEFAULT_ERRATUM


@dataclass
class AgentTurn:
    """One turn: the field's value, both paths' decisions, their agreement and timings."""

    turn: int
    value: str
    expected: str | None
    cached: Decision
    full: Decision
    agreement: dict[str, float]
    cached_ms: float
    full_ms: float

    def as_dict(self) -> dict:
        return {
            "turn": self.turn,
            "value": self.value,
            "expected": self.expected,
            "cached": {"decision": self.cached.label, "margin": round(self.cached.margin, 4)},
            "full": {"decision": self.full.label, "margin": round(self.full.margin, 4)},
            "decision_agree": self.cached.label == self.full.label,
            **{key: round(value, 6) for key, value in self.agreement.items()},
            "ttft_ms": {"cached": round(self.cached_ms, 1), "full": round(self.full_ms, 1)},
        }


@dataclass
class AgentReport:
    """A whole episode and its cumulative numbers."""

    scenario: str
    field: str
    seam: int
    turns: list[AgentTurn]

    def as_dict(self) -> dict:
        cached = sum(t.cached_ms for t in self.turns)
        full = sum(t.full_ms for t in self.turns)
        return {
            "scenario": self.scenario,
            "field": self.field,
            "seam": self.seam,
            "turns": [t.as_dict() for t in self.turns],
            "decision_agreement": round(sum(t.cached.label == t.full.label for t in self.turns) / len(self.turns), 4),
            "min_cosine": round(min(t.agreement["cosine"] for t in self.turns), 6),
            "cumulative_ttft_ms": {"cached": round(cached, 1), "full": round(full, 1)},
            "cumulative_speedup": round(full / cached, 2),
        }


def value_schedule(values: tuple[str, ...], turns: int, toggle: bool) -> list[str]:
    """The field's value at turns 0..turns: toggling old/new, or cycling through all values."""
    cycle = values[:2] if toggle else values
    return [cycle[t % len(cycle)] for t in range(turns + 1)]


def run_agent(
    lm: LoadedModel,
    scenario: Scenario,
    store,
    *,
    turns: int = 12,
    field_name: str | None = None,
    toggle: bool = False,
    seam: int = 1,
    erratum: str = DEFAULT_ERRATUM,
    progress: StepProgress = None,
) -> AgentReport:
    """Run ``turns`` state changes after turn 0; compare the cached notebook with re-prefilling each turn."""
    if turns < 1:
        raise ScenarioError(f"an episode needs at least one turn, got {turns}")
    field = scenario.field(field_name)
    schedule = value_schedule(field.values, turns, toggle)
    prompt = render_for(lm, scenario, {field.name: schedule[0]})
    answers = scenario.answers

    def compose() -> Notebook:
        return splice_prompt(lm, scenario, prompt, store, seam=seam) if scenario.skills else Notebook.from_prompt(lm, prompt)

    sequence = list(prompt.context_ids)
    cached, history = None, []
    for turn, value in enumerate(schedule):
        started = time.perf_counter()
        if cached is None:
            cached = compose()
        else:
            line = lm.tokenizer(erratum.format(field=field.name, new=value, old=schedule[turn - 1]) + "\n\n", add_special_tokens=False).input_ids
            cached = cached.append(line, "erratum")
            sequence += line
        cached_decision = cached.read_prompt(prompt, answer_texts=answers)
        cached_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        full_decision = Notebook.prefill(lm, sequence).read_prompt(prompt, answer_texts=answers)
        full_ms = (time.perf_counter() - started) * 1000
        history.append(
            AgentTurn(turn, value, scenario.expect.get(value), cached_decision, full_decision,
                      logit_agreement(cached_decision.next_token_logits, full_decision.next_token_logits), cached_ms, full_ms)
        )
        if progress:
            progress(turn + 1, len(schedule))
    return AgentReport(scenario.name, field.name, seam, history)
