"""Notes: a scenario, a field edit, the strategy cards, frontier, context text, attention, notes map, knockout, export
and a link to this state (Copy link; a page opened from one restores it and runs the edit)."""

from __future__ import annotations

import dataclasses
import html
from dataclasses import dataclass

import gradio as gr

from kvscope.app import permalink
from kvscope.app.handlers.common import NOTES_SCENARIO, AppError, bundled_scenario_text, scenario_choices
from kvscope.app.handlers.notes import (
    OFFERED_STRATEGIES,
    EditInputs,
    edit_recipe,
    frontier_recipe,
    knockout_recipe,
    notes_map_view,
    run_edit,
    run_frontier,
    run_knockout,
    session_result,
)
from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider
from kvscope.app.page import PAIRED_PLOT_MIN_WIDTH, UI_ONLY, Page, step_progress
from kvscope.app.tabs import TabContext
from kvscope.engine import DEFAULT_STRATEGIES, STRATEGIES, bundled_scenarios
from kvscope.viz.common import markdown_literal
from kvscope.viz.text import strategy_glossary

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


@dataclass
class NotesInputs:
    """The Notes tab's scenario, field and new value (the Probes and Models tabs run on them too), and what a scenario
    loaded from another tab updates."""

    editor: gr.Code
    field: gr.Dropdown
    new_value: gr.Dropdown
    baseline: gr.Markdown
    description: gr.Markdown
    scenario_pick: gr.Dropdown  # the bundled scenario menu (cleared when another tab loads a scenario)
    stale_outputs: tuple  # results that belong to the previous scenario: cleared whenever another one is loaded

    def case(self) -> dict:
        """The scenario, field and new value as event inputs by name."""
        return {"text": self.editor, "field": self.field, "new": self.new_value}

    def cleared(self) -> list:
        """Updates that empty the previous scenario's results and the bundled menu (for a scenario loaded from elsewhere)."""
        return [gr.update(value=None), *[gr.update(value=None) for _ in self.stale_outputs]]

    def prepare_after(self, page: Page, event) -> None:
        """After ``event``, prefill the editor's scenario at its old values and state the current decision."""
        page.then_prepare(event, self.editor, self.baseline)


def _choices(text: str, chosen_field: str | None = None) -> tuple:
    """The description, field menu and value menu of the editor's scenario (a warning where it does not parse)."""
    try:
        view = scenario_choices(text, chosen_field)
    except AppError as error:
        return f"⚠️ {markdown_literal(str(error))}", gr.update(), gr.update()
    return (
        view.description,
        gr.update(choices=view.fields, value=chosen_field if chosen_field in view.fields else view.fields[0]),
        gr.update(choices=view.values, value=view.new),
    )


def build(ctx: TabContext) -> None:
    """The Notes tab: its scenario, field and value go on ``ctx.notes``; Copy link and a link's restore are wired once
    the page's load event and the composer's remedy exist."""
    tab = NotesTab(ctx.page)
    ctx.notes = tab.inputs
    ctx.on_page_load.append(lambda page_loaded: tab.wire_permalink(page_loaded, ctx.remedy, ctx.tabs))


