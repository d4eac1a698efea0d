"""Composer: skills dragged into a context, splice vs recompute with a remedy (``auto``: calibrated, cancellable), the
keystone and the agent loop, the N-skill study on the composition, and a picture's K/V spliced into a context.

A result shows only while the page's selection is still the one it was computed for: each run carries its selection,
a newer selection cancels the session's earlier run and drops its result, and a result left from an earlier selection
is marked (:class:`kvscope.app.handlers.composer.ComposerRuns`)."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from kvscope.app.composer import SkillComposer
from kvscope.app.handlers.common import NOTES_SCENARIO, AppCancelled
from kvscope.app.handlers.composer import (
    ComposerRuns,
    Composition,
    calibration_pending,
    compose_for_page,
    model_menu,
    placed_skills,
    remedy_info,
    remedy_menu,
    remedy_summary,
    run_agent_loop,
    run_composition_study,
    run_image_compose,
    run_keystone,
    selection,
    skill_library,
    stale_words,
    stop_calibration,
)
from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider
from kvscope.app.page import PAIRED_PLOT_MIN_WIDTH, UI_ONLY, Page, message_progress, notice, step_progress
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


@dataclass
class Selectors:
    """What the page selects for a run: the context (skills, text around them, scenario) and the remedy, with the
    buttons and panels beside the menu."""

    skills: SkillComposer
    before: gr.Textbox
    between: gr.Textbox
    after: gr.Dropdown
    remedy: gr.Dropdown
    compose: gr.Button
    cancel: gr.Button
    details: gr.Markdown
    speed: gr.Markdown  # the menu's speed-ups: where measured, what this context's length predicts, what a run measured
    ticket: gr.State  # this page's newest selection (ComposerRuns)

    def composition(self, page: Page) -> dict:
        """The inputs of a handler that takes the model and a :class:`Composition`, by name."""
        return {
            "spec": page.spec,
            "skills": self.skills,
            "before": self.before,
            "between": self.between,
            "after": self.after,
            "remedy": self.remedy,
        }


@dataclass
class Compared:
    """Splice vs recompute's outputs; ``stale`` marks a result computed for another selection than the page's."""

    stale: gr.Markdown
    calibration: gr.Markdown
    metrics: gr.Markdown
    logits: gr.Plot
    deviation: gr.Plot
    result: gr.JSON

    def outputs(self, speed: gr.Markdown) -> list:
        """What a splice vs recompute fills, in the handler's order (``speed``: the line under the remedy menu)."""
        return [self.metrics, self.logits, self.deviation, self.result, speed, self.stale]


@dataclass
class Loop:
    """The keystone and agent-loop row and its plot."""

    turns: gr.Slider
    toggle: gr.Checkbox
    policy: gr.Dropdown
    demo: gr.Button
    keystone: gr.Button
    agent: gr.Button
    plot: gr.Plot


def _context_row() -> tuple[SkillComposer, gr.Textbox, gr.Textbox, gr.Dropdown]:
    """The skill list, the text around the skills and the scenario after them."""
    skills = SkillComposer(skill_library(), value=["account_gate"], elem_id="composer")
    with gr.Row(equal_height=False):
        before = gr.Textbox(label="Text before the skills", lines=2, elem_id="text-before", min_width=220)
        between = gr.Textbox(label="Text between skills", lines=2, elem_id="text-between", min_width=220)
        after = gr.Dropdown(
            [(GENERIC_QUESTION_LABEL, ""), *[(name, name) for name in sorted(bundled_scenarios())]],
            value=NOTES_SCENARIO,
            label="Then a scenario: its context, question and answers follow the skills",
            elem_id="after-scenario",
            min_width=320,
        )
    return skills, before, between, after


