"""The Models tab's handler: the Notes tab's scenario and edit on up to three models side by side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from kvscope.app.handlers.common import guarded, parse_scenario
from kvscope.app.state import ModelRegistry
from kvscope.engine import MessageProgress, StepProgress, compare_models
from kvscope.viz import models as model_figures


@dataclass
class ModelsView:
    """The Models panel: the table (with what the registry dropped to make room), the two figures and the JSON."""

    summary: str
    share_figure: go.Figure
    metrics_figure: go.Figure
    result: dict


@guarded
def run_model_comparison(
    registry: ModelRegistry,
    specs: Sequence[str] | None,
    *,
    text: str,
    field: str | None,
    new: str | None,
    progress: StepProgress = None,
    messages: MessageProgress | None = None,
) -> ModelsView:
    """The Notes tab's scenario and edit on up to three models, loaded through the registry (which drops what no
    longer fits its budget, and says so)."""
    chosen = [str(spec).strip() for spec in specs or [] if spec and str(spec).strip()]
    scenario = parse_scenario(text, registry.profile)
    for spec in chosen:
        registry.resolve(spec)  # the profile's allowlist, before any model loads
    mark = registry.drop_serial
    comparison = compare_models(
        chosen,
        lambda spec: registry.get(spec, progress=messages),
        scenario,
        field or None,
        new or None,
        stores=registry.skills,
        progress=messages,
        steps=progress,
    )
    data = comparison.as_dict() | {"dropped": registry.drops_since(mark)}
    summary = model_figures.comparison_markdown(data) + model_figures.dropped_markdown(data["dropped"])
    return ModelsView(summary, model_figures.notes_share_figure(data), model_figures.model_metrics_figure(data), data)
