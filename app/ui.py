"""The KVScope page: tabs, components and event wiring (computation lives in app.handlers)."""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass

import gradio as gr
import plotly.graph_objects as go
import plotly.io

from app import handlers, permalink
from app.composer import SkillComposer
from app.handlers import AppError
from app.inputs import LenientCheckboxGroup, LenientSlider
from app.state import ExportFolder, ModelRegistry, SessionStore
from engine.audit.audit import DEFAULT_MIN_AGREEMENT as AUDIT_MIN_AGREEMENT
from engine.audit.audit import DEFAULT_THRESHOLD as AUDIT_THRESHOLD
from engine.audit.audit import DEFAULT_TOKENS as AUDIT_DEFAULT_TOKENS
from engine.audit.fields import BLOCK_TOKENS as AUDIT_BLOCK
from engine.audit.repairs import GRAINS as AUDIT_GRAINS
from engine.audit.repairs import REPAIR_SUMMARIES
from engine.audit.traffic import DEFAULT_SAMPLE as AUDIT_SAMPLE
from engine.cache.budget import bounded, waits_reported
from engine.cache.decision import DECISIVE_MARGIN
from engine.compose.choice import AUTO
from engine.compose.pictures import IMAGE_QUESTION, bundled_images
from engine.compose.splice import DEFAULT_REMEDY, PLACEMENTS
from engine.compose.study import REMEDIES as STUDY_REMEDIES
from engine.edit.strategies import STRATEGIES
from engine.edit.weight_edit import METHODS as WEIGHT_METHODS
from engine.edit.weight_edit import LoraSettings
from engine.probes.analysis import DEFAULT_STRATEGIES
from engine.probes.registry import PROBES
from engine.progress import fraction
from engine.scenario import bundled_scenarios
from viz.common import figure_label, markdown_literal
from viz.learn import FIGURE_LABELS as LEARN_FIGURE_LABELS
from viz.text import glossary, remedy_words, strategy_glossary

KEYSTONE_DEMO = "keystone_safety"  # a scenario whose deciding field lives inside a spliced skill
GENERIC_QUESTION_LABEL = "none: the skills alone, then a generic yes/no question"
MODEL_GROUP = "model"  # every model-bound handler shares one queue group

INTRO = """# KVScope
See and program a model's KV cache. During prefill a model writes its conclusion about a field onto later tokens'
K/V — its *notes* — and the decision reads the notes, not the field. Edit a field and watch the decision flip (or
not), see where the notes are, and splice precompiled skills into contexts."""

LEARN_STEPS = (
    (
        "1 · The notebook",
        "A prefilled context is a *notebook*: every token's keys and values, its position and its segment. "
        "Reading a decision scores each answer after the question. Run the demo with the old and the new value of its field.",
    ),
    (
        "2 · Does editing the field alone work?",
        "Recompute only the field's K/V (`field_only`) and compare with recomputing "
        "everything after it (`full_downstream`). Where the model wrote its conclusion onto later tokens — its notes — the "
        "field-only edit keeps reading the stale notes. The result below says how much of this decision the loaded model "
        "keeps in its notes, beside the paper's figures for larger models.",
    ),
    (
        "3 · The erratum",
        "Append one salient line — `[STATE UPDATE] field -> new; overrides any earlier value and conclusion` — "
        "instead of touching the prefix. It is append-only, so a server's prefix cache stays valid.",
    ),
    (
        "4 · Splicing skills",
        "Compute a skill's K/V once, rotate its keys to new positions (values carry no position) and splice it "
        f"into a context, repaired by the composer's default remedy `{DEFAULT_REMEDY.name}`: {remedy_words(DEFAULT_REMEDY.as_dict())}. "
        "The result says how many of the skill's tokens that recomputed. Compare with a full recompute.",
    ),
)


# After "Copy link": the query the server made becomes this page's URL, copied to the clipboard (the async clipboard
# API where the page is a secure context, else a selected textarea and execCommand, e.g. a classroom server on http).
COPY_LINK_JS = """(query) => {
  if (!query) return "";
  const url = window.location.origin + window.location.pathname + query;
  const fallback = () => {
    const area = document.createElement("textarea");
    area.value = url;
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } catch (error) {}
    area.remove();
  };
  if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(url).catch(fallback);
  else fallback();
  return url;
}"""


def _progress_callback(progress: gr.Progress):
    return lambda done, total: progress(done / max(total, 1))


def _message_callback(progress: gr.Progress):
    """A message callback drawn on the outputs. Gradio shows a description only beside a progress level: a message
    that says how far its work is (``engine.progress.StepMessage``) moves the bar, any other shows at 0."""
    return lambda message: progress(fraction(message) or 0.0, desc=str(message))


def user_error(error: Exception) -> gr.Error:
    """A refusal as a Gradio toast: the message escaped (toasts render HTML), no server traceback."""
    return gr.Error(html.escape(str(error), quote=False), print_exception=False)


@dataclass
class Page:
    """What every tab shares: the server-side state and the per-browser state (a session id, the model spec)."""

    registry: ModelRegistry
    sessions: SessionStore
    exports: ExportFolder
    session: gr.State
    spec: gr.State

    def session_id(self, session: str | None) -> str:
        """The browser's session id, minted on its first action."""
        return session or self.sessions.new_id()

    def bounded(self):
        """The hosting profile's per-request budget, taking turns with other requests at the registry's gate."""
        return bounded(self.registry.profile.work_budget, self.registry.gate)

    def action(self, function):
        """A UI handler run within the request budget, with :class:`AppError` shown as a toast; the session stays usable.
        A handler given a progress tracker shows on it what it waits for at the model's gate."""

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            tracker = next((value for value in (*args, *kwargs.values()) if isinstance(value, gr.Progress)), None)
            try:
                with self.bounded(), waits_reported(_message_callback(tracker) if tracker else None):
                    return function(*args, **kwargs)
            except AppError as error:
                raise user_error(error) from error

        return wrapper

    def model_bound(self, **options) -> dict:
        """Event options of a handler that uses a shared model: one queue group, as many in flight as the profile
        allows (their forwards take turns at the gate)."""
        return {"concurrency_id": MODEL_GROUP, "concurrency_limit": self.registry.profile.concurrency, **options}


