"""The edit that stays exact on a hybrid (recurrent layers beside attention), on its append-only context.

No entry of a hybrid's cache can be rewritten (``kvscope.engine.cache.recurrent``), so the one exact repair is the one that
only appends — the erratum — judged against references read the same way: :func:`hybrid_edit` reads
the stale context, the oracle (a clean prefill with the new value) and the stale context with the erratum
appended, and reports every strategy that rewrites entries as refused with the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvscope.engine.cache.decision import Decision, Recovery, recovery
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.recurrent import RecurrentContext
from kvscope.engine.edit.erratum import DEFAULT_ERRATUM, erratum_ids
from kvscope.engine.edit.report import HybridEditReport
from kvscope.engine.edit.runs import render_for, run_summary
from kvscope.engine.edit.strategies import STRATEGIES, StrategyResult
from kvscope.engine.scenario import RenderedPrompt, Scenario, ScenarioError
from kvscope.engine.timing import Stopwatch


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
    watch = Stopwatch()
    prompt = render_for(lm, scenario, values)
    context = RecurrentContext.prefill(lm, prompt.context_ids, prompt.context_segments)
    decision = context.read_prompt(prompt, scenario.answers)
    return RecurrentRun(scenario, prompt, context, decision, watch.ms)


def _in_place_reason(lm: LoadedModel) -> str:
    layers = lm.recurrent_layers
    return (
        f"{type(lm.model).__name__} is a hybrid: layers {layers} keep a recurrent state that sums up every earlier token, "
        "so an entry cannot be rewritten or hidden in place; only appending (erratum) is exact on it"
    )


def hybrid_edit(
    lm: LoadedModel,
    scenario: Scenario,
    field_name: str | None = None,
    new: str | None = None,
    names: Sequence[str] = STRATEGIES,
    erratum: str = DEFAULT_ERRATUM,
) -> HybridEditReport:
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
            watch = Stopwatch()
            line = erratum_ids(lm.tokenizer, chosen.name, value, chosen.old, erratum)
            decision = stale.context.append(line, "erratum").read_prompt(stale.prompt, scenario.answers)
            strategies[name] = StrategyResult(
                name,
                True,
                decision,
                recovery(decision.margin, stale.decision.margin, oracle.decision.margin),
                tokens_recomputed=len(line),
                ms=watch.ms,
            )
    return HybridEditReport(
        model=lm.fingerprint.name,
        scenario=scenario.name,
        field=chosen.name,
        old=chosen.old,
        new=value,
        stale_tokens=len(stale.context),
        stale=references["stale"],
        oracle=references["oracle"],
        strategies=strategies,
    )
