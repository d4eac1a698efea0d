"""Model: load a model in a dtype; the card, its self-test and support row, and what the server keeps in memory."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from kvscope.app.handlers.model import load_model_card, memory_markdown, offered_models
from kvscope.app.page import message_progress
from kvscope.app.tabs import TabContext


@dataclass
class ModelLoad:
    """The load event (the scenario's baseline follows it), its handler and outputs (the page's own load runs them too)."""

    event: gr.events.Dependency
    handler: object
    outputs: list


def build(ctx: TabContext) -> None:
    """The Model tab."""
    page = ctx.page
    with gr.Tab("Model", id="model"):
        with gr.Row():
            model_input = gr.Dropdown(
                choices=offered_models(page.registry),
                value=page.registry.default_spec,
                allow_custom_value=True,
                label="Model (alias, Hugging Face id or local directory)"
                if page.registry.profile.allowed_models is None
                else "Model (one of those this server offers)",
                elem_id="model-spec",
                scale=3,
            )
            model_dtype = gr.Radio(
                ["auto", "float32", "bfloat16"], value=None, label="dtype (empty = as loaded)", elem_id="model-dtype", scale=2
            )
            load_button = gr.Button("Load", variant="primary", elem_id="load-model", scale=1)
        model_card = gr.Markdown(elem_id="model-card")
        with gr.Row():
            server_memory = gr.Markdown(elem_id="server-memory")
            memory_refresh = gr.Button("Refresh", size="sm", elem_id="refresh-memory", scale=0)
        model_json = gr.JSON(label="Model info and self-test", elem_id="model-json")

    @page.action
    def on_load_model(spec, dtype=None, progress=gr.Progress(track_tqdm=True)):
        card, info = load_model_card(page.registry, spec, progress=message_progress(progress), dtype=dtype)
        return card, info, spec, memory_markdown(page.registry, page.sessions)

    memory_refresh.click(
        lambda: memory_markdown(page.registry, page.sessions), outputs=server_memory, api_name="server_memory", concurrency_limit=None
    )
    # No session id here: the page's own load runs this too, and an id it minted would replace the one an edit
    # clicked meanwhile minted (the edit's results would then be out of reach of its knockout and export).
    outputs = [model_card, model_json, page.spec, server_memory]
    loaded = load_button.click(
        on_load_model,
        inputs_kwargs={"spec": model_input, "dtype": model_dtype},
        outputs=outputs,
        api_name="load_model",
        **page.model_bound(),
    )
    ctx.model = ModelLoad(loaded, on_load_model, outputs)