@dataclass
class NotesInputs:
    """The Notes tab's scenario, field and new value: the Probes tab runs on them too."""

    editor: gr.Code
    field: gr.Dropdown
    new_value: gr.Dropdown
    baseline: gr.Markdown
    description: gr.Markdown | None = None  # the scenario's description (the Your prompt tab's Open in Notes sets it)
    scenario_pick: gr.Dropdown | None = None  # the bundled scenario menu (cleared when another tab loads a scenario)
    stale_outputs: tuple = ()  # results that belong to the previous scenario: cleared whenever another one is loaded

    def cleared(self) -> list:
        """Updates that empty the previous scenario's results and the bundled menu (for a scenario loaded from elsewhere)."""
        return [gr.update(value=None), *[gr.update(value=None) for _ in self.stale_outputs]]


def _figure(plot, index: int) -> go.Figure | None:
    """A plot component's value as a figure (None when empty), with a clear error for one that is not a plot."""
    if plot is None or getattr(plot, "type", None) != "plotly":
        return None
    try:
        return plotly.io.from_json(plot.plot)
    except (ValueError, TypeError) as error:
        raise AppError(
            f"plot {index + 1} of this export is not a valid plotly figure ({type(error).__name__}); re-run to redraw it"
        ) from error


def _exporter(page: Page, stem: str, views: int = 0, recipe: bool = False):
    """Export a result with its plots; the last ``views`` inputs are HTML views, not plots. With ``recipe`` the input
    after the result is the recipe that computed it, and a script and a notebook that rerun it are written too."""

    def export(result, *inputs):
        made, plots_and_views = (inputs[0], inputs[1:]) if recipe else (None, inputs)
        plots, views_html = plots_and_views[: len(plots_and_views) - views], plots_and_views[len(plots_and_views) - views :]
        figures = [_figure(plot, index) for index, plot in enumerate(plots)]
        return handlers.export_files(page.exports, result, figures, stem, [view for view in views_html if view], made)

    return page.action(export)


