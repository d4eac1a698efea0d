"""Probes: one probe (from the engine's registry) on the Notes tab's edit, with its figure and export; and weight
editing (ROME, LoRA) beside the erratum on that edit."""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.common import AppMissingInput
from kvscope.app.handlers.probes import TRIGGER_LABELS, ProbeCase, probe_recipe, probe_sentence, run_probe, run_weight_edits
from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider
from kvscope.app.page import UI_ONLY, Page, notice, step_progress
from kvscope.app.tabs import TabContext
from kvscope.app.tabs.notes import NotesInputs
from kvscope.engine import PROBES, WEIGHT_METHODS, LoraSettings

WEIGHTS_INTRO = (
    "Makes the model give the new-value decision for the old-value context by editing **weights** (on a private copy: "
    "the shared model never changes) or by appending an **erratum** to this request's cache, then measures each on the "
    "edited request (efficacy), the same case for three other customers (contamination) and every other bundled "
    "scenario (collateral). Weight edits train for seconds to minutes on a CPU."
)


def probe_options(name: str, find: str | None, replacement: str | None, method: str | None) -> dict:
    """The chosen probe's own options from the tab's inputs (the trigger's texts, the attribution's method)."""
    if name == "trigger":
        return {"find": find, "replace": replacement}
    return {"method": method} if name == "attribution" else {}


def build(ctx: TabContext) -> None:
    """The Probes tab."""
    page = ctx.page
    notes = ctx.shared_notes()
    with gr.Tab("Probes", id="probes"):
        gr.Markdown("Each probe runs on the scenario, field and new value chosen in the **Notes** tab.")
        with gr.Row():
            probe_name = gr.Dropdown(
                [name for name in PROBES if name != "attention"],  # attention: the Notes tab
                value="suffix",
                label="Probe",
                elem_id="probe-name",
            )
            trigger_find = gr.Textbox(label=TRIGGER_LABELS["find"], elem_id="trigger-find")
            trigger_replace = gr.Textbox(label=TRIGGER_LABELS["replace"], elem_id="trigger-replace")
            attribution_method = gr.Radio(["ablation", "gradient"], value="ablation", label="attribution method")
            probe_button = gr.Button("Run probe", variant="primary", elem_id="run-probe")
        probe_plot = gr.Plot(label="Probe", elem_id="probe-plot")
        probe_words = gr.Markdown(elem_id="probe-sentence")  # what the result means, in one sentence from its numbers
        probe_json = gr.JSON(label="Probe result", elem_id="probe-json")
        recipe = gr.State(None)  # what computed the probe shown (the export writes a script and a notebook)
        with gr.Row():
            probe_export = gr.Button("Export JSON, figure, script + notebook", elem_id="export-probe")
            probe_files = gr.File(label="Exported files", file_count="multiple", elem_id="probe-files")
        _weights_section(page, notes)

    @page.action
    def on_probe(spec, text, field, new, name, find, replacement, method, progress=gr.Progress()):
        options = probe_options(name, find, replacement, method)
        case = ProbeCase(text, field, new, name, options)
        try:
            figure, data = run_probe(page.registry, case, spec, step_progress(progress))
        except AppMissingInput as missing:  # e.g. the trigger's texts not given yet: say which, as a warning
            return None, notice(missing), None, None
        return figure, probe_sentence(data), data, probe_recipe(page.registry, case, spec)

    shown = [probe_plot, probe_words, probe_json, recipe]
    probe_name.change(  # another probe: the previous one's result no longer answers what is asked
        lambda: (None, "", None, None), outputs=shown, **UI_ONLY
    )
    probe_button.click(
        on_probe,
        inputs_kwargs={
            "spec": page.spec,
            **notes.case(),
            "name": probe_name,
            "find": trigger_find,
            "replacement": trigger_replace,
            "method": attribution_method,
        },
        outputs=shown,
        api_name="probe",
        **page.model_bound(),
    )
    page.export_on(
        probe_export,
        "kvscope-probe",
        result=probe_json,
        recipe=recipe,
        plots={"probe_plot": probe_plot},
        files=probe_files,
        api_name="export_probe",
    )


def _weights_section(page: Page, notes: NotesInputs) -> None:
    """Weight editing (ROME, LoRA) beside the erratum on the Notes tab's edit."""
    with gr.Accordion("Cache editing vs weight editing (ROME, LoRA, field_erratum)", open=True, elem_id="weights-section"):
        gr.Markdown(WEIGHTS_INTRO)
        with gr.Row():
            methods = LenientCheckboxGroup(list(WEIGHT_METHODS), value=list(WEIGHT_METHODS), label="methods", elem_id="weights-methods")
            lora_steps = LenientSlider(
                1, 60, value=LoraSettings.steps, step=1, label="LoRA steps (stops once flipped)", elem_id="weights-lora-steps"
            )
            layers = page.registry.get().info()["layers"]
            rome_layer = LenientSlider(
                -1, layers - 1, value=-1, step=1, label="ROME layer (-1: from the notes map)", elem_id="weights-rome-layer"
            )
            weights_button = gr.Button("Compare edits", variant="primary", elem_id="run-weights")
        weights_summary = gr.Markdown(elem_id="weights-summary")
        weights_plot = gr.Plot(label="Weight editing vs erratum", elem_id="weights-plot")
        weights_json = gr.JSON(label="Comparison", elem_id="weights-json")

    @page.action
    def on_weights(spec, progress=gr.Progress(), **values):
        figure, summary, data = run_weight_edits(page.registry, spec, **values, progress=step_progress(progress))
        return summary, figure, data

    weights_button.click(
        on_weights,
        inputs_kwargs={"spec": page.spec, **notes.case(), "methods": methods, "lora_steps": lora_steps, "rome_layer": rome_layer},
        outputs=[weights_summary, weights_plot, weights_json],
        api_name="weights",
        **page.model_bound(),
    )
