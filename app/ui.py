"""The page layout and its event wiring."""
from __future__ import annotations

from functools import partial

import gradio as gr

from app import handlers
from engine.models import LoadedModel
from engine.scenario import ScenarioError, bundled_scenarios

MODEL_GROUP = "model"  # every handler that runs the model shares one queue slot

INTRO = """# KVScope
See and program a model's KV cache. During prefill a model writes its conclusion about a field onto later
tokens' K/V ("notes"); at decode time the decision reads those notes. Pick a scenario and a field value and
read the decision the model makes from a clean prefill."""


def _on_scenario(name: str):
    view = handlers.scenario_view(name)
    return (
        view.description,
        gr.update(choices=view.fields, value=view.fields[0]),
        gr.update(choices=view.values, value=view.values[0]),
        view.context,
    )


def _on_field(name: str, field: str):
    view = handlers.scenario_view(name, field)
    return gr.update(choices=view.values, value=view.values[0])


def _on_decide(lm: LoadedModel, name: str, field: str, value: str):
    try:
        return handlers.decide(lm, name, field, value)
    except (ScenarioError, ValueError) as error:
        raise gr.Error(str(error)) from error


def build_app(lm: LoadedModel) -> gr.Blocks:
    """The KVScope page for one loaded model."""
    names = sorted(bundled_scenarios())
    first = handlers.scenario_view(names[0])
    with gr.Blocks(title="KVScope") as page:
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=1):
                gr.Markdown("### Model")
                gr.Markdown(handlers.model_markdown(lm), elem_id="model-card")
            with gr.Column(scale=2):
                scenario = gr.Dropdown(names, value=names[0], label="Scenario", elem_id="scenario")
                description = gr.Markdown(first.description, elem_id="scenario-description")
                with gr.Row():
                    field = gr.Dropdown(first.fields, value=first.fields[0], label="Field", elem_id="field")
                    value = gr.Dropdown(first.values, value=first.values[0], label="Value", allow_custom_value=True, elem_id="value")
                decide = gr.Button("Read the decision", variant="primary", elem_id="decide")
        verdict = gr.Markdown(elem_id="verdict")
        with gr.Row():
            figure = gr.Plot(label="Answer log-probs", elem_id="decision-plot")
            result = gr.JSON(label="Result", elem_id="decision-json")
        context = gr.Code(first.context, label="Context (fields in braces)", language=None, interactive=False)

        scenario.change(_on_scenario, scenario, [description, field, value, context], api_name="scenario", concurrency_limit=None)
        field.change(_on_field, [scenario, field], value, api_name="field_values", concurrency_limit=None)
        decide.click(
            partial(_on_decide, lm), [scenario, field, value], [verdict, figure, result], api_name="decide", concurrency_id=MODEL_GROUP
        )
    return page
