"""Weight editing beside cache editing: ROME and LoRA against the erratum, on one field change.

Each weight method makes the model give the *new-value* decision for the scenario's *old-value* context:

- **LoRA** (``peft``): a rank-r adapter trained on the old-value context (:mod:`kvscope.engine.edit.lora`).
- **ROME-style** rank-one update of one MLP down-projection (:mod:`kvscope.engine.edit.rome`).

The model is shared, so no method writes into it: an edit runs on a *private copy* of the touched modules
(the module tree is copied along the path to each touched module; every other parameter is shared, read-only),
so an edit that fails half-way leaves nothing behind. :func:`compare_edits` measures, in one run, each method's
efficacy (recovery on the edited request), contamination (other requests that carry the old value — the same
case for other customers — now decided the new way), collateral (other bundled scenarios whose decision or
margin moves), latency and memory; ``field_erratum`` is measured the same way (its erratum lives only in the
edited request's cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvscope.engine.cache.adapter import cache_entry_shapes
from kvscope.engine.cache.decision import recovery
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.lora import LoraSettings, lora_edit
from kvscope.engine.edit.rome import RomeSettings, rome_edit
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.edit.weight_update import WeightEditError, edit_direction
from kvscope.engine.jsonable import JsonFields, rounded
from kvscope.engine.progress import StepProgress
from kvscope.engine.scenario import Scenario

METHODS: tuple[str, ...] = ("rome", "lora", "field_erratum")
# Other customers of the same case: the contamination probes prefix the context with one of these lines.
CASE_LINES: tuple[str, ...] = (
    "Case reference: C-2291 (account of Maria Lopez)",
    "Case reference: C-4410 (account of Kenji Sato)",
    "Case reference: C-7813 (account of Amara Okafor)",
)


@dataclass(frozen=True)
class MethodOutcome(JsonFields):
    """One method on one edit: efficacy, contamination, collateral, cost."""

    efficacy: float | None
    decision: str
    contamination: float
    contaminated: list[str]
    collateral: float
    collateral_mean_abs_delta: float
    edit_ms: float
    setup_ms: float
    memory_bytes: int
    details: dict


@dataclass(frozen=True)
class WeightEditReport(JsonFields):
    """Every method on one field change of one scenario, measured in one run."""

    model: str
    scenario: str
    field: str
    old: str
    new: str
    stale: dict
    oracle: dict
    probes: dict
    methods: dict[str, MethodOutcome]


def case_variants(scenario: Scenario) -> list[Scenario]:
    """The same case for other customers: the context prefixed by another case line (old values kept)."""
    return [replace(scenario, name=f"{scenario.name} ({line})", context=f"{line}\n{scenario.context}") for line in CASE_LINES]


def _reads(lm: LoadedModel, scenarios: Sequence[Scenario]) -> list[tuple[str, float]]:
    """(label, margin) of each scenario at its old values."""
    return [(run.decision.label, run.decision.margin) for run in (run_scenario(lm, s) for s in scenarios)]


def _measure(
    experiment: EditExperiment,
    lm: LoadedModel,
    variants: Sequence[Scenario],
    others: Sequence[Scenario],
    baseline_variants: list,
    baseline_others: list,
) -> dict:
    """Efficacy, contamination and collateral of reading with ``lm`` (the shared model for the erratum)."""
    state = run_scenario(lm, experiment.scenario).decision if lm is not experiment.lm else None
    edited = _reads(lm, variants)
    new_label = experiment.oracle.decision.label
    contaminated = [v.name for v, (label, _), (before, _) in zip(variants, edited, baseline_variants) if label == new_label != before]
    after = _reads(lm, others)
    changed = [o.name for o, (label, _), (before, _) in zip(others, after, baseline_others) if label != before]
    deltas = [abs(margin - before) for (_, margin), (_, before) in zip(after, baseline_others)]
    return {
        "state": state,
        "contamination": len(contaminated) / max(len(variants), 1),
        "contaminated": contaminated,
        "collateral": len(changed) / max(len(others), 1),
        "collateral_mean_abs_delta": sum(deltas) / max(len(deltas), 1),
        "collateral_changed": changed,
    }


def compare_edits(
    lm: LoadedModel,
    scenario: Scenario,
    others: Sequence[Scenario],
    field_name: str | None = None,
    new: str | None = None,
    methods: Sequence[str] = METHODS,
    lora: LoraSettings = LoraSettings(),
    rome: RomeSettings = RomeSettings(),
    progress: StepProgress = None,
) -> WeightEditReport:
    """Edit one field's decision with each method and measure all of them the same way (module docstring).
    ``others`` are unrelated scenarios for collateral (the edited one is left out by name)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise WeightEditError(f"unknown method {unknown[0] if unknown else '(none)'!r}; choose from: {', '.join(METHODS)}")
    experiment = EditExperiment(lm, scenario, field_name, new)
    edit_direction(experiment)
    others = [o for o in others if o.name != scenario.name]
    variants = case_variants(scenario)
    baseline_variants, baseline_others = _reads(lm, variants), _reads(lm, others)
    outcomes: dict[str, MethodOutcome] = {}
    stale, oracle = experiment.stale.decision.margin, experiment.oracle.decision.margin
    for method in methods:
        if method == "field_erratum":
            result = experiment.run("field_erratum")
            measured = _measure(experiment, lm, variants, others, baseline_variants, baseline_others)
            entry = (
                sum(h * d for h, d in cache_entry_shapes(lm.model.config))
                * lm.dtype.itemsize
                * lm.model.config.get_text_config().num_hidden_layers
            )
            efficacy = result.recovery.value if result.recovery else None
            label = result.decision.label if result.decision else experiment.stale.decision.label
            cost = {
                "edit_ms": round(result.ms, 1),
                "setup_ms": 0.0,
                "memory_bytes": result.tokens_recomputed * entry,
                "details": {"tokens_computed": result.tokens_recomputed},
            }
        else:
            edit = (rome_edit if method == "rome" else lora_edit)(lm, experiment, rome if method == "rome" else lora, progress)
            measured = _measure(experiment, edit.lm, variants, others, baseline_variants, baseline_others)
            efficacy = recovery(measured["state"].margin, stale, oracle).value
            label = measured["state"].label
            cost = {"edit_ms": edit.edit_ms, "setup_ms": edit.setup_ms, "memory_bytes": edit.memory_bytes, "details": edit.details}
        details = {**cost.pop("details"), "collateral_changed": measured["collateral_changed"]}
        outcomes[method] = MethodOutcome(
            efficacy=rounded(efficacy),
            decision=label,
            contamination=measured["contamination"],
            contaminated=measured["contaminated"],
            collateral=round(measured["collateral"], 4),
            collateral_mean_abs_delta=round(measured["collateral_mean_abs_delta"], 4),
            details=details,
            **cost,
        )
    return WeightEditReport(
        model=lm.fingerprint.name,
        scenario=scenario.name,
        field=experiment.field,
        old=experiment.old,
        new=experiment.new,
        stale={"decision": experiment.stale.decision.label, "margin": round(stale, 4)},
        oracle={"decision": experiment.oracle.decision.label, "margin": round(oracle, 4)},
        probes={
            "variants": [v.name for v in variants],
            "variants_before": [label for label, _ in baseline_variants],
            "others": [o.name for o in others],
        },
        methods=outcomes,
    )