def _selectors(page: Page) -> Selectors:
    """The context row, the remedy menu (it follows the loaded model: its own default and numbers) and its buttons."""
    skills, before, between, after = _context_row()
    gr.HTML(MENU_CSS, visible="hidden", elem_id="composer-style")
    first = page.registry.default_spec
    with gr.Row():
        remedy = gr.Dropdown(
            remedy_menu(page.registry, first, STUDY_REMEDIES),
            value=model_menu(page.registry, first).default,
            allow_custom_value=True,
            label="Repair of the spliced skills",
            info=remedy_summary(page.registry, first),
            elem_id="remedy",
        )
        compose = gr.Button("Splice vs recompute", variant="primary", elem_id="run-compose")
        cancel = gr.Button("Cancel calibration", variant="stop", visible=False, elem_id="cancel-calibration")
    speed = gr.Markdown(elem_id="remedy-speed")
    with gr.Accordion("What the remedies mean, and why this default", open=False, elem_id="remedy-details"):
        details = gr.Markdown(markdown_literal(remedy_info(page.registry, first)), elem_id="remedy-info")
    return Selectors(skills, before, between, after, remedy, compose, cancel, details, speed, gr.State())


def _comparison_panels() -> tuple[gr.Markdown, gr.Markdown, gr.Markdown, gr.Plot, gr.Plot]:
    """The panels of splice vs recompute above the keystone and agent row (its result panel follows that row)."""
    stale = gr.Markdown(elem_id="compose-stale")
    calibration = gr.Markdown(elem_id="calibration-status")
    metrics = gr.Markdown(elem_id="compose-metrics")
    with gr.Row():
        logits = gr.Plot(label="Top next tokens: spliced vs recomputed", elem_id="logits-plot", min_width=PAIRED_PLOT_MIN_WIDTH)
        deviation = gr.Plot(label="K/V deviation (layer × token)", elem_id="deviation-plot", min_width=PAIRED_PLOT_MIN_WIDTH)
    return stale, calibration, metrics, logits, deviation


def _loop(page: Page) -> Loop:
    """The agent's settings and the keystone and agent buttons, then their plot."""
    with gr.Row():
        most = page.registry.profile.max_agent_turns
        turns = LenientSlider(1, most, value=min(10, most), step=1, label="Agent turns")
        toggle = gr.Checkbox(value=False, label="Toggle the field every turn (drift stress test)")
        policy = gr.Dropdown(["never", "every:4", "adaptive"], value="adaptive", label="Erratum compaction", elem_id="agent-policy")
        demo = gr.Button("Load the keystone demo", elem_id="keystone-demo")
        keystone = gr.Button("Keystone: edit the field inside a spliced skill", elem_id="run-keystone")
        agent = gr.Button("Agent loop: errata on a cached context", elem_id="run-agent")
    return Loop(turns, toggle, policy, demo, keystone, agent, gr.Plot(label="Keystone / agent", elem_id="loop-plot"))


def _wire_compose(page: Page, chosen: Selectors, compared: Compared, runs: ComposerRuns) -> None:
    """A change of the skills (and the button) starts a run for the page's selection, which supersedes the session's
    earlier run (:class:`ComposerRuns`); a change of the text, the scenario, the remedy (``auto`` may calibrate for
    minutes) or the model marks the result shown as another selection's. A result shows only while its selection is
    still the page's newest."""
    shown = compared.outputs(chosen.speed)

    def selected(rerunning: bool):
        def on_select(request: gr.Request, result=None, spec=None, **values):
            chosen = selection(page.registry, spec, Composition(**values))
            return runs.select(request.session_hash, chosen), stale_words(result, chosen, rerunning)

        return on_select

    @page.action
    def on_compose(spec, request: gr.Request, ticket=None, progress=gr.Progress(), **values):
        try:
            view = compose_for_page(
                page.registry, runs, request.session_hash, ticket, Composition(**values), spec=spec, report=message_progress(progress)
            )
        except AppCancelled as stopped:  # the person cancelled the calibration: say so, as information
            return notice(stopped), None, None, None, gr.skip(), ""
        if view is None:  # a newer selection superseded this run
            return tuple(gr.skip() for _ in shown)
        return view.metrics_markdown, view.logits_figure, view.deviation_figure, view.summary, view.speed_markdown, ""

    composition = chosen.composition(page)
    marked = {"result": compared.result, **composition}
    reruns = [chosen.skills.change, chosen.compose.click]
    started = gr.on(reruns, selected(True), inputs_kwargs=marked, outputs=[chosen.ticket, compared.stale], **UI_ONLY)
    run = started.then(
        on_compose,
        inputs_kwargs={**composition, "ticket": chosen.ticket},
        outputs=shown,
        api_name="compose",
        trigger_mode="always_last",
        **page.model_bound(),
    )
    run.then(lambda: gr.update(visible=False), outputs=chosen.cancel, **UI_ONLY)
    marks = [chosen.before.change, chosen.between.change, chosen.after.change, chosen.remedy.change, page.spec.change]
    gr.on(marks, selected(False), inputs_kwargs=marked, outputs=[chosen.ticket, compared.stale], **UI_ONLY)


