"""Scenario runs: render a scenario with field values, prefill its notebook, read its decision."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from kvscope.engine.cache.decision import Decision
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.cache.patching import DecisionGradients, decision_gradients
from kvscope.engine.scenario import RenderedPrompt, Scenario, render
from kvscope.engine.timing import Stopwatch


@dataclass(frozen=True)
class ScenarioRun:
    """One scenario prefilled with given field values, and the decision it leads to."""

    scenario: Scenario
    prompt: RenderedPrompt
    notebook: Notebook
    decision: Decision
    clean: bool = True  # the notebook holds a clean prefill's K/V (so its prefix can be reused)
    computed_tokens: int = 0  # context tokens computed to build it (fewer than the context on a prefix hit)
    ms: float = 0.0  # wall time to build the notebook and read the decision

    @cached_property
    def gradients(self) -> DecisionGradients:
        """∂margin/∂K/V of this run's notebook (computed once, for attribution against any donor)."""
        return decision_gradients(self.notebook, self.prompt)

    @property
    def expected(self) -> dict[str, str]:
        """Field -> label the scenario expects for the value used, where it says."""
        return expected_labels(self.scenario, self.prompt)

    def as_dict(self) -> dict:
        """JSON-ready summary: values, token count, scores, margin, label, expectation."""
        return run_summary(self.scenario, self.prompt, self.decision)


def expected_labels(scenario: Scenario, prompt: RenderedPrompt) -> dict[str, str]:
    """Field -> label the scenario expects for the value the prompt uses, where it says."""
    return {name: scenario.expect[value] for name, value in prompt.values.items() if value in scenario.expect}


def run_summary(scenario: Scenario, prompt: RenderedPrompt, decision: Decision) -> dict:
    """JSON-ready summary of one run: values, token count, scores, margin, label, expectation."""
    return {
        "scenario": scenario.name,
        "values": dict(prompt.values),
        "context_tokens": len(prompt.context_ids),
        **decision.as_dict(),
        "expected": expected_labels(scenario, prompt) or None,
    }


@dataclass(frozen=True)
class PreparedRun:
    """A scenario's rendered prompt and its notebook, K/V possibly still pending (read it to finish)."""

    scenario: Scenario
    prompt: RenderedPrompt
    notebook: Notebook
    clean: bool
    computed_tokens: int

    def finish(self, decision: Decision, ms: float) -> ScenarioRun:
        """The run once its decision has been read."""
        return ScenarioRun(self.scenario, self.prompt, self.notebook, decision, self.clean, self.computed_tokens, ms)


def render_for(lm: LoadedModel, scenario: Scenario, values: Mapping[str, str] | None = None) -> RenderedPrompt:
    """The scenario rendered with this model's tokenizer, ``values`` over the old ones, refused past the
    model's context window."""
    return render(
        scenario,
        lm.tokenizer,
        scenario.values_with(**dict(values or {})),
        max_tokens=lm.model.config.get_text_config().max_position_embeddings,
    )


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two id sequences share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def prepare_scenario(
    lm: LoadedModel,
    scenario: Scenario,
    values: Mapping[str, str] | None = None,
    build: Callable[[RenderedPrompt], Notebook] | None = None,
    reuse: ScenarioRun | None = None,
) -> PreparedRun:
    """Render the scenario with ``values`` (others at their old value) and plan its notebook.

    ``build`` makes the notebook from the rendered prompt (e.g. splicing skills); otherwise it is a clean
    prefill, and with ``reuse`` (a clean run of the same model) only the tokens after the prefix both
    contexts share are computed: a prefix-cache hit, identical to a clean prefill.
    """
    prompt = render_for(lm, scenario, values)
    ids = list(prompt.context_ids)
    if build is not None:
        return PreparedRun(scenario, prompt, build(prompt), False, len(ids))
    if reuse is not None and reuse.clean and reuse.notebook.lm is lm:
        cached = list(reuse.prompt.context_ids)
        shared = shared_prefix(cached, ids)
        if shared == len(cached) == len(ids):
            return PreparedRun(scenario, prompt, reuse.notebook, True, 0)
        if 0 < shared < len(ids):
            tail, labels = ids[shared:], list(prompt.context_segments[shared:])
            if shared == len(cached):
                notebook = reuse.notebook.append(tail, labels)
            else:
                notebook = reuse.notebook.replace(range(shared, len(cached)), tail, labels)
            return PreparedRun(scenario, prompt, notebook, True, len(tail))
    return PreparedRun(scenario, prompt, Notebook.from_prompt(lm, prompt), True, len(ids))


def run_scenario(
    lm: LoadedModel,
    scenario: Scenario,
    values: Mapping[str, str] | None = None,
    build: Callable[[RenderedPrompt], Notebook] | None = None,
    reuse: ScenarioRun | None = None,
    **read_options,
) -> ScenarioRun:
    """Build the scenario's context with ``values`` and read the decision (see :func:`prepare_scenario`)."""
    watch = Stopwatch()
    prepared = prepare_scenario(lm, scenario, values, build, reuse)
    decision = prepared.notebook.read_prompt(prepared.prompt, answer_texts=scenario.answers, **read_options)
    return prepared.finish(decision, watch.ms)
