"""Unified edit + compose agent: compose the policy once, send state changes as errata, reuse the cache.

Each turn one field changes. The cached path appends only an erratum line to the notebook it already holds
(the longest cached prefix) and reads the decision. It is measured against two references:

- **clean state** (correctness, the paper's baseline): a clean prefill of the prompt for the current state,
  every field at its current value and no errata. Agreement with it says whether the cached decision still
  follows the state.
- **identical tokens** (exactness of the cache mechanics): a re-prefill of exactly the tokens the cached
  path holds, errata included. Any difference comes from splicing (and its remedy), never from the errata.

Errata pile up and their effect fades on small models, so a **compaction policy** may fold the current state
into the fields: the context is re-rendered with the current values and recomputed from the first token that
changed (the prefix, spliced skills included, is kept), dropping every erratum — equal to a clean prefill of
the compacted text. Policies: ``never``; ``every:K`` (compact instead of the K-th erratum); ``adaptive[:R]``
(after an erratum, compact when its effect on the margin falls below R × the effect the first erratum had
since the last compaction).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.cache.decision import Decision, logit_agreement
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.splice import splice_prompt
from kvscope.engine.edit.erratum import WORDINGS, erratum_ids
from kvscope.engine.edit.runs import render_for, shared_prefix
from kvscope.engine.jsonable import attributes
from kvscope.engine.progress import StepProgress
from kvscope.engine.scenario import RenderedPrompt, Scenario, ScenarioError
from kvscope.engine.timing import Stopwatch

ADAPTIVE_RATIO = 0.5


@dataclass(frozen=True)
class Compaction:
    """When the cached path folds the current state into its fields (see the module docstring)."""

    kind: str  # "never", "every" or "adaptive"
    every: int = 0
    ratio: float = ADAPTIVE_RATIO

    @classmethod
    def parse(cls, text: str) -> "Compaction":
        """``never``, ``every:K`` (K ≥ 1) or ``adaptive`` / ``adaptive:R`` (0 < R < 1)."""
        match = re.fullmatch(r"(never|every|adaptive)(?::([0-9.]+))?", (text or "").strip())
        if match is None:
            raise ScenarioError(f"unknown compaction policy {text!r}: use never, every:K or adaptive[:R]")
        kind, argument = match.groups()
        if kind == "never" and argument is None:
            return cls("never")
        if kind == "every" and argument and argument.isdigit() and int(argument) >= 1:
            return cls("every", every=int(argument))
        if kind == "adaptive" and (argument is None or 0 < float(argument) < 1):
            return cls("adaptive", ratio=float(argument) if argument else ADAPTIVE_RATIO)
        raise ScenarioError(f"compaction policy {text!r}: every needs a whole K ≥ 1, adaptive a ratio between 0 and 1")

    @property
    def name(self) -> str:
        return {"never": "never", "every": f"every:{self.every}", "adaptive": f"adaptive:{self.ratio:g}"}[self.kind]


@dataclass
class AgentTurn:
    """One turn: the state, the cached path's decision beside both references, and the timings."""

    turn: int
    values: dict[str, str]
    changed: str | None  # the field that changed at this turn (None at turn 0)
    expected: str | None
    cached: Decision
    clean: Decision
    identical: Decision
    clean_agreement: dict[str, float]
    identical_agreement: dict[str, float]
    cached_ms: float
    clean_ms: float
    identical_ms: float
    compacted: bool  # the cached path folded the state into its fields at this turn
    errata: int  # errata in the cached context after this turn

    def as_dict(self) -> dict:
        decision = lambda d: {"decision": d.label, "margin": round(d.margin, 4)}  # noqa: E731
        return {
            **attributes(self, "turn", "values", "changed", "expected"),
            "cached": decision(self.cached),
            "clean_state": decision(self.clean),
            "identical_tokens": decision(self.identical),
            "agrees_with_clean_state": self.cached.label == self.clean.label,
            "agrees_with_identical_tokens": self.cached.label == self.identical.label,
            "cosine_vs_clean_state": round(self.clean_agreement["cosine"], 6),
            "cosine_vs_identical_tokens": round(self.identical_agreement["cosine"], 6),
            **attributes(self, "compacted", "errata"),
            "ttft_ms": {
                "cached": round(self.cached_ms, 1),
                "clean_state": round(self.clean_ms, 1),
                "identical_tokens": round(self.identical_ms, 1),
            },
        }


