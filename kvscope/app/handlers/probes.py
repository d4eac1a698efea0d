"""The Probes tab's handlers: one probe on the Notes tab's edit (and its recipe), and weight editing beside the erratum."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from kvscope.app.handlers.common import AppError, AppMissingInput, guarded, number, parse_scenario
from kvscope.app.handlers.notes import experiment
from kvscope.app.state import ModelRegistry
from kvscope.engine import (
    PROBES,
    EditSettings,
    LoraSettings,
    Recipe,
    RomeSettings,
    Scenario,
    StepProgress,
    bundled_scenarios,
    compare_edits,
    dtype_name,
    recipe_settings,
)
from kvscope.viz.common import markdown_literal
from kvscope.viz.probes import probe_figure
from kvscope.viz.weights import trade_off_markdown, weight_edit_figure

TRIGGER_LABELS = {  # the trigger probe's options as the Probes tab labels them (its messages name these, not find= / replace=)
    "find": "trigger: rule text to flip",
    "replace": "trigger: replacement (same token count)",
}


def check_trigger_options(options: dict) -> None:
    """Refuse a trigger probe without both texts, naming the tab's own fields."""
    missing = [TRIGGER_LABELS[key] for key in ("find", "replace") if not (options.get(key) or "").strip()]
    if missing:
        raise AppMissingInput(
            f"the trigger probe needs {' and '.join(repr(label) for label in missing)}: a rule phrase after the field that occurs "
            "once (e.g. 'only if') and its flip with the same token count (e.g. 'unless')"
        )


def probe_sentence(data: dict) -> str:
    """The probe result's one-sentence reading (its ``headline``) as Markdown."""
    return markdown_literal(data.get("headline") or "")


@dataclass(frozen=True)
class ProbeCase:
    """The Probes tab's question: the Notes tab's edit (scenario text, field, new value; None: the scenario's own), the
    probe's name and its options."""

    text: str
    field: str | None
    new: str | None
    name: str
    options: dict = dataclasses.field(default_factory=dict)


@guarded
def run_probe(registry: ModelRegistry, case: ProbeCase, spec: str | None = None, progress: StepProgress = None) -> tuple[go.Figure, dict]:
    """One probe (causal, linear or attribution) on the Notes tab's edit, with its figure."""
    if case.name not in PROBES:
        raise AppError(f"unknown probe {case.name!r}; choose from {', '.join(PROBES)}")
    if case.name == "trigger":
        check_trigger_options(case.options)
    result = PROBES[case.name](experiment(registry, spec, case.text, case.field, case.new), progress=progress, **case.options)
    return probe_figure(case.name, result), result.as_dict()


@guarded
def probe_recipe(registry: ModelRegistry, case: ProbeCase, spec: str | None = None) -> Recipe:
    """The recipe of :func:`run_probe` with these inputs."""
    scenario = parse_scenario(case.text, registry.profile)
    chosen = scenario.field(case.field or None)
    lm = registry.get(spec)
    return Recipe(
        kind="probe",
        model=registry.resolve(spec),
        dtype=dtype_name(lm.dtype),
        device=str(lm.device),
        scenario_toml=case.text,
        field=chosen.name,
        new=case.new or chosen.new,
        settings=recipe_settings(EditSettings(top_k=8)),  # the K of experiment()'s default, which run_probe uses
        probe=case.name,
        probe_options=dict(case.options),
        scenario_name=scenario.name,
    )


@guarded
def run_weight_edits(
    registry: ModelRegistry,
    spec: str | None = None,
    *,
    text: str,
    field: str | None,
    new: str | None,
    methods: Sequence[str],
    lora_steps,
    rome_layer,
    progress: StepProgress = None,
) -> tuple[go.Figure, str, dict]:
    """ROME and LoRA beside field_erratum on the Notes tab's edit, measured against the bundled scenarios
    (``rome_layer`` −1 or None: the layer the notes map points to)."""
    if not methods:
        raise AppError("choose at least one method to compare")
    scenario = parse_scenario(text, registry.profile)
    others = [Scenario.load(path) for path in bundled_scenarios().values()]
    layer = number(rome_layer, "ROME layer", -1)
    report = compare_edits(
        registry.get(spec),
        scenario,
        others,
        field or None,
        new or None,
        list(methods),
        lora=LoraSettings(steps=number(lora_steps, "LoRA steps", LoraSettings.steps)),
        rome=RomeSettings(layer=None if layer < 0 else layer),
        progress=progress,
    )
    return weight_edit_figure(report), trade_off_markdown(report), report.as_dict()