def _wire_menu(page: Page, chosen: Selectors, compared: Compared, loop: Loop) -> None:
    """The menu follows the model; Cancel shows while a calibration may run (``auto`` calibrates the model once, for
    minutes: its progress shows on the results, and Cancel stops it between two forwards)."""

    def on_model(spec):
        menu = remedy_menu(page.registry, spec, STUDY_REMEDIES)
        default = model_menu(page.registry, spec).default
        info = remedy_summary(page.registry, spec)
        return gr.update(choices=menu, value=default, info=info), markdown_literal(remedy_info(page.registry, spec))

    page.spec.change(page.action(on_model), inputs_kwargs={"spec": page.spec}, outputs=[chosen.remedy, chosen.details], api_name=False)

    def show_cancel(spec, remedy):
        return gr.update(visible=calibration_pending(page.registry, spec, remedy))

    for trigger in (chosen.remedy.change, chosen.compose.click, chosen.skills.change, loop.keystone.click, loop.agent.click):
        trigger(
            show_cancel,
            inputs_kwargs={"spec": page.spec, "remedy": chosen.remedy},
            outputs=chosen.cancel,
            **UI_ONLY,
        )
    chosen.cancel.click(
        page.action(lambda spec: stop_calibration(page.registry, spec)),
        inputs_kwargs={"spec": page.spec},
        outputs=compared.calibration,
        api_name="cancel_calibration",
        concurrency_limit=None,
    )
    chosen.after.change(
        lambda after: gr.update(placed=chosen.skills.placed_by(after or "", placed_skills(after))),
        inputs_kwargs={"after": chosen.after},
        outputs=chosen.skills,
        **UI_ONLY,
    )


def _wire_loop(page: Page, chosen: Selectors, compared: Compared, loop: Loop) -> None:
    """The keystone demo, the keystone (an edit inside a spliced skill) and the agent loop, on the page's selection."""
    composition = chosen.composition(page)
    hide_cancel = {"fn": lambda: gr.update(visible=False), "outputs": chosen.cancel, **UI_ONLY}

    @page.action
    def on_keystone(spec, progress=gr.Progress(), **values):
        try:
            return (*run_keystone(page.registry, Composition(**values), spec=spec, progress=step_progress(progress)), "")
        except AppCancelled as stopped:
            notice(stopped)
            return None, None, gr.skip()

    loop.demo.click(lambda: ([], KEYSTONE_DEMO), outputs=[chosen.skills, chosen.after], api_name=False)
    shown = [loop.plot, compared.result, compared.stale]
    loop.keystone.click(on_keystone, inputs_kwargs=composition, outputs=shown, api_name="keystone", **page.model_bound()).then(
        **hide_cancel
    )

    @page.action
    def on_agent(spec, turns, toggle, policy="adaptive", progress=gr.Progress(), **values):
        settings = {"turns": turns, "toggle": toggle, "policy": policy, "progress": step_progress(progress)}
        try:
            return (*run_agent_loop(page.registry, Composition(**values), spec=spec, **settings), "")
        except AppCancelled as stopped:
            notice(stopped)
            return None, None, gr.skip()

    inputs = {**composition, "turns": loop.turns, "toggle": loop.toggle, "policy": loop.policy}
    loop.agent.click(on_agent, inputs_kwargs=inputs, outputs=shown, api_name="agent", **page.model_bound()).then(**hide_cancel)


@dataclass
class Study:
    """The N-skill study on the composition."""

    placements: gr.CheckboxGroup
    remedies: gr.CheckboxGroup
    run: gr.Button
    summary: gr.Markdown
    plot: gr.Plot
    result: gr.JSON