def _model_tab(page: Page):
    """Model: load a model in a dtype; the card and the self-test. Returns the load event (the baseline follows it)."""
    with gr.Tab("Model", id="model"):
        with gr.Row():
            model_input = gr.Dropdown(
                choices=handlers.offered_models(page.registry),
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
    def on_load_model(session_value, model_spec, dtype=None, progress=gr.Progress(track_tqdm=True)):
        card, info = handlers.load_model_card(page.registry, model_spec, progress=_message_callback(progress), dtype=dtype)
        return card, info, model_spec, page.session_id(session_value), handlers.memory_markdown(page.registry, page.sessions)

    memory_refresh.click(
        lambda: handlers.memory_markdown(page.registry, page.sessions),
        None,
        server_memory,
        api_name="server_memory",
        concurrency_limit=None,
    )
    outputs = [model_card, model_json, page.spec, page.session, server_memory]
    loaded = load_button.click(
        on_load_model, [page.session, model_input, model_dtype], outputs, api_name="load_model", **page.model_bound()
    )
    return loaded, on_load_model, outputs


def _notes_tab(page: Page):
    """Notes: a scenario, a field edit, the strategy cards, frontier, context text, attention, notes map, knockout,
    export and link. Returns the inputs the Probes tab shares, and ``wire_permalink(page_loaded, remedy)``, which
    wires Copy link and the restore of a linked state once the page's model load and the composer's remedy exist."""
    scenario_names = sorted(bundled_scenarios())
    first_text = handlers.bundled_scenario_text(handlers.NOTES_SCENARIO)
    first = handlers.scenario_choices(first_text)
    heads = page.registry.get().info()["attention_heads"]
    with gr.Tab("Notes", id="notes"):
        with gr.Row():
            with gr.Column(scale=2):
                scenario_pick = gr.Dropdown(scenario_names, value=handlers.NOTES_SCENARIO, label="Bundled scenario", elem_id="scenario")
                upload = gr.File(label="…or upload a scenario TOML", file_types=[".toml"], type="filepath", elem_id="scenario-upload")
                editor = gr.Code(first_text, language=None, label="Scenario (TOML, editable)", elem_id="scenario-editor", lines=14)
            with gr.Column(scale=1):
                description = gr.Markdown(first.description, elem_id="scenario-description")
                field = gr.Dropdown(first.fields, value=first.fields[0], label="Field", allow_custom_value=True, elem_id="field")
                new_value = gr.Dropdown(first.values, value=first.new, label="New value", allow_custom_value=True, elem_id="new-value")
                strategies = LenientCheckboxGroup(
                    [s for s in STRATEGIES if s not in ("stale", "oracle")],
                    value=list(DEFAULT_STRATEGIES),
                    label="Strategies",
                    info=strategy_glossary(STRATEGIES),
                    elem_id="strategies",
                )
                top_k = LenientSlider(1, 64, value=8, step=1, label="K (field_topk, knockout)", elem_id="top-k")
                separately = gr.Checkbox(
                    False, label="Time each strategy on its own (slower; default reads all in one forward)", elem_id="separately"
                )
                edit_button = gr.Button("Edit the field", variant="primary", elem_id="run-edit")
                baseline = gr.Markdown(elem_id="baseline")
        cards = gr.HTML(elem_id="strategy-cards")
        with gr.Row():
            strategy_plot = gr.Plot(label="Margins by strategy", elem_id="strategy-plot")
            frontier_plot = gr.Plot(label="Cost–quality frontier (runs after the edit)", elem_id="frontier-plot")
        notes_text = gr.HTML(label="Context coloured by notes effect", elem_id="notes-text")
        with gr.Row():
            head = LenientSlider(-1, heads - 1, value=-1, step=1, label="Attention head (-1 = mean over heads)", elem_id="head")
            all_positions = gr.Checkbox(
                False, label="Notes map: show every context position (default: the field and after)", elem_id="notes-all-positions"
            )
        with gr.Row():
            attention_plot = gr.Plot(label="Attention from the decision token", elem_id="attention-plot")
            notes_plot = gr.Plot(label="Notes map (layer × position)", elem_id="notes-plot")
        with gr.Accordion("Knockout: hide tokens from the decision", open=False):
            with gr.Row():
                knockout_positions = gr.Textbox(label="Positions (e.g. 40, 41, 57); empty = top-K notes", elem_id="knockout-positions")
                knockout_button = gr.Button("Knock out and re-read", elem_id="run-knockout")
            knockout_text = gr.Markdown(elem_id="knockout-result")
            knockout_plot = gr.Plot(label="Decision after knockout")
        edit_json = gr.JSON(label="Result", elem_id="edit-json")
        frontier_json = gr.JSON(label="Frontier", elem_id="frontier-json", visible=False)
        with gr.Row():
            with gr.Column(scale=1, min_width=200):
                notes_export = gr.Button("Export JSON, figures, script + notebook", elem_id="export-notes")
                copy_link = gr.Button("Copy link", elem_id="copy-link")
            notes_files = gr.File(label="Exported files", file_count="multiple", elem_id="notes-files", scale=2)
        link_box = gr.Textbox(label="Link to this state", info=permalink.BOUND_WORDS, elem_id="permalink", buttons=["copy"])
        link_status = gr.Markdown(elem_id="permalink-status")
        recipe = gr.State(None)  # what computed the result shown: the export writes it as a script and a notebook

    @page.action
    def on_scenario(name):
        text = handlers.bundled_scenario_text(name)
        return text, *_choices(text), *inputs.cleared()[1:]

    @page.action
    def on_upload(path):
        if not path:
            raise AppError("no file uploaded")
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        return text, *_choices(text), *inputs.cleared()

    def _choices(text, chosen_field=None):
        try:
            view = handlers.scenario_choices(text, chosen_field)
        except AppError as error:
            return f"⚠️ {markdown_literal(str(error))}", gr.update(), gr.update()
        return (
            view.description,
            gr.update(choices=view.fields, value=chosen_field if chosen_field in view.fields else view.fields[0]),
            gr.update(choices=view.values, value=view.new),
        )

    stale_outputs = (cards, strategy_plot, frontier_plot, notes_text, attention_plot, notes_plot, knockout_text, knockout_plot)
    stale_outputs += (edit_json, link_box, link_status)
    inputs = NotesInputs(editor, field, new_value, baseline, description, scenario_pick, stale_outputs)
    for event in (
        scenario_pick.input(  # a person's pick (a restored link sets the dropdown without resetting field and value)
            on_scenario, scenario_pick, [editor, description, field, new_value, *stale_outputs], api_name="scenario", concurrency_limit=None
        ),
        upload.upload(
            on_upload,
            upload,
            [editor, description, field, new_value, scenario_pick, *stale_outputs],
            api_name="upload_scenario",
            concurrency_limit=None,
        ),
        editor.blur(lambda text: _choices(text), editor, [description, field, new_value], api_name=False, concurrency_limit=None),
    ):
        _then_prepare(page, event, inputs)
    field.input(lambda text, f: _choices(text, f)[2], [editor, field], new_value, api_name=False, concurrency_limit=None)

    def edit(
        session_value,
        model_spec,
        text,
        field_name,
        value,
        chosen,
        k,
        head_index,
        one_by_one=False,
        every_position=False,
        progress=gr.Progress(),
    ):
        sid = page.session_id(session_value)
        head_index = handlers.number(head_index, "attention head", -1)
        view = handlers.run_edit(
            page.registry,
            page.sessions,
            sid,
            model_spec,
            text,
            field_name,
            value,
            chosen or [],
            k,
            None if head_index < 0 else head_index,
            progress=_progress_callback(progress),
            separately=bool(one_by_one),
            all_positions=bool(every_position),
        )
        made = handlers.edit_recipe(
            page.registry,
            page.sessions,
            sid,
            model_spec,
            text,
            chosen or [],
            separately=bool(one_by_one),
            head=None if head_index < 0 else head_index,
            all_positions=bool(every_position),
        )
        return (view.cards_html, view.strategy_figure, view.text_html, view.attention_figure, view.notes_figure, view.summary, sid, made)

    on_edit = page.action(edit)

    @page.action
    def on_frontier(session_value, progress=gr.Progress()):
        return handlers.run_frontier(page.sessions, page.session_id(session_value), progress=_progress_callback(progress))

    edit_outputs = [cards, strategy_plot, notes_text, attention_plot, notes_plot, edit_json, page.session, recipe]
    edit_button.click(
        on_edit,
        [page.session, page.spec, editor, field, new_value, strategies, top_k, head, separately, all_positions],
        edit_outputs,
        api_name="edit",
        **page.model_bound(),
    ).success(on_frontier, page.session, [frontier_plot, frontier_json], api_name="frontier", **page.model_bound())
    all_positions.change(
        lambda session_value, every: handlers.notes_map_view(page.sessions, page.session_id(session_value), every),
        [page.session, all_positions],
        notes_plot,
        api_name=False,
        concurrency_limit=None,
    )

    @page.action
    def on_knockout(session_value, positions, k, made=None):
        sid = page.session_id(session_value)
        text, figure, data = handlers.run_knockout(page.sessions, sid, positions, k)
        return text, figure, data, sid, handlers.knockout_recipe(made, data["positions"])

    knockout_button.click(
        on_knockout,
        [page.session, knockout_positions, top_k, recipe],
        [knockout_text, knockout_plot, edit_json, page.session, recipe],
        api_name="knockout",
        **page.model_bound(),
    )
    notes_export.click(
        _exporter(page, "kvscope-notes", views=1, recipe=True),
        [edit_json, recipe, strategy_plot, frontier_plot, attention_plot, notes_plot, notes_text],
        notes_files,
        api_name="export_notes",
        concurrency_limit=None,
    )

    def wire_permalink(page_loaded, remedy: gr.Dropdown, tabs: gr.Tabs) -> None:
        """Copy link writes this tab's state (and the composer's remedy) as a link; a page opened from one restores
        it after its model load on the Notes tab, prepares the scenario and runs the edit, so the results show."""
        offered = [s for s in STRATEGIES if s not in ("stale", "oracle")]

        def on_link(text, hint, field_name, value, chosen, k, head_index, remedy_spec, one_by_one, every_position):
            try:
                query = permalink.link_query(
                    text, hint, field_name, value, chosen, k, head_index, remedy_spec, bool(one_by_one), bool(every_position)
                )
            except AppError as error:
                return "", f"⚠️ {markdown_literal(str(error))}"
            return query, "Copied where the browser allows it: the link opens this scenario, field, value and strategies and runs the edit."

        copy_link.click(
            on_link,
            [editor, scenario_pick, field, new_value, strategies, top_k, head, remedy, separately, all_positions],
            [link_box, link_status],
            api_name="permalink",
            concurrency_limit=None,
        ).then(None, link_box, link_box, js=COPY_LINK_JS, api_name=False, concurrency_limit=None)

        restored = gr.State(None)  # the link's state, once parsed
        restore_outputs = [scenario_pick, editor, description, field, new_value, strategies, top_k, head, separately, all_positions]
        restore_outputs += [tabs, remedy, link_status, restored]

        def on_restore(request: gr.Request):
            unchanged = [gr.update()] * (len(restore_outputs) - 2)
            try:
                link = permalink.parse_link(
                    dict(request.query_params) if request is not None else {},
                    offered_strategies=offered,
                    default_strategies=DEFAULT_STRATEGIES,
                    heads=heads,
                    profile=page.registry.profile,
                )
                if link is None:
                    return (*unchanged, gr.update(), None)
                view = handlers.scenario_choices(link.text, link.field)
            except AppError as error:
                gr.Warning(html.escape(f"This link cannot be restored: {error}", quote=False))  # a toast: the status is far below
                return (*unchanged, f"⚠️ This link cannot be restored: {markdown_literal(str(error))}. The page shows its defaults.", None)
            ignored = f" (not KVScope's, ignored: {', '.join(link.ignored)})" if link.ignored else ""
            return (
                gr.update(value=link.scenario),  # none for a scenario carried in the link: the editor holds it
                link.text,
                view.description,
                gr.update(choices=view.fields, value=link.field),
                gr.update(choices=list(dict.fromkeys([*view.values, link.value])), value=link.value),
                list(link.strategies),
                link.k,
                link.head,
                link.separately,
                link.all_positions,
                gr.Tabs(selected="notes"),  # the tab the link restores
                gr.update(value=link.remedy) if link.remedy else gr.update(),
                f"Restored from the link: {markdown_literal(link.summary() + ignored)}.",
                link,
            )

        def on_restored_prepare(link, model_spec, text, request: gr.Request):
            if request is None or not permalink.is_link(dict(request.query_params)):
                return gr.update()  # no link: the page's own load prepared the scenario
            return _prepare_message(page, model_spec, link.text if link else text)

        def on_restored_edit(link, session_value, model_spec, progress=gr.Progress()):
            unchanged = (gr.update(),) * len(edit_outputs)
            if link is None:
                return (*unchanged, gr.update())
            try:
                with page.bounded():
                    shown = edit(
                        session_value,
                        model_spec,
                        link.text,
                        link.field,
                        link.value,
                        list(link.strategies),
                        link.k,
                        link.head,
                        link.separately,
                        link.all_positions,
                        progress,
                    )
            except AppError as error:
                return (*unchanged, f"⚠️ The link's edit did not run: {markdown_literal(str(error))}")
            return (*shown, gr.update())

        def on_restored_frontier(link, session_value, progress=gr.Progress()):
            if link is None:
                return gr.update(), gr.update()
            try:
                with page.bounded():
                    return handlers.run_frontier(page.sessions, page.session_id(session_value), progress=_progress_callback(progress))
            except AppError:
                return gr.update(), gr.update()  # the edit's own message says why

        page_loaded.then(on_restore, None, restore_outputs, api_name=False, concurrency_limit=None).then(
            on_restored_prepare, [restored, page.spec, editor], baseline, api_name=False, **page.model_bound()
        ).then(
            on_restored_edit, [restored, page.session, page.spec], [*edit_outputs, link_status], api_name=False, **page.model_bound()
        ).then(on_restored_frontier, [restored, page.session], [frontier_plot, frontier_json], api_name=False, **page.model_bound())

    return inputs, wire_permalink


def _prepare_message(page: Page, model_spec: str, text: str) -> str:
    """Prefill the editor's scenario at its old values; the current decision, or why it cannot be prepared."""
    try:
        with page.bounded():
            return handlers.prepare_baseline(page.registry, model_spec, text)
    except AppError as error:
        return f"⚠️ {markdown_literal(str(error))}"


def _then_prepare(page: Page, event, notes: NotesInputs) -> None:
    """After ``event``, prefill the editor's scenario at its old values and state the current decision."""
    event.then(
        lambda model_spec, text: _prepare_message(page, model_spec, text),
        [page.spec, notes.editor],
        notes.baseline,
        api_name=False,
        **page.model_bound(),
    )


def _probes_tab(page: Page, notes: NotesInputs) -> None:
    """Probes: one probe (from the engine's registry) on the Notes tab's edit, with its figure."""
    with gr.Tab("Probes", id="probes"):
        gr.Markdown("Each probe runs on the scenario, field and new value chosen in the **Notes** tab.")
        with gr.Row():
            probe_name = gr.Dropdown(
                [name for name in PROBES if name != "attention"],  # attention: the Notes tab
                value="suffix",
                label="Probe",
                elem_id="probe-name",
            )
            trigger_find = gr.Textbox(label="trigger: rule text to flip", elem_id="trigger-find")
            trigger_replace = gr.Textbox(label="trigger: replacement (same token count)", elem_id="trigger-replace")
            attribution_method = gr.Radio(["ablation", "gradient"], value="ablation", label="attribution method")
            probe_button = gr.Button("Run probe", variant="primary", elem_id="run-probe")
        probe_plot = gr.Plot(label="Probe", elem_id="probe-plot")
        probe_json = gr.JSON(label="Probe result", elem_id="probe-json")
        probe_recipe = gr.State(None)  # what computed the probe shown (the export writes a script and a notebook)
        with gr.Row():
            probe_export = gr.Button("Export JSON, figure, script + notebook", elem_id="export-probe")
            probe_files = gr.File(label="Exported files", file_count="multiple", elem_id="probe-files")
        _weights_section(page, notes)

    @page.action
    def on_probe(model_spec, text, field_name, value, name, find, replacement, method, progress=gr.Progress()):
        options = {"find": find, "replace": replacement} if name == "trigger" else {"method": method} if name == "attribution" else {}
        figure, data = handlers.run_probe(
            page.registry, model_spec, text, field_name, value, name, options, progress=_progress_callback(progress)
        )
        return figure, data, handlers.probe_recipe(page.registry, model_spec, text, field_name, value, name, options)

    probe_button.click(
        on_probe,
        [page.spec, notes.editor, notes.field, notes.new_value, probe_name, trigger_find, trigger_replace, attribution_method],
        [probe_plot, probe_json, probe_recipe],
        api_name="probe",
        **page.model_bound(),
    )
    probe_export.click(
        _exporter(page, "kvscope-probe", recipe=True),
        [probe_json, probe_recipe, probe_plot],
        probe_files,
        api_name="export_probe",
        concurrency_limit=None,
    )


def _weights_section(page: Page, notes: NotesInputs) -> None:
    """Weight editing (ROME, LoRA) beside the erratum on the Notes tab's edit."""
    with gr.Accordion("Cache editing vs weight editing (ROME, LoRA, field_erratum)", open=True, elem_id="weights-section"):
        gr.Markdown(
            "Makes the model give the new-value decision for the old-value context by editing **weights** (on a private copy: "
            "the shared model never changes) or by appending an **erratum** to this request's cache, then measures each on the "
            "edited request (efficacy), the same case for three other customers (contamination) and every other bundled "
            "scenario (collateral). Weight edits train for seconds to minutes on a CPU."
        )
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
    def on_weights(model_spec, text, field_name, value, chosen, steps, layer, progress=gr.Progress()):
        figure, summary, data = handlers.run_weight_edits(
            page.registry, model_spec, text, field_name, value, chosen, steps, layer, progress=_progress_callback(progress)
        )
        return summary, figure, data

    weights_button.click(
        on_weights,
        [page.spec, notes.editor, notes.field, notes.new_value, methods, lora_steps, rome_layer],
        [weights_summary, weights_plot, weights_json],
        api_name="weights",
        **page.model_bound(),
    )


def _composer_tab(page: Page) -> gr.Dropdown:
    """Composer: skills dragged into a context, splice vs recompute, the keystone and the agent loop. Returns the
    remedy menu (a Notes-tab link carries its choice)."""
    scenario_names = sorted(bundled_scenarios())
    with gr.Tab("Composer", id="composer"):
        composer = SkillComposer(handlers.skill_library(), value=["account_gate"], elem_id="composer")
        with gr.Row():
            before = gr.Textbox(label="Text before the skills", lines=2, elem_id="text-before")
            between = gr.Textbox(label="Text between skills", lines=2, elem_id="text-between")
            after = gr.Dropdown(
                [(GENERIC_QUESTION_LABEL, ""), *[(name, name) for name in scenario_names]],
                value=handlers.NOTES_SCENARIO,
                label="Then a scenario: its context, question and answers follow the skills",
                elem_id="after-scenario",
            )
        with gr.Row():
            remedy = gr.Dropdown(
                handlers.remedy_menu(STUDY_REMEDIES),
                value=DEFAULT_REMEDY.name,
                allow_custom_value=True,
                label="Repair of the spliced skills",
                info=handlers.remedy_summary(),
                elem_id="remedy",
            )
            compose_button = gr.Button("Splice vs recompute", variant="primary", elem_id="run-compose")
            cancel_button = gr.Button("Cancel calibration", variant="stop", visible=False, elem_id="cancel-calibration")
        with gr.Accordion("What the remedies mean, and why this default", open=False, elem_id="remedy-details"):
            gr.Markdown(markdown_literal(handlers.remedy_info()), elem_id="remedy-info")
        calibration_status = gr.Markdown(elem_id="calibration-status")
        compose_metrics = gr.Markdown(elem_id="compose-metrics")
        with gr.Row():
            logits_plot = gr.Plot(label="Top next tokens: spliced vs recomputed", elem_id="logits-plot")
            deviation_plot = gr.Plot(label="K/V deviation (layer × token)", elem_id="deviation-plot")
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
            gr.Markdown(
                "The first 1, 2 … N skills of the context above (in its order) placed in the chosen scenario, at each "
                "placement, for both values of its first field; each recomputed once and spliced with every remedy. "
                f"Agreement counts only decisive cases (recomputed |margin| ≥ {DECISIVE_MARGIN}); ties are reported apart. "
                "Text before/between skills is not used here."
            )
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
            gr.Markdown(
                "The picture is encoded once (vision tower) and prefilled after the chat template's head; its K/V then "
                "move behind the text before it — keys re-rotated on M-RoPE's three axes — and the question is read. The "
                "full recompute runs the vision tower and prefills everything. Needs an M-RoPE vision-language model: "
                "choose `tiny-qwen2_vl` (random weights: exactness, not meaning) or a Qwen2-VL / Qwen2.5-VL checkpoint."
            )
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

    composition = [composer, before, between, after]

    @page.action
    def on_compose(model_spec, skill_ids, text_before, text_between, after_name, remedy_spec, progress=gr.Progress()):
        view = handlers.run_compose(
            page.registry,
            model_spec,
            skill_ids,
            text_before,
            text_between,
            after_name or None,
            remedy_spec,
            report=_message_callback(progress),
        )
        return view.metrics_markdown, view.logits_figure, view.deviation_figure, view.summary

    compared = [compose_metrics, logits_plot, deviation_plot, compose_json]
    compose_button.click(on_compose, [page.spec, *composition, remedy], compared, api_name="compose", **page.model_bound())
    # auto calibrates the model once (minutes): its progress shows on the results; Cancel stops it between two forwards
    remedy.change(lambda spec: gr.update(visible=spec == AUTO), remedy, cancel_button, api_name=False, concurrency_limit=None)
    cancel_button.click(
        page.action(lambda model_spec: handlers.stop_calibration(page.registry, model_spec)),
        [page.spec],
        [calibration_status],
        api_name="cancel_calibration",
        concurrency_limit=None,
    )
    composer.change(on_compose, [page.spec, *composition, remedy], compared, api_name=False, **page.model_bound())

    @page.action
    def on_keystone(model_spec, skill_ids, text_before, text_between, after_name, remedy_spec, progress=gr.Progress()):
        return handlers.run_keystone(
            page.registry,
            model_spec,
            skill_ids,
            text_before,
            text_between,
            after_name or None,
            remedy_spec,
            progress=_progress_callback(progress),
        )

    keystone_demo.click(lambda: ([], KEYSTONE_DEMO), None, [composer, after], api_name=False)
    keystone_button.click(
        on_keystone, [page.spec, *composition, remedy], [loop_plot, compose_json], api_name="keystone", **page.model_bound()
    )

    @page.action
    def on_agent(
        model_spec,
        skill_ids,
        text_before,
        text_between,
        after_name,
        remedy_spec,
        turn_count,
        toggled,
        compaction="adaptive",
        progress=gr.Progress(),
    ):
        return handlers.run_agent_loop(
            page.registry,
            model_spec,
            skill_ids,
            text_before,
            text_between,
            after_name or None,
            remedy_spec,
            turn_count,
            toggled,
            compaction,
            progress=_progress_callback(progress),
        )

    agent_button.click(
        on_agent,
        [page.spec, *composition, remedy, turns, toggle, policy],
        [loop_plot, compose_json],
        api_name="agent",
        **page.model_bound(),
    )

    @page.action
    def on_study(model_spec, skill_ids, after_name, chosen_placements, chosen_remedies, progress=gr.Progress()):
        return handlers.run_composition_study(
            page.registry,
            model_spec,
            skill_ids,
            after_name or None,
            chosen_placements,
            chosen_remedies,
            progress=_progress_callback(progress),
        )

    study_button.click(
        on_study,
        [page.spec, composer, after, placements, study_remedies],
        [study_plot, study_summary, study_json],
        api_name="compose_study",
        **page.model_bound(),
    )

    @page.action
    def on_image(model_spec, pixels, text_before, text_after, question, seam):
        return handlers.run_image_compose(page.registry, model_spec, pixels, text_before, text_after, question, seam)

    picture_button.click(
        on_image,
        [page.spec, picture, picture_before, picture_after, picture_question, picture_seam],
        [picture_metrics, picture_plot, picture_json],
        api_name="compose_image",
        **page.model_bound(),
    )
    compose_export.click(
        _exporter(page, "kvscope-composer"),
        [compose_json, logits_plot, deviation_plot, loop_plot],
        compose_files,
        api_name="export_composer",
        concurrency_limit=None,
    )
    return remedy


def _models_tab(page: Page, notes: NotesInputs) -> None:
    """Models: the Notes tab's scenario and edit on up to three models side by side, with the paper's 7–9B values."""
    with gr.Tab("Models", id="models"):
        gr.Markdown(
            "The Notes tab's scenario, field and new value on up to three models: notes share and the recovery of "
            "field_only, erratum and field_erratum; where the notes are written (relative depth of the notes map's strongest "
            "cells); how many read heads carry the decision; one skill's splice cosine. Models load one after another; "
            "the server drops what no longer fits its memory budget and says so below."
        )
        with gr.Row():
            chosen = gr.Dropdown(
                choices=handlers.offered_models(page.registry),
                value=[page.registry.default_spec],
                multiselect=True,
                max_choices=3,
                allow_custom_value=page.registry.profile.allowed_models is None,
                label="Models (up to 3)",
                elem_id="compare-models",
                scale=4,
            )
            run = gr.Button("Compare models", variant="primary", elem_id="compare-run", scale=1)
        summary = gr.Markdown(elem_id="compare-summary")
        share_plot = gr.Plot(label="Notes share against model size, beside the paper's 7–9B models", elem_id="compare-share")
        metrics_plot = gr.Plot(label="Recoveries, notes depth, read heads and splice cosine per model", elem_id="compare-metrics")
        result_json = gr.JSON(label="Comparison", elem_id="compare-json")

    @page.action
    def on_compare(models, text, field_name, value, progress=gr.Progress()):
        state = {"fraction": 0.0, "desc": "comparing models"}

        def step(done, total):
            state["fraction"] = done / max(total, 1)
            progress(state["fraction"], desc=state["desc"])

        def message(note):
            state["desc"] = note
            progress(state["fraction"], desc=note)

        view = handlers.run_model_comparison(page.registry, models, text, field_name, value, progress=step, messages=message)
        return view.summary, view.share_figure, view.metrics_figure, view.result

    run.click(
        on_compare,
        [chosen, notes.editor, notes.field, notes.new_value],
        [summary, share_plot, metrics_plot, result_json],
        api_name="compare_models",
        **page.model_bound(),
    )


AUDIT_INTRO = """Paste a request log as your server or gateway records it (OpenAI chat, completions or Responses requests,
Anthropic Messages, ShareGPT, gateway records or batch lines; one JSON object a line, or a JSON array), upload one, or pick a
demo. A token pass covers every request, rendered with the loaded model's own chat template (tools included): each is matched
with the earlier request it shares the longest prefix with, sessions are kept apart, each miss gets its cause (a clock, an id,
tools changed, a prefix ending mid-block…), and three engines' caches are simulated (vLLM blocks, SGLang's radix tree,
llama.cpp's slots). Turns are grouped by what changed; the model then measures every repair on up to *K* turns of each group
against a clean prefill of the new request (next-token KL, top-1, N greedy tokens) and recommends the cheapest within your
threshold. Malformed records are skipped and named. For one prompt, open *One prompt* below and change a value."""
OPEN_IN_NOTES_JS = "() => { const button = document.querySelector('#run-edit'); if (button) { button.click(); } }"


def _your_prompt_tab(page: Page, notes: NotesInputs, tabs: gr.Tabs) -> None:
    """Your prompt: a request log (or one prompt and a new value) audited for mutable fields in cached prefixes, every
    repair measured; Open in Notes runs the edit, the notes map and knockout on it."""
    profile = page.registry.profile
    most_tokens = profile.max_audit_tokens or 128
    with gr.Tab("Your prompt", id="your-prompt"):
        gr.Markdown(AUDIT_INTRO)
        with gr.Row():
            with gr.Column(scale=2):
                with gr.Row():
                    demo = gr.Dropdown(list(handlers.bundled_logs()), value=None, label="Bundled demo log", elem_id="audit-demo")
                    upload = gr.File(
                        label="…or upload a log or a prompt",
                        file_types=[".jsonl", ".json", ".txt"],
                        type="filepath",
                        elem_id="audit-upload",
                    )
                log_text = gr.Textbox(
                    label="Request log (JSONL or a JSON array of requests), or one prompt (text or messages JSON)",
                    lines=12,
                    max_lines=24,
                    elem_id="audit-input",
                )
            with gr.Column(scale=1):
                repairs = LenientCheckboxGroup(
                    handlers.AUDIT_REPAIRS,
                    value=handlers.AUDIT_REPAIRS,
                    label="Repairs (recompute, the exact reference, always runs)",
                    info=glossary(REPAIR_SUMMARIES),
                    elem_id="audit-repairs",
                )
                tokens = LenientSlider(
                    1,
                    most_tokens,
                    value=min(AUDIT_DEFAULT_TOKENS, most_tokens),
                    step=1,
                    label="N: greedy tokens per state",
                    elem_id="audit-tokens",
                )
                threshold = gr.Number(AUDIT_THRESHOLD, label="KL threshold (nats, next token)", elem_id="audit-threshold")
                min_agreement = LenientSlider(
                    0,
                    1,
                    value=AUDIT_MIN_AGREEMENT,
                    step=0.05,
                    label="Minimum share of greedy tokens agreeing",
                    elem_id="audit-min-agreement",
                )
                grain = gr.Dropdown(["none", *AUDIT_GRAINS], value="none", label="coarsen: the date-time grain", elem_id="audit-grain")
                sample = LenientSlider(
                    0,
                    10,
                    value=AUDIT_SAMPLE,
                    step=1,
                    label="--sample K: turns the model measures per change signature (0: the token pass only)",
                    elem_id="audit-sample",
                )
                with gr.Accordion("Simulated engines", open=False, elem_id="audit-engine-settings"):
                    block = gr.Number(AUDIT_BLOCK, precision=0, label="vLLM block size (tokens)", elem_id="audit-block")
                    budget_blocks = gr.Number(0, precision=0, label="vLLM block budget (0: unbounded)", elem_id="audit-budget-blocks")
                    budget_tokens = gr.Number(0, precision=0, label="SGLang token budget (0: unbounded)", elem_id="audit-budget-tokens")
                    cache_reuse = gr.Number(0, precision=0, label="llama.cpp --cache-reuse N (0: off)", elem_id="audit-cache-reuse")
                audit_button = gr.Button("Audit the log", variant="primary", elem_id="run-audit")
        with gr.Accordion("One prompt: change a value", open=False, elem_id="audit-one-prompt"):
            gr.Markdown(
                "Paste one prompt above (plain text is one user message). *Find volatile spans* marks dates and times, ids, hex "
                "strings, numbers and `key: value` values in the rendered prompt; pick one (or type the text to change), type "
                "its new value and audit the prompt as cached against the prompt as it arrives."
            )
            find_button = gr.Button("Find volatile spans", elem_id="audit-find-spans")
            candidates_view = gr.HTML(elem_id="audit-candidates")
            with gr.Row():
                choice = gr.Dropdown([], value=None, label="Candidate span", elem_id="audit-choice")
                find = gr.Textbox(label="…or the text to change (its first occurrence)", elem_id="audit-find")
                new_value = gr.Textbox(label="New value", elem_id="audit-new-value")
                value_button = gr.Button("Audit this change", variant="primary", elem_id="run-audit-value")
        traffic_view = gr.Markdown(elem_id="audit-traffic")
        with gr.Row():
            sessions_plot = gr.Plot(label="Requests per session", elem_id="audit-sessions", min_width=560)
            engines_plot = gr.Plot(label="Tokens each engine reuses", elem_id="audit-engines", min_width=560)
        groups_view = gr.Markdown(elem_id="audit-groups")
        recommendation = gr.Markdown(elem_id="audit-recommendation")
        with gr.Row():
            timeline_plot = gr.Plot(label="Reused fraction per turn", elem_id="audit-timeline")
            fidelity_plot = gr.Plot(label="Fidelity against cost", elem_id="audit-fidelity")
        with gr.Row():
            x_axis = gr.Radio([("computed tokens", "computed"), ("TTFT speed-up", "ttft")], value="computed", label="x", elem_id="audit-x")
            y_axis = gr.Radio([("KL divergence", "kl"), ("greedy agreement", "agreement")], value="kl", label="y", elem_id="audit-y")
        prompt_view = gr.HTML(elem_id="audit-prompt")
        with gr.Row():
            labels = gr.Textbox(
                "",
                label="Two answer labels the Notes tab reads (comma-separated; empty: the model's own answers, read when auditing)",
                elem_id="audit-labels",
                scale=2,
            )
            open_notes = gr.Button("Open in Notes", elem_id="audit-open-notes", scale=1)
        open_status = gr.Markdown(elem_id="audit-open-status")
        audit_json = gr.JSON(label="Audit", elem_id="audit-json")
        with gr.Accordion("Measure a rewrite of this log: a linter's rewritten log, or your new prompt template", open=False):
            gr.Markdown(
                "Same requests, same order. Each engine's reuse before and after, and each rewritten prompt's output against "
                "the original's clean prefill (next-token KL, top-1, top-5, the N greedy tokens, the same text or not)."
            )
            with gr.Row():
                rewritten_text = gr.Textbox(
                    label="Rewritten log (JSONL), or a prompt template", lines=6, elem_id="audit-rewritten", scale=3
                )
                with gr.Column(scale=1):
                    as_template = gr.Checkbox(
                        False, label="It is a prompt template ({placeholders}, as Export writes)", elem_id="audit-as-template"
                    )
                    rewrite_button = gr.Button("Measure the rewrite", variant="primary", elem_id="run-rewrite")
            rewrite_view = gr.Markdown(elem_id="audit-rewrite")
            rewrite_json = gr.JSON(label="Rewrite", elem_id="audit-rewrite-json")
        with gr.Row():
            export_button = gr.Button("Export JSON, figures, scenario TOML + repaired template", elem_id="export-audit")
            export_files = gr.File(label="Exported files", file_count="multiple", elem_id="audit-files")

    demo.input(page.action(handlers.bundled_log_text), demo, log_text, api_name="audit_demo", concurrency_limit=None)

    @page.action
    def on_upload(path):
        if not path:
            raise AppError("no file uploaded")
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    upload.upload(on_upload, upload, log_text, api_name="audit_upload", concurrency_limit=None)

    settings = [repairs, tokens, threshold, min_agreement, grain, x_axis, y_axis]
    traffic_settings = [sample, block, budget_blocks, budget_tokens, cache_reuse]
    shown = [recommendation, timeline_plot, fidelity_plot, prompt_view, audit_json, open_status]
    shown += [traffic_view, sessions_plot, engines_plot, groups_view, page.session]

    def _shown(view, sid):
        figures = view.timeline_figure, view.fidelity_figure
        traffic = view.traffic_markdown, view.sessions_figure, view.engines_figure, view.groups_markdown
        return view.recommendation_markdown, *figures, view.prompt_html, view.summary, view.notes_markdown, *traffic, sid

    @page.action
    def on_audit(
        session_value, model_spec, text, chosen, n, kl, agreement, coarse, x, y, k, size, blocks, budget, reuse, progress=gr.Progress()
    ):
        sid = page.session_id(session_value)
        view = handlers.run_audit(
            page.registry,
            page.sessions,
            sid,
            model_spec,
            text,
            chosen,
            n,
            kl,
            agreement,
            None if coarse == "none" else coarse,
            x,
            y,
            k,
            handlers.engine_settings(size, blocks, budget, reuse),
            progress=_message_callback(progress),
        )
        return _shown(view, sid)

    audit_inputs = [page.session, page.spec, log_text, *settings, *traffic_settings]
    audit_button.click(on_audit, audit_inputs, shown, api_name="audit", **page.model_bound())

    @page.action
    def on_candidates(model_spec, text):
        view, choices = handlers.prompt_candidates(page.registry, model_spec, text)
        return view, gr.update(choices=choices, value=choices[0] if choices else None)

    find_button.click(on_candidates, [page.spec, log_text], [candidates_view, choice], api_name="audit_candidates", **page.model_bound())

    @page.action
    def on_audit_value(
        session_value, model_spec, text, picked, found, value, chosen, n, kl, agreement, coarse, x, y, progress=gr.Progress()
    ):
        sid = page.session_id(session_value)
        view = handlers.run_audit_value(
            page.registry,
            page.sessions,
            sid,
            model_spec,
            text,
            picked,
            found,
            value,
            chosen,
            n,
            kl,
            agreement,
            None if coarse == "none" else coarse,
            x,
            y,
            progress=_progress_callback(progress),
        )
        return _shown(view, sid)

    value_button.click(
        on_audit_value,
        [page.session, page.spec, log_text, choice, find, new_value, *settings],
        shown,
        api_name="audit_value",
        **page.model_bound(),
    )
    for axis in (x_axis, y_axis):
        axis.change(
            lambda session_value, x, y: handlers.audit_fidelity_view(page.sessions, page.session_id(session_value), x, y),
            [page.session, x_axis, y_axis],
            fidelity_plot,
            api_name="audit_axes" if axis is x_axis else False,
            concurrency_limit=None,
        )

    @page.action
    def on_open(session_value, answer_labels):
        text, view = handlers.audit_notes_scenario(page.sessions, page.session_id(session_value), answer_labels)
        status = (
            f"Loaded into the Notes tab: field *{markdown_literal(view.fields[0])}* → {markdown_literal(view.new)}; "
            "the scenario is prepared and the edit runs there (its cards, frontier and notes map; knockout acts on it)."
        )
        return (
            text,
            view.description,
            gr.update(choices=view.fields, value=view.fields[0]),
            gr.update(choices=view.values, value=view.new),
            gr.Tabs(selected="notes"),
            status,
            *notes.cleared(),
        )

    open_outputs = [notes.editor, notes.description, notes.field, notes.new_value, tabs, open_status]
    open_outputs += [notes.scenario_pick, *notes.stale_outputs]
    open_notes.click(on_open, [page.session, labels], open_outputs, api_name="audit_open_in_notes", concurrency_limit=None).success(
        lambda model_spec, text: _prepare_message(page, model_spec, text),
        [page.spec, notes.editor],
        notes.baseline,
        api_name=False,
        **page.model_bound(),
    ).success(None, None, None, js=OPEN_IN_NOTES_JS, api_name=False)

    @page.action
    def on_rewrite(model_spec, text, rewritten, template, n, progress=gr.Progress()):
        return handlers.run_rewrite(page.registry, model_spec, text, rewritten, bool(template), n, progress=_progress_callback(progress))

    rewrite_button.click(
        on_rewrite,
        [page.spec, log_text, rewritten_text, as_template, tokens],
        [rewrite_view, rewrite_json],
        api_name="audit_rewrite",
        **page.model_bound(),
    )

    @page.action
    def on_export(session_value, x, y):
        return handlers.export_audit(page.exports, page.sessions, page.session_id(session_value), x, y)

    export_button.click(on_export, [page.session, x_axis, y_axis], export_files, api_name="export_audit", concurrency_limit=None)


def _benchmarks_tab(page: Page) -> None:
    """Benchmarks: figures of the stored results, and a quick live TTFT check."""
    with gr.Tab("Benchmarks", id="benchmarks"):
        gr.Markdown("Results written by the scripts under `benchmarks/` (JSON in `benchmarks/results/`).")
        bench_refresh = gr.Button("Show stored results", elem_id="bench-refresh")
        bench_quick = gr.Button("Run a quick TTFT check live (2 lengths)", elem_id="bench-quick")
        bench_plots = [gr.Plot(label="Stored result", visible=False, elem_id=f"bench-plot-{index}") for index in range(24)]
        bench_json = gr.JSON(label="Results")

    def show_benchmarks(results):
        figures = handlers.benchmark_figures_for(results)[: len(bench_plots)]
        updates = [gr.update(value=f, visible=True, label=figure_label(f)) for f in figures]
        updates += [gr.update(visible=False)] * (len(bench_plots) - len(figures))
        return (*updates, results)

    bench_refresh.click(
        lambda: show_benchmarks(handlers.benchmark_results()),
        None,
        [*bench_plots, bench_json],
        api_name="benchmarks",
        concurrency_limit=None,
    )

    @page.action
    def on_quick(model_spec, progress=gr.Progress()):
        return show_benchmarks({"ttft-live": handlers.quick_ttft(page.registry, model_spec, progress=_progress_callback(progress))})

    bench_quick.click(on_quick, page.spec, [*bench_plots, bench_json], api_name="benchmark_quick", **page.model_bound())


def _learn_tab(page: Page) -> None:
    """Learn: the classroom walkthrough, one button per step."""

    def on_step(index: int, session_value, model_spec):
        sid = page.session_id(session_value)
        return (*handlers.learn_step(page.registry, page.sessions, sid, index, model_spec), sid)

    with gr.Tab("Learn", id="learn"):
        for index, (title, text) in enumerate(LEARN_STEPS):
            with gr.Group():
                gr.Markdown(f"### {title}\n{text}")
                button = gr.Button(f"Run step {index + 1}", elem_id=f"learn-{index + 1}")
                result_md = gr.HTML(elem_id=f"learn-{index + 1}-result")
                result_plot = gr.Plot(label=LEARN_FIGURE_LABELS[index], elem_id=f"learn-{index + 1}-plot")
            button.click(
                page.action(functools.partial(on_step, index)),
                [page.session, page.spec],
                [result_md, result_plot, page.session],
                api_name=f"learn_{index + 1}",
                **page.model_bound(),
            )


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
        with gr.Tabs(selected="notes") as tabs:  # a first visit opens on the Notes tab; the model card is one click away
            model_loaded, on_load_model, model_outputs = _model_tab(page)
            notes, wire_permalink = _notes_tab(page)
            _your_prompt_tab(page, notes, tabs)
            _probes_tab(page, notes)
            _models_tab(page, notes)
            remedy = _composer_tab(page)
            _benchmarks_tab(page)
            _learn_tab(page)
        _then_prepare(page, model_loaded, notes)
        page_loaded = blocks.load(on_load_model, [page.session, page.spec], model_outputs, api_name=False, **page.model_bound())
        wire_permalink(page_loaded, remedy, tabs)

        def prepare_on_load(model_spec, text, request: gr.Request):
            if request is not None and permalink.is_link(dict(request.query_params)):
                return gr.update()  # a link's scenario is prepared once it is restored
            return _prepare_message(page, model_spec, text)

        blocks.load(
            prepare_on_load,
            [page.spec, notes.editor],
            notes.baseline,
            api_name="prepare",
            **page.model_bound(),
        )
    return blocks
