"""Scenario runs: render a scenario with field values, prefill its notebook, read its decision."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine.decision import Decision
from engine.models import LoadedModel
from engine.notebook import Notebook
from engine.scenario import RenderedPrompt, Scenario, render


@dataclass(frozen=True)
class ScenarioRun:
    """One scenario prefilled with given field values, and the decision it leads to."""

    scenario: Scenario
    prompt: RenderedPrompt
    notebook: Notebook
    decision: Decision

    @property
    def expected(self) -> dict[str, str]:
        """Field -> label the scenario expects for the value used, where it says."""
        return {name: self.scenario.expect[value] for name, value in self.prompt.values.items() if value in self.scenario.expect}

    def as_dict(self) -> dict:
        """JSON-ready summary: values, token count, scores, margin, label, expectation."""
        return {
            "scenario": self.scenario.name,
            "values": dict(self.prompt.values),
            "context_tokens": len(self.prompt.context_ids),
            **self.decision.as_dict(),
            "expected": self.expected or None,
        }


def run_scenario(
    lm: LoadedModel,
    scenario: Scenario,
    values: Mapping[str, str] | None = None,
    build: Callable[[RenderedPrompt], Notebook] | None = None,
    **read_options,
) -> ScenarioRun:
    """Build the scenario's context with ``values`` (others at their old value) and read the decision.

    ``build`` makes the notebook from the rendered prompt (default: a clean prefill; e.g. splicing skills).
    """
    prompt = render(scenario, lm.tokenizer, scenario.values_with(**dict(values or {})), max_tokens=lm.model.config.max_position_embeddings)
    notebook = build(prompt) if build else Notebook.from_prompt(lm, prompt)
    decision = notebook.read_prompt(prompt, answer_texts=scenario.answers, **read_options)
    return ScenarioRun(scenario, prompt, notebook, decision)
