"""Composer: skills dragged into a context, splice vs recompute with a remedy (``auto``: calibrated, cancellable), the
keystone and the agent loop, the N-skill study on the composition, and a picture's K/V spliced into a context."""

from __future__ import annotations

import gradio as gr

from kvscope.app.composer import SkillComposer
from kvscope.app.handlers.common import NOTES_SCENARIO, AppCancelled
from kvscope.app.handlers.composer import (
    Composition,
    calibration_pending,
    model_menu,
    remedy_info,
    remedy_menu,
    remedy_summary,
    run_agent_loop,
    run_compose,
    run_composition_study,
    run_image_compose,
    run_keystone,
    skill_library,
    stop_calibration,
)
from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider
from kvscope.app.page import PAIRED_PLOT_MIN_WIDTH, message_progress, notice, step_progress
from kvscope.app.tabs import TabContext
from kvscope.engine import (
    DECISIVE_MARGIN,
    IMAGE_QUESTION,
    PLACEMENTS,
    STUDY_REMEDIES,
    bundled_images,
    bundled_scenarios,
)
from kvscope.viz.common import markdown_literal

# A long menu entry ends in … before the dropdown's arrow (it ran under it): the input leaves the arrow its width.
MENU_CSS = "<style>#remedy input{padding-right:2.25em;text-overflow:ellipsis}</style>"
KEYSTONE_DEMO = "keystone_safety"  # a scenario whose deciding field lives inside a spliced skill
GENERIC_QUESTION_LABEL = "none: the skills alone, then a generic yes/no question"
STUDY_INTRO = (
    "The first 1, 2 … N skills of the context above (in its order) placed in the chosen scenario, at each "
    "placement, for both values of its first field; each recomputed once and spliced with every remedy. "
    f"Agreement counts only decisive cases (recomputed |margin| ≥ {DECISIVE_MARGIN}); ties are reported apart. "
    "Text before/between skills is not used here."
)
PICTURE_INTRO = (
    "The picture is encoded once (vision tower) and prefilled after the chat template's head; its K/V then "
    "move behind the text before it — keys re-rotated on M-RoPE's three axes — and the question is read. The "
    "full recompute runs the vision tower and prefills everything. Needs an M-RoPE vision-language model: "
    "choose `tiny-qwen2_vl` (random weights: exactness, not meaning) or a Qwen2-VL / Qwen2.5-VL checkpoint."
)