@dataclass
class AgentReport:
    """A whole episode and its cumulative numbers."""

    scenario: str
    fields: list[str]
    remedy: str
    policy: str
    wording: str
    turns: list[AgentTurn]

    @property
    def clean_agreement(self) -> float:
        """Share of turns where the cached decision equals the clean-state prefill's."""
        return sum(t.cached.label == t.clean.label for t in self.turns) / len(self.turns)

    @property
    def state_sensitive(self) -> bool:
        """Whether the clean-state decision changes over the episode (else agreement says little)."""
        return len({t.clean.label for t in self.turns}) > 1

    def as_dict(self) -> dict:
        cached, clean, identical = (sum(getattr(t, f"{path}_ms") for t in self.turns) for path in ("cached", "clean", "identical"))
        return {
            **attributes(self, "scenario", "fields", "remedy", "policy", "wording", "turns"),
            "state_sensitive": self.state_sensitive,
            "clean_state_agreement": round(self.clean_agreement, 4),
            "identical_tokens_agreement": round(sum(t.cached.label == t.identical.label for t in self.turns) / len(self.turns), 4),
            "margin_error_vs_clean_state": round(sum(abs(t.cached.margin - t.clean.margin) for t in self.turns) / len(self.turns), 4),
            "min_cosine_vs_clean_state": round(min(t.clean_agreement["cosine"] for t in self.turns), 6),
            "min_cosine_vs_identical_tokens": round(min(t.identical_agreement["cosine"] for t in self.turns), 6),
            "compactions": sum(t.compacted for t in self.turns),
            "cumulative_ttft_ms": {"cached": round(cached, 1), "clean_state": round(clean, 1), "identical_tokens": round(identical, 1)},
            "cumulative_speedup_vs_clean_state": round(clean / cached, 2),
        }


def value_schedule(values: tuple[str, ...], turns: int, toggle: bool) -> list[str]:
    """The field's value at turns 0..turns: toggling old/new, or cycling through all values."""
    cycle = values[:2] if toggle else values
    return [cycle[t % len(cycle)] for t in range(turns + 1)]


def state_schedule(scenario: Scenario, fields: Sequence[str], turns: int, toggle: bool) -> list[tuple[dict[str, str], str | None]]:
    """Per turn the state (every field's value) and the field that changed: one field per turn, in turn."""
    chosen = [scenario.field(name) for name in fields]
    state = {field.name: field.values[0] for field in chosen}
    steps = {field.name: 0 for field in chosen}
    schedule = [(dict(state), None)]
    for turn in range(1, turns + 1):
        field = chosen[(turn - 1) % len(chosen)]
        steps[field.name] += 1
        state[field.name] = value_schedule(field.values, steps[field.name], toggle)[-1]
        schedule.append((dict(state), field.name))
    return schedule


def compacted(base: Notebook, base_prompt: RenderedPrompt, prompt: RenderedPrompt) -> tuple[Notebook, int]:
    """The turn-0 notebook with the context re-rendered for ``prompt``'s values: every token from the first one
    that differs recomputed (errata, which the base never held, are gone). Returns it and the tokens computed."""
    old, new = list(base_prompt.context_ids), list(prompt.context_ids)
    shared = shared_prefix(old, new)
    if shared == len(old) == len(new):
        return base, 0
    return base.replace(range(shared, len(old)), new[shared:], list(prompt.context_segments[shared:])), len(new) - shared