def _study() -> Study:
    """The N-skill study's panel, closed until opened."""
    with gr.Accordion("Many skills at once: the N-skill study on this composition", open=False, elem_id="study-panel"):
        gr.Markdown(STUDY_INTRO)
        with gr.Row():
            placements = LenientCheckboxGroup(list(PLACEMENTS), value=["start"], label="placements", elem_id="study-placements")
            remedies = LenientCheckboxGroup(
                list(STUDY_REMEDIES), value=list(STUDY_REMEDIES[:3]), label="remedies", elem_id="study-remedies"
            )
            run = gr.Button("Run the study", elem_id="run-study")
        summary = gr.Markdown(elem_id="study-summary")
        plot = gr.Plot(label="Remedy frontier", elem_id="study-plot")
        result = gr.JSON(label="Study", elem_id="study-json")
    return Study(placements, remedies, run, summary, plot, result)


def _wire_study(page: Page, chosen: Selectors, study: Study) -> None:
    """The study runs on the page's skills (the first 1..N, in order) and scenario."""

    @page.action
    def on_study(spec, progress=gr.Progress(), **values):
        return run_composition_study(page.registry, spec, **values, progress=step_progress(progress))

    study.run.click(
        on_study,
        inputs_kwargs={
            "spec": page.spec,
            "skills": chosen.skills,
            "after": chosen.after,
            "placements": study.placements,
            "remedies": study.remedies,
        },
        outputs=[study.plot, study.summary, study.result],
        api_name="compose_study",
        **page.model_bound(),
    )


def _picture(page: Page) -> None:
    """A picture's K/V spliced into a context vs recomputed from its pixels: the panel and its event."""
    with gr.Accordion("A picture's K/V spliced into a context (vision-language models)", open=False, elem_id="image-panel"):
        gr.Markdown(PICTURE_INTRO)
        with gr.Row():
            picture = gr.Image(
                value=str(bundled_images()["shipping_label"]), type="numpy", label="Picture", height=220, elem_id="image-picture"
            )
            with gr.Column():
                before = gr.Textbox(
                    label="Text before the picture (the block moves by its length)",
                    lines=2,
                    value="Order 48213 was placed on Monday by a gold customer.",
                    elem_id="image-before",
                )
                after = gr.Textbox(label="Text after the picture", lines=1, elem_id="image-after")
                question = gr.Textbox(label="Question (yes / no)", value=IMAGE_QUESTION, elem_id="image-question")
                seam = LenientSlider(0, 16, value=0, step=1, label="Seam: the picture's first tokens recomputed", elem_id="image-seam")
                run = gr.Button("Splice picture vs recompute", variant="primary", elem_id="run-image")
        metrics = gr.Markdown(elem_id="image-metrics")
        plot = gr.Plot(label="Top next tokens: spliced picture vs recomputed from pixels", elem_id="image-logits-plot")
        result = gr.JSON(label="Picture splice", elem_id="image-json")

    @page.action
    def on_image(spec, **values):
        return run_image_compose(page.registry, spec, **values)

    run.click(
        on_image,
        inputs_kwargs={"spec": page.spec, "picture": picture, "before": before, "after": after, "question": question, "seam": seam},
        outputs=[metrics, plot, result],
        api_name="compose_image",
        **page.model_bound(),
    )


def build(ctx: TabContext) -> None:
    """The Composer tab; its remedy menu goes on ``ctx`` (a Notes-tab link carries its choice)."""
    page = ctx.page
    with gr.Tab("Composer", id="composer"):
        chosen = _selectors(page)
        stale, calibration, metrics, logits, deviation = _comparison_panels()
        loop = _loop(page)
        compared = Compared(stale, calibration, metrics, logits, deviation, gr.JSON(label="Result", elem_id="compose-json"))
        study = _study()
        _picture(page)
        with gr.Row():
            export = gr.Button("Export JSON + figures", elem_id="export-compose")
            files = gr.File(label="Exported files", file_count="multiple", elem_id="compose-files")
    _wire_compose(page, chosen, compared, ComposerRuns())
    _wire_menu(page, chosen, compared, loop)
    _wire_loop(page, chosen, compared, loop)
    _wire_study(page, chosen, study)
    plots = {"logits_plot": logits, "deviation_plot": deviation, "loop_plot": loop.plot}
    page.export_on(export, "kvscope-composer", result=compared.result, plots=plots, files=files, api_name="export_composer")
    ctx.remedy = chosen.remedy
