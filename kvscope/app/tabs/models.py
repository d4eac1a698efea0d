"""Models: the Notes tab's scenario and edit on up to three models side by side, with the paper's 7–9B values."""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.model import offered_models
from kvscope.app.handlers.models import run_model_comparison
from kvscope.app.tabs import TabContext

MODELS_INTRO = (
    "The Notes tab's scenario, field and new value on up to three models: notes share and the recovery of "
    "field_only, erratum and field_erratum; where the notes are written (relative depth of the notes map's strongest "
    "cells); how many read heads carry the decision; one skill's splice cosine. Models load one after another; "
    "the server drops what no longer fits its memory budget and says so below."
)

# The table's row names never break inside a word (Gradio's prose breaks words anywhere: "field_erratu m" beside three
# long model names at 1,000 px); the model names in its header break where they must.
TABLE_CSS = """<style>
#compare-summary th:first-child,#compare-summary td:first-child{white-space:nowrap;word-break:keep-all;overflow-wrap:normal}
#compare-summary th{overflow-wrap:anywhere}
</style>"""


def build(ctx: TabContext) -> None:
    """The Models tab."""
    page = ctx.page
    notes = ctx.shared_notes()
    with gr.Tab("Models", id="models"):
        gr.Markdown(MODELS_INTRO)
        with gr.Row():
            chosen = gr.Dropdown(
                choices=offered_models(page.registry),
                value=[page.registry.default_spec],
                multiselect=True,
                max_choices=3,
                allow_custom_value=page.registry.profile.allowed_models is None,
                label="Models (up to 3)",
                elem_id="compare-models",
                scale=4,
            )
            run = gr.Button("Compare models", variant="primary", elem_id="compare-run", scale=1)
        gr.HTML(TABLE_CSS, padding=False, elem_id="compare-table-css")
        summary = gr.Markdown(elem_id="compare-summary")
        share_plot = gr.Plot(label="Notes share against model size, beside the paper's 7–9B models", elem_id="compare-share")
        metrics_plot = gr.Plot(label="Recoveries, notes depth, read heads and splice cosine per model", elem_id="compare-metrics")
        result_json = gr.JSON(label="Comparison", elem_id="compare-json")

    @page.action
    def on_compare(models, progress=gr.Progress(), **case):
        state = {"fraction": 0.0, "desc": "comparing models"}

        def step(done, total):
            state["fraction"] = done / max(total, 1)
            progress(state["fraction"], desc=state["desc"])

        def message(note):
            state["desc"] = note
            progress(state["fraction"], desc=note)

        view = run_model_comparison(page.registry, models, **case, progress=step, messages=message)
        return view.summary, view.share_figure, view.metrics_figure, view.result

    run.click(
        on_compare,
        inputs_kwargs={"models": chosen, **notes.case()},
        outputs=[summary, share_plot, metrics_plot, result_json],
        api_name="compare_models",
        **page.model_bound(),
    )