def run_agent(
    lm: LoadedModel,
    scenario: Scenario,
    store: SkillStore,
    *,
    turns: int = 12,
    field_name: str | None = None,
    fields: Sequence[str] | None = None,
    toggle: bool = False,
    remedy: Remedy = DEFAULT_REMEDY,
    policy: Compaction | str = "never",
    wording: str = "override",
    progress: StepProgress = None,
) -> AgentReport:
    """Run ``turns`` state changes after turn 0 (one of ``fields`` per turn; default: ``field_name`` or the
    first field) on the cached path under ``policy``; compare it with both references every turn."""
    if turns < 1:
        raise ScenarioError(f"an episode needs at least one turn, got {turns}")
    remedy.require_deployable("an agent episode")
    if wording not in WORDINGS:
        raise ScenarioError(f"unknown erratum wording {wording!r}; choose one of {', '.join(WORDINGS)}")
    policy = policy if isinstance(policy, Compaction) else Compaction.parse(policy)
    names = list(fields) if fields else [scenario.field(field_name).name]
    schedule = state_schedule(scenario, names, turns, toggle)
    template, answers = WORDINGS[wording], scenario.answers

    def clean_read(values: dict[str, str]) -> tuple[Decision, RenderedPrompt]:
        prompt = render_for(lm, scenario, values)
        return Notebook.from_prompt(lm, prompt).read_prompt(prompt, answer_texts=answers), prompt

    base_prompt = render_for(lm, scenario, schedule[0][0])
    if scenario.skills:
        lm.splice_gate.require(lm)  # the self-test runs once, before any turn is timed
    cached = base = None
    prompt, sequence, errata, first_effect, history = base_prompt, [], 0, None, []
    for turn, (values, changed) in enumerate(schedule):
        watch = Stopwatch()
        compact_now = False
        if base is None:
            base = cached = (
                splice_prompt(lm, scenario, base_prompt, store, remedy).notebook
                if scenario.skills
                else Notebook.from_prompt(lm, base_prompt)
            )
            sequence = list(base_prompt.context_ids)
        elif policy.kind == "every" and errata + 1 >= policy.every:
            compact_now = True
        else:
            line = erratum_ids(lm.tokenizer, changed, values[changed], template=template)
            cached, sequence, errata = cached.append(line, "erratum"), sequence + line, errata + 1
        decision = None if compact_now else cached.read_prompt(prompt, answer_texts=answers)
        if decision is not None and policy.kind == "adaptive" and changed is not None:
            effect = abs(decision.margin - history[-1].cached.margin)
            if first_effect is None:
                first_effect = effect
            elif effect < policy.ratio * first_effect:
                compact_now = True
        if compact_now:
            prompt = render_for(lm, scenario, values)
            cached, _ = compacted(base, base_prompt, prompt)
            sequence, errata, first_effect = list(prompt.context_ids), 0, None
            decision = cached.read_prompt(prompt, answer_texts=answers)
        cached_ms = watch.ms
        watch = Stopwatch()
        clean, _ = clean_read(values)
        clean_ms = watch.ms
        watch = Stopwatch()
        identical = Notebook.prefill(lm, sequence).read_prompt(prompt, answer_texts=answers)
        identical_ms = watch.ms
        expected = scenario.expect.get(values[names[0]]) if len(names) == 1 else None
        history.append(
            AgentTurn(
                turn,
                dict(values),
                changed,
                expected,
                decision,
                clean,
                identical,
                logit_agreement(decision.next_token_logits, clean.next_token_logits),
                logit_agreement(decision.next_token_logits, identical.next_token_logits),
                cached_ms,
                clean_ms,
                identical_ms,
                compact_now,
                errata,
            )
        )
        if progress:
            progress(turn + 1, len(schedule))
    return AgentReport(scenario.name, names, remedy.name, policy.name, wording, history)