class NotesTab:
    """The Notes tab's components and events; :meth:`wire_permalink` wires Copy link and the restore of a linked state
    once the page's model load and the composer's remedy exist."""

    def __init__(self, page: Page) -> None:
        self.page = page
        first_text = bundled_scenario_text(NOTES_SCENARIO)
        self.heads = page.registry.get().info()["attention_heads"]
        with gr.Tab("Notes", id="notes"):
            with gr.Row():
                with gr.Column(scale=2):
                    pick, upload, editor = self._scenario_column(first_text)
                with gr.Column(scale=1):
                    description, field, new_value, edit_button, baseline = self._edit_column(scenario_choices(first_text))
            self._result_views()
            self._knockout_views()
            self._export_views()
            self.recipe = gr.State(None)  # what computed the result shown: the export writes it as a script and a notebook

        stale = (self.cards, self.strategy_plot, self.frontier_plot, self.notes_text, self.attention_plot, self.notes_plot)
        stale += (self.knockout_text, self.knockout_plot, self.edit_json, self.link_box, self.link_status)
        self.inputs = NotesInputs(editor, field, new_value, baseline, description, pick, stale)
        self.edit_outputs = [self.cards, self.strategy_plot, self.notes_text, self.attention_plot, self.notes_plot, self.edit_json]
        self.edit_outputs += [page.session, self.recipe]
        self._wire_scenario(upload)
        self._wire_edit(edit_button, self.notes_plot)
        self._wire_knockout()
        self._wire_export()

    # ------------------------------------------------------------------------ layout
    def _scenario_column(self, first_text: str) -> tuple[gr.Dropdown, gr.File, gr.Code]:
        """The bundled menu, the upload and the editor."""
        pick = gr.Dropdown(sorted(bundled_scenarios()), value=NOTES_SCENARIO, label="Bundled scenario", elem_id="scenario")
        upload = gr.File(label="…or upload a scenario TOML", file_types=[".toml"], type="filepath", elem_id="scenario-upload")
        editor = gr.Code(first_text, language=None, label="Scenario (TOML, editable)", elem_id="scenario-editor", lines=14)
        return pick, upload, editor

    def _edit_column(self, first) -> tuple[gr.Markdown, gr.Dropdown, gr.Dropdown, gr.Button, gr.Markdown]:
        """The scenario's description, field and value menus, the strategies and settings, the edit button and the
        current decision."""
        description = gr.Markdown(first.description, elem_id="scenario-description")
        field = gr.Dropdown(first.fields, value=first.fields[0], label="Field", allow_custom_value=True, elem_id="field")
        new_value = gr.Dropdown(first.values, value=first.new, label="New value", allow_custom_value=True, elem_id="new-value")
        self.strategies = LenientCheckboxGroup(
            OFFERED_STRATEGIES, value=list(DEFAULT_STRATEGIES), label="Strategies", info=strategy_glossary(STRATEGIES), elem_id="strategies"
        )
        self.top_k = LenientSlider(1, 64, value=8, step=1, label="K (field_topk, knockout)", elem_id="top-k")
        self.separately = gr.Checkbox(
            False, label="Time each strategy on its own (slower; default reads all in one forward)", elem_id="separately"
        )
        edit_button = gr.Button("Edit the field", variant="primary", elem_id="run-edit")
        return description, field, new_value, edit_button, gr.Markdown(elem_id="baseline")

    def _result_views(self) -> None:
        """The cards, the strategy and frontier figures, the coloured context, the attention and the notes map."""
        self.cards = gr.HTML(elem_id="strategy-cards")
        with gr.Row():
            self.strategy_plot = gr.Plot(label="Margins by strategy", elem_id="strategy-plot", min_width=PAIRED_PLOT_MIN_WIDTH)
            self.frontier_plot = gr.Plot(
                label="Cost–quality frontier (runs after the edit)", elem_id="frontier-plot", min_width=PAIRED_PLOT_MIN_WIDTH
            )
        self.notes_text = gr.HTML(label="Context coloured by notes effect", elem_id="notes-text")
        with gr.Row():
            self.head = LenientSlider(-1, self.heads - 1, value=-1, step=1, label="Attention head (-1 = mean over heads)", elem_id="head")
            self.all_positions = gr.Checkbox(
                False, label="Notes map: show every context position (default: the field and after)", elem_id="notes-all-positions"
            )
        with gr.Row():
            self.attention_plot = gr.Plot(
                label="Attention from the decision token", elem_id="attention-plot", min_width=PAIRED_PLOT_MIN_WIDTH
            )
            self.notes_plot = gr.Plot(label="Notes map (layer × position)", elem_id="notes-plot", min_width=PAIRED_PLOT_MIN_WIDTH)

    def _knockout_views(self) -> None:
        with gr.Accordion("Knockout: hide tokens from the decision", open=False):
            with gr.Row():
                self.knockout_positions = gr.Textbox(label="Positions (e.g. 40, 41, 57); empty = top-K notes", elem_id="knockout-positions")
                self.knockout_button = gr.Button("Knock out and re-read", elem_id="run-knockout")
            self.knockout_text = gr.Markdown(elem_id="knockout-result")
            self.knockout_plot = gr.Plot(label="Decision after knockout", elem_id="knockout-plot")

    def _export_views(self) -> None:
        """The session's result, the export and the link to this state."""
        self.edit_json = gr.JSON(label="Result", elem_id="edit-json")
        self.frontier_json = gr.JSON(label="Frontier", elem_id="frontier-json", visible=False)
        with gr.Row():
            with gr.Column(scale=1, min_width=200):
                self.notes_export = gr.Button("Export JSON, figures, script + notebook", elem_id="export-notes")
                self.copy_link = gr.Button("Copy link", elem_id="copy-link")
            self.notes_files = gr.File(label="Exported files", file_count="multiple", elem_id="notes-files", scale=2)
        self.link_box = gr.Textbox(label="Link to this state", info=permalink.BOUND_WORDS, elem_id="permalink", buttons=["copy"])
        self.link_status = gr.Markdown(elem_id="permalink-status")

    def _wire_knockout(self) -> None:
        page = self.page
        self.knockout_button.click(
            page.action(self.on_knockout),
            inputs_kwargs={"session": page.session, "positions": self.knockout_positions, "top_k": self.top_k, "made": self.recipe},
            outputs=[self.knockout_text, self.knockout_plot, self.edit_json, page.session, self.recipe],
            api_name="knockout",
            **page.model_bound(),
        )

    def _wire_export(self) -> None:
        plots = {
            "strategy_plot": self.strategy_plot,
            "frontier_plot": self.frontier_plot,
            "attention_plot": self.attention_plot,
            "notes_plot": self.notes_plot,
            "knockout_plot": self.knockout_plot,
        }
        self.page.export_on(
            self.notes_export,
            "kvscope-notes",
            result=self.edit_json,
            recipe=self.recipe,
            plots=plots,
            views={"notes_text": self.notes_text},
            files=self.notes_files,
            api_name="export_notes",
        )

    @property
    def frontier_outputs(self) -> list:
        """The frontier's figure and JSON, the session's result with it, and the recipe."""
        return [self.frontier_plot, self.frontier_json, self.edit_json, self.recipe]

    def edit_inputs(self) -> dict:
        """Every input of an edit, by :class:`EditInputs` field name (its components in the fields' order)."""
        inputs = self.inputs
        edited = (inputs.editor, inputs.field, inputs.new_value)
        components = (*edited, self.strategies, self.top_k, self.head, self.separately, self.all_positions)
        return dict(zip((field.name for field in dataclasses.fields(EditInputs)), components, strict=True))

    # ------------------------------------------------------------------------ scenario
    def _wire_scenario(self, upload: gr.File) -> None:
        page, inputs = self.page, self.inputs
        stale = list(inputs.stale_outputs)

        @page.action
        def on_scenario(name):
            text = bundled_scenario_text(name)
            return text, *_choices(text), *inputs.cleared()[1:]

        @page.action
        def on_upload(path):
            if not path:
                raise AppError("no file uploaded")
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
            return text, *_choices(text), *inputs.cleared()

        shown = [inputs.editor, inputs.description, inputs.field, inputs.new_value]
        for event in (
            inputs.scenario_pick.input(  # a person's pick (a restored link sets the menu without resetting field and value)
                on_scenario,
                inputs_kwargs={"name": inputs.scenario_pick},
                outputs=[*shown, *stale],
                api_name="scenario",
                concurrency_limit=None,
            ),
            upload.upload(
                on_upload,
                inputs_kwargs={"path": upload},
                outputs=[*shown, inputs.scenario_pick, *stale],
                api_name="upload_scenario",
                concurrency_limit=None,
            ),
            inputs.editor.blur(
                lambda text: _choices(text),
                inputs_kwargs={"text": inputs.editor},
                outputs=shown[1:],
                **UI_ONLY,
            ),
        ):
            inputs.prepare_after(page, event)
        inputs.field.input(
            lambda text, field: _choices(text, field)[2],
            inputs_kwargs={"text": inputs.editor, "field": inputs.field},
            outputs=inputs.new_value,
            **UI_ONLY,
        )

    # ------------------------------------------------------------------------ edit, frontier, notes map, knockout
    def edit(self, session: str | None, spec: str | None, edit: EditInputs, progress: gr.Progress) -> tuple:
        """Run the edit and build the values of :attr:`edit_outputs` (the session id minted here, the recipe kept)."""
        page = self.page
        sid = page.session_id(session)
        view = run_edit(page.registry, page.sessions, edit, session=sid, spec=spec, progress=step_progress(progress))
        made = edit_recipe(page.registry, page.sessions, edit, session=sid, spec=spec)
        return (view.cards_html, view.strategy_figure, view.text_html, view.attention_figure, view.notes_figure, view.summary, sid, made)

    def frontier(self, session: str | None, made, progress: gr.Progress) -> tuple:
        """The frontier of the session's edit, the session's result with it and the recipe that reruns both."""
        sid = self.page.session_id(session)
        figure, data = run_frontier(self.page.sessions, session=sid, progress=step_progress(progress))
        return figure, data, session_result(self.page.sessions, session=sid), frontier_recipe(made)

    def on_knockout(self, session, positions, top_k, made=None):
        sid = self.page.session_id(session)
        text, figure, data = run_knockout(self.page.sessions, session=sid, positions=positions, top_k=top_k)
        return text, figure, session_result(self.page.sessions, session=sid), sid, knockout_recipe(made, data["positions"])

    def _wire_edit(self, edit_button: gr.Button, notes_plot: gr.Plot) -> None:
        page = self.page

        @page.action
        def on_edit(session, spec, progress=gr.Progress(), **values):
            return self.edit(session, spec, EditInputs(**values), progress)

        @page.action
        def on_frontier(session, made=None, progress=gr.Progress()):
            return self.frontier(session, made, progress)

        edit_button.click(
            on_edit,
            inputs_kwargs={"session": page.session, "spec": page.spec, **self.edit_inputs()},
            outputs=self.edit_outputs,
            api_name="edit",
            **page.model_bound(),
        ).success(
            on_frontier,
            inputs_kwargs={"session": page.session, "made": self.recipe},
            outputs=self.frontier_outputs,
            api_name="frontier",
            **page.model_bound(),
        )
        self.all_positions.change(
            lambda session, every: notes_map_view(page.sessions, session=page.session_id(session), all_positions=every),
            inputs_kwargs={"session": page.session, "every": self.all_positions},
            outputs=notes_plot,
            **UI_ONLY,
        )

    # ------------------------------------------------------------------------ links
    def wire_permalink(self, page_loaded, remedy: gr.Dropdown, tabs: gr.Tabs) -> None:
        """Copy link writes this tab's state (and the composer's remedy) as a link; a page opened from one restores
        it after its model load on the Notes tab, prepares the scenario and runs the edit, so the results show."""
        page, inputs = self.page, self.inputs
        self._wire_copy_link(remedy)
        restored = gr.State(None)  # the link's state, once parsed
        restore_outputs = [inputs.scenario_pick, inputs.editor, inputs.description, inputs.field, inputs.new_value, self.strategies]
        restore_outputs += [self.top_k, self.head, self.separately, self.all_positions, tabs, remedy, self.link_status, restored]
        self._restore_count = len(restore_outputs)
        page_loaded.then(self._restore, outputs=restore_outputs, **UI_ONLY).then(
            self._restored_prepare,
            inputs_kwargs={"link": restored, "spec": page.spec, "text": inputs.editor},
            outputs=inputs.baseline,
            api_name=False,
            **page.model_bound(),
        ).then(
            self._restored_edit,
            inputs_kwargs={"link": restored, "session": page.session, "spec": page.spec},
            outputs=[*self.edit_outputs, self.link_status],
            api_name=False,
            **page.model_bound(),
        ).then(
            self._restored_frontier,
            inputs_kwargs={"link": restored, "session": page.session, "made": self.recipe},
            outputs=self.frontier_outputs,
            api_name=False,
            **page.model_bound(),
        )

    def _wire_copy_link(self, remedy: gr.Dropdown) -> None:
        """Copy link: the state as a link's query, then the page's URL with it copied to the clipboard."""

        def on_link(hint, remedy, **values):
            try:
                query = permalink.link_query(EditInputs(**values), hint=hint, remedy=remedy)
            except AppError as error:
                return "", f"⚠️ {markdown_literal(str(error))}"
            return query, "Copied where the browser allows it: the link opens this scenario, field, value and strategies and runs the edit."

        edit = self.edit_inputs()
        link_inputs = {"text": edit.pop("text"), "hint": self.inputs.scenario_pick}  # the endpoint's parameters, in this order
        link_inputs |= {name: edit.pop(name) for name in ("field", "new", "strategies", "top_k", "head")} | {"remedy": remedy, **edit}
        self.copy_link.click(
            on_link,
            inputs_kwargs=link_inputs,
            outputs=[self.link_box, self.link_status],
            api_name="permalink",
            concurrency_limit=None,
        ).then(None, self.link_box, self.link_box, js=COPY_LINK_JS, **UI_ONLY)

    def _restore(self, request: gr.Request) -> tuple:
        """The link's state as the restore's updates (the last is the parsed link, None without one)."""
        unchanged = [gr.update()] * (self._restore_count - 2)
        try:
            link = permalink.parse_link(
                dict(request.query_params) if request is not None else {},
                offered_strategies=OFFERED_STRATEGIES,
                default_strategies=DEFAULT_STRATEGIES,
                heads=self.heads,
                profile=self.page.registry.profile,
            )
            if link is None:
                return (*unchanged, gr.update(), None)
            edit = link.edit
            view = scenario_choices(edit.text, edit.field)
        except AppError as error:
            gr.Warning(html.escape(f"This link cannot be restored: {error}", quote=False))  # a toast: the status is far below
            return (*unchanged, f"⚠️ This link cannot be restored: {markdown_literal(str(error))}. The page shows its defaults.", None)
        ignored = f" (not KVScope's, ignored: {', '.join(link.ignored)})" if link.ignored else ""
        return (
            gr.update(value=link.scenario),  # none for a scenario carried in the link: the editor holds it
            edit.text,
            view.description,
            gr.update(choices=view.fields, value=edit.field),
            gr.update(choices=list(dict.fromkeys([*view.values, edit.new])), value=edit.new),
            list(edit.strategies),
            edit.top_k,
            edit.head,
            edit.separately,
            edit.all_positions,
            gr.Tabs(selected="notes"),  # the tab the link restores
            gr.update(value=link.remedy) if link.remedy else gr.update(),
            f"Restored from the link: {markdown_literal(link.summary() + ignored)}.",
            link,
        )

    def _restored_prepare(self, link, spec, text, request: gr.Request):
        if request is None or not permalink.is_link(dict(request.query_params)):
            return gr.update()  # no link: the page's own load prepared the scenario
        return self.page.prepare_message(spec, link.edit.text if link else text)

    def _restored_edit(self, link, session, spec, progress=gr.Progress()):
        unchanged = (gr.update(),) * len(self.edit_outputs)
        if link is None:
            return (*unchanged, gr.update())
        try:
            with self.page.bounded():
                shown = self.edit(session, spec, link.edit, progress)
        except AppError as error:
            return (*unchanged, f"⚠️ The link's edit did not run: {markdown_literal(str(error))}")
        return (*shown, gr.update())

    def _restored_frontier(self, link, session, made, progress=gr.Progress()):
        unchanged = (gr.update(),) * len(self.frontier_outputs)
        if link is None:
            return unchanged
        try:
            with self.page.bounded():
                return self.frontier(session, made, progress)
        except AppError:
            return unchanged  # the edit's own message says why