def build(ctx: TabContext) -> None:
    """The Composer tab; its remedy menu goes on ``ctx`` (a Notes-tab link carries its choice)."""
    page = ctx.page
    with gr.Tab("Composer", id="composer"):
        composer = SkillComposer(skill_library(), value=["account_gate"], elem_id="composer")
        with gr.Row():
            before = gr.Textbox(label="Text before the skills", lines=2, elem_id="text-before")
            between = gr.Textbox(label="Text between skills", lines=2, elem_id="text-between")
            after = gr.Dropdown(
                [(GENERIC_QUESTION_LABEL, ""), *[(name, name) for name in sorted(bundled_scenarios())]],
                value=NOTES_SCENARIO,
                label="Then a scenario: its context, question and answers follow the skills",
                elem_id="after-scenario",
            )
        gr.HTML(MENU_CSS, visible="hidden", elem_id="composer-style")
        with gr.Row():
            first = page.registry.default_spec  # the menu follows the loaded model (its own default and numbers)
            remedy = gr.Dropdown(
                remedy_menu(page.registry, first, STUDY_REMEDIES),
                value=model_menu(page.registry, first).default,
                allow_custom_value=True,
                label="Repair of the spliced skills",
                info=remedy_summary(page.registry, first),
                elem_id="remedy",
            )
            compose_button = gr.Button("Splice vs recompute", variant="primary", elem_id="run-compose")
            cancel_button = gr.Button("Cancel calibration", variant="stop", visible=False, elem_id="cancel-calibration")
        with gr.Accordion("What the remedies mean, and why this default", open=False, elem_id="remedy-details"):
            details = gr.Markdown(markdown_literal(remedy_info(page.registry, first)), elem_id="remedy-info")
        calibration_status = gr.Markdown(elem_id="calibration-status")
        compose_metrics = gr.Markdown(elem_id="compose-metrics")
        with gr.Row():
            logits_plot = gr.Plot(label="Top next tokens: spliced vs recomputed", elem_id="logits-plot", min_width=PAIRED_PLOT_MIN_WIDTH)
            deviation_plot = gr.Plot(label="K/V deviation (layer × token)", elem_id="deviation-plot", min_width=PAIRED_PLOT_MIN_WIDTH)
        with gr.Row():
            most = page.registry.profile.max_agent_turns
            turns = LenientSlider(1, most, value=min(10, most), step=1, label="Agent turns")
            toggle = gr.Checkbox(value=False, label="Toggle the field every turn (drift stress test)")
            policy = gr.Dropdown(["never", "every:4", "adaptive"], value="adaptive", label="Erratum compaction", elem_id="agent-policy")
            keystone_demo = gr.Button("Load the keystone demo", elem_id="keystone-demo")
            keystone_button = gr.Button("Keystone: edit the field inside a spliced skill", elem_id="run-keystone")
            agent_button = gr.Button("Agent loop: errata on a cached context", elem_id="run-agent")
        loop_plot = gr.Plot(label="Keystone / agent", elem_id="loop-plot")
        compose_json = gr.JSON(label="Result", elem_id="compose-json")
        with gr.Accordion("Many skills at once: the N-skill study on this composition", open=False, elem_id="study-panel"):
            gr.Markdown(STUDY_INTRO)
            with gr.Row():
                placements = LenientCheckboxGroup(list(PLACEMENTS), value=["start"], label="placements", elem_id="study-placements")
                study_remedies = LenientCheckboxGroup(
                    list(STUDY_REMEDIES), value=list(STUDY_REMEDIES[:3]), label="remedies", elem_id="study-remedies"
                )
                study_button = gr.Button("Run the study", elem_id="run-study")
            study_summary = gr.Markdown(elem_id="study-summary")
            study_plot = gr.Plot(label="Remedy frontier", elem_id="study-plot")
            study_json = gr.JSON(label="Study", elem_id="study-json")
        with gr.Accordion("A picture's K/V spliced into a context (vision-language models)", open=False, elem_id="image-panel"):
            gr.Markdown(PICTURE_INTRO)
            with gr.Row():
                picture = gr.Image(
                    value=str(bundled_images()["shipping_label"]), type="numpy", label="Picture", height=220, elem_id="image-picture"
                )
                with gr.Column():
                    picture_before = gr.Textbox(
                        label="Text before the picture (the block moves by its length)",
                        lines=2,
                        value="Order 48213 was placed on Monday by a gold customer.",
                        elem_id="image-before",
                    )
                    picture_after = gr.Textbox(label="Text after the picture", lines=1, elem_id="image-after")
                    picture_question = gr.Textbox(label="Question (yes / no)", value=IMAGE_QUESTION, elem_id="image-question")
                    picture_seam = LenientSlider(
                        0, 16, value=0, step=1, label="Seam: the picture's first tokens recomputed", elem_id="image-seam"
                    )
                    picture_button = gr.Button("Splice picture vs recompute", variant="primary", elem_id="run-image")
            picture_metrics = gr.Markdown(elem_id="image-metrics")
            picture_plot = gr.Plot(label="Top next tokens: spliced picture vs recomputed from pixels", elem_id="image-logits-plot")
            picture_json = gr.JSON(label="Picture splice", elem_id="image-json")
        with gr.Row():
            compose_export = gr.Button("Export JSON + figures", elem_id="export-compose")
            compose_files = gr.File(label="Exported files", file_count="multiple", elem_id="compose-files")

    composition = {"spec": page.spec, "skills": composer, "before": before, "between": between, "after": after, "remedy": remedy}

    @page.action
    def on_compose(spec, progress=gr.Progress(), **values):
        try:
            view = run_compose(page.registry, Composition(**values), spec=spec, report=message_progress(progress))
        except AppCancelled as stopped:  # the person cancelled the calibration: say so, as information
            return notice(stopped), None, None, None
        return view.metrics_markdown, view.logits_figure, view.deviation_figure, view.summary

    # auto calibrates the model once (minutes): its progress shows on the results; Cancel stops it between two forwards,
    # and shows only while a calibration may run (from the choice of auto, or a splice that starts one, to its end)
    def show_cancel(spec, remedy):
        return gr.update(visible=calibration_pending(page.registry, spec, remedy))

    def calibrating(event) -> None:
        """Wire Cancel around a handler that may calibrate: shown as it starts (where it will), hidden once it ends."""
        event.then(lambda: gr.update(visible=False), outputs=cancel_button, api_name=False, concurrency_limit=None)

    compared = [compose_metrics, logits_plot, deviation_plot, compose_json]
    for trigger in (remedy.change, compose_button.click, composer.change, keystone_button.click, agent_button.click):
        trigger(
            show_cancel, inputs_kwargs={"spec": page.spec, "remedy": remedy}, outputs=cancel_button, api_name=False, concurrency_limit=None
        )
    calibrating(compose_button.click(on_compose, inputs_kwargs=composition, outputs=compared, api_name="compose", **page.model_bound()))

    def on_model(spec):
        menu = remedy_menu(page.registry, spec, STUDY_REMEDIES)
        default = model_menu(page.registry, spec).default
        info = remedy_summary(page.registry, spec)
        return gr.update(choices=menu, value=default, info=info), markdown_literal(remedy_info(page.registry, spec))

    page.spec.change(page.action(on_model), inputs_kwargs={"spec": page.spec}, outputs=[remedy, details], api_name=False)
    cancel_button.click(
        page.action(lambda spec: stop_calibration(page.registry, spec)),
        inputs_kwargs={"spec": page.spec},
        outputs=calibration_status,
        api_name="cancel_calibration",
        concurrency_limit=None,
    )
    calibrating(composer.change(on_compose, inputs_kwargs=composition, outputs=compared, api_name=False, **page.model_bound()))

    @page.action
    def on_keystone(spec, progress=gr.Progress(), **values):
        try:
            return run_keystone(page.registry, Composition(**values), spec=spec, progress=step_progress(progress))
        except AppCancelled as stopped:
            notice(stopped)
            return None, None

    keystone_demo.click(lambda: ([], KEYSTONE_DEMO), outputs=[composer, after], api_name=False)
    calibrating(
        keystone_button.click(
            on_keystone, inputs_kwargs=composition, outputs=[loop_plot, compose_json], api_name="keystone", **page.model_bound()
        )
    )

    @page.action
    def on_agent(spec, turns, toggle, policy="adaptive", progress=gr.Progress(), **values):
        loop = {"turns": turns, "toggle": toggle, "policy": policy, "progress": step_progress(progress)}
        try:
            return run_agent_loop(page.registry, Composition(**values), spec=spec, **loop)
        except AppCancelled as stopped:
            notice(stopped)
            return None, None

    agent_event = agent_button.click(
        on_agent,
        inputs_kwargs={**composition, "turns": turns, "toggle": toggle, "policy": policy},
        outputs=[loop_plot, compose_json],
        api_name="agent",
        **page.model_bound(),
    )
    calibrating(agent_event)

    @page.action
    def on_study(spec, progress=gr.Progress(), **values):
        return run_composition_study(page.registry, spec, **values, progress=step_progress(progress))

    study_button.click(
        on_study,
        inputs_kwargs={"spec": page.spec, "skills": composer, "after": after, "placements": placements, "remedies": study_remedies},
        outputs=[study_plot, study_summary, study_json],
        api_name="compose_study",
        **page.model_bound(),
    )

    @page.action
    def on_image(spec, **values):
        return run_image_compose(page.registry, spec, **values)

    picture_button.click(
        on_image,
        inputs_kwargs={
            "spec": page.spec,
            "picture": picture,
            "before": picture_before,
            "after": picture_after,
            "question": picture_question,
            "seam": picture_seam,
        },
        outputs=[picture_metrics, picture_plot, picture_json],
        api_name="compose_image",
        **page.model_bound(),
    )
    plots = {"logits_plot": logits_plot, "deviation_plot": deviation_plot, "loop_plot": loop_plot}
    page.export_on(compose_export, "kvscope-composer", result=compose_json, plots=plots, files=compose_files, api_name="export_composer")
    ctx.remedy = remedy
