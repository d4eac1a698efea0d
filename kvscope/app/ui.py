"""The KVScope page: the tabs (one module each under kvscope/app/tabs) assembled, and what runs when a page loads."""

from __future__ import annotations

import gradio as gr

from kvscope.app import permalink
from kvscope.app.page import Page
from kvscope.app.state import ExportFolder, ModelRegistry, SessionStore
from kvscope.app.tabs import TabContext, benchmarks, composer, learn, model, models, notes, probes, your_prompt

TABS = (model, notes, your_prompt, probes, models, composer, benchmarks, learn)  # in the tab strip's order

INTRO = """# KVScope
See and program a model's KV cache. During prefill a model writes its conclusion about a field onto later tokens'
K/V — its *notes* — and the decision reads the notes, not the field. Edit a field and watch the decision flip (or
not), see where the notes are, and splice precompiled skills into contexts."""


def theme() -> gr.themes.Base:
    """The page's theme (``launch(theme=...)`` in Gradio 6): its type is wider than the default's, so at a 1,000 px window
    the tabs take two rows."""
    return gr.themes.Soft()


def build_app(registry: ModelRegistry, sessions: SessionStore | None = None, exports: ExportFolder | None = None) -> gr.Blocks:
    """The whole explorer over a model registry (the default model should already be loaded); sessions and
    exports are bounded by the registry's hosting profile."""
    profile = registry.profile
    sessions = sessions or SessionStore.for_profile(profile)
    registry.on_drop(sessions.forget_model)
    exports = exports or ExportFolder(profile.export_max_bytes, profile.export_keep)
    # Gradio copies returned files into its own cache: clear copies older than an hour, every 10 minutes.
    with gr.Blocks(title="KVScope", delete_cache=(600, 3600)) as blocks:
        page = Page(registry, sessions, exports, gr.State(None), gr.State(registry.default_spec))
        gr.Markdown(INTRO)
        # a first visit opens on the Notes tab, the model card one click away; tabs wider than the page wrap onto a second
        # row (at a 1,000 px window the last two hid under Gradio's "⋯" menu)
        with gr.Tabs(selected="notes", overflow_behavior="wrap") as tabs:
            ctx = TabContext(page, tabs)
            for tab in TABS:
                tab.build(ctx)
        shared = ctx.shared_notes()
        loaded = ctx.model
        shared.prepare_after(page, loaded.event)
        page_loaded = blocks.load(
            loaded.handler,
            inputs_kwargs={"spec": page.spec},
            outputs=loaded.outputs,
            api_name=False,
            **page.model_bound(),
        )
        for wire in ctx.on_page_load:
            wire(page_loaded)

        def prepare_on_load(spec, text, request: gr.Request):
            if request is not None and permalink.is_link(dict(request.query_params)):
                return gr.update()  # a link's scenario is prepared once it is restored
            return page.prepare_message(spec, text)

        blocks.load(
            prepare_on_load,
            inputs_kwargs={"spec": page.spec, "text": shared.editor},
            outputs=shared.baseline,
            api_name="prepare",
            **page.model_bound(),
        )
    return blocks
