"""Event handlers: plain functions from UI values to engine results and figures."""
from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go

from engine.models import LoadedModel
from engine.runs import run_scenario
from engine.scenario import Scenario, bundled_scenarios
from viz.decision import decision_figure


@dataclass(frozen=True)
class ScenarioView:
    """What the page shows about a scenario before any model call."""

    description: str
    fields: list[str]
    values: list[str]
    context: str


def model_markdown(lm: LoadedModel) -> str:
    """A model card as Markdown (every value escaped)."""
    info = lm.info()
    rope = info.get("rope") or "none (learned positions: splicing is off)"
    rows = {
        "Model": lm.fingerprint.name,
        "Source": lm.source,
        "Architecture": info.get("architecture"),
        "Layers / heads / KV heads": f"{info.get('layers')} / {info.get('attention_heads')} / {info.get('kv_heads')}",
        "Head dim": info.get("head_dim"),
        "RoPE": rope,
        "Device / dtype": f"{lm.device} / {lm.fingerprint.dtype}",
        "Fingerprint": lm.fingerprint.config_hash,
    }
    return "\n".join(f"- **{key}**: {html.escape(str(value))}" for key, value in rows.items())


def load_scenario(name: str) -> Scenario:
    """A bundled scenario by its file stem."""
    paths: dict[str, Path] = bundled_scenarios()
    if name not in paths:
        raise ValueError(f"unknown scenario {name!r}; bundled: {', '.join(sorted(paths))}")
    return Scenario.load(paths[name])


def scenario_view(name: str, field: str | None = None) -> ScenarioView:
    """Description, fields, the chosen field's values and the raw context of a bundled scenario."""
    scenario = load_scenario(name)
    chosen = scenario.field(field if field in scenario.fields else None)
    return ScenarioView(
        description=f"**{html.escape(scenario.name)}** — {html.escape(scenario.description)}",
        fields=list(scenario.fields),
        values=list(chosen.values),
        context=scenario.context,
    )


def decide(lm: LoadedModel, name: str, field: str, value: str) -> tuple[str, go.Figure, dict]:
    """Read the decision with one field set to ``value``: verdict text, figure, JSON summary."""
    scenario = load_scenario(name)
    run = run_scenario(lm, scenario, {field: value})
    expected = run.expected.get(field)
    agreement = "" if expected is None else (" — as expected" if expected == run.decision.label else f" — expected **{html.escape(expected)}**")
    verdict = (
        f"With `{html.escape(field)}` = `{html.escape(value)}` the model answers "
        f"**{html.escape(run.decision.label)}** (margin {run.decision.margin:+.2f}){agreement}."
    )
    return verdict, decision_figure(run.decision, title=f"{field} = {value}"), {"model": lm.fingerprint.name, **run.as_dict()}
