"""What follows an audit on the Your prompt tab: its fidelity figure on other axes, the field Open in Notes studies and
the opening itself (the Notes tab prepared and run), a rewrite of the log measured (on the loaded model or a server, with
the tab's simulated engines), and the exports."""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.audit_kept import audit_fidelity_view, audit_notes_choice, audit_notes_scenario, download_policy, export_audit
from kvscope.app.handlers.audit_log import given_log
from kvscope.app.handlers.audit_settings import EngineInputs, taken
from kvscope.app.handlers.rewrite import RewriteInputs, ServerUnreachable, run_rewrite, run_rewrite_on_server
from kvscope.app.page import Page, notice, step_progress
from kvscope.app.tabs import TabContext
from kvscope.app.tabs.your_prompt.layout import LogWidgets, RunWidgets, by_name
from kvscope.app.tabs.your_prompt.panels import PolicyWidgets, Results, RewriteWidgets
from kvscope.viz.common import markdown_literal

OPEN_IN_NOTES_JS = "() => { const button = document.querySelector('#run-edit'); if (button) { button.click(); } }"


def wire_axes_and_notes(page: Page, shown: Results) -> None:
    """The axes redraw the kept audit's fidelity figure; the field menu says its pre-check."""
    for axis in (shown.x, shown.y):
        axis.change(
            lambda session, x, y: audit_fidelity_view(page.sessions, session=page.session_id(session), x=x, y=y),
            inputs_kwargs={"session": page.session, "x": shown.x, "y": shown.y},
            outputs=shown.fidelity,
            api_name="audit_axes" if axis is shown.x else False,
            concurrency_limit=None,
        )
    shown.notes_field.input(
        page.action(lambda session, field: audit_notes_choice(page.sessions, session=page.session_id(session), field=field)),
        inputs_kwargs={"session": page.session, "field": shown.notes_field},
        outputs=shown.open_status,
        api_name="audit_notes_field",
        concurrency_limit=None,
    )


def wire_open_in_notes(ctx: TabContext, shown: Results) -> None:
    """Open in Notes: the picked field's scenario into the Notes tab, selected, prepared, and its edit run."""
    page, notes = ctx.page, ctx.shared_notes()

    @page.action
    def on_open(session, labels, field):
        text, view = audit_notes_scenario(page.sessions, session=page.session_id(session), labels=labels, field=field)
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

    outputs = [notes.editor, notes.description, notes.field, notes.new_value, ctx.tabs, shown.open_status]
    outputs += [notes.scenario_pick, *notes.stale_outputs]
    opened = shown.open_notes.click(
        on_open,
        inputs_kwargs={"session": page.session, "labels": shown.labels, "field": shown.notes_field},
        outputs=outputs,
        api_name="audit_open_in_notes",
        concurrency_limit=None,
    )
    opened.success(
        lambda spec, text: page.prepare_message(spec, text),
        inputs_kwargs={"spec": page.spec, "text": notes.editor},
        outputs=notes.baseline,
        api_name=False,
        **page.model_bound(),
    ).success(None, None, None, js=OPEN_IN_NOTES_JS, api_name=False)


def wire_rewrite(page: Page, log: LogWidgets, run: RunWidgets, rewrite: RewriteWidgets) -> None:
    """Measure the rewrite, on the loaded model or on a server; both with the tab's simulated engines."""

    def given(text, upload, rewritten, template, tokens) -> RewriteInputs:
        return RewriteInputs(given_log(text, upload), rewritten, template, tokens)

    @page.action
    def on_rewrite(spec, text, upload, rewritten, template, tokens, progress=gr.Progress(), **engines):
        rewrite_given = given(text, upload, rewritten, template, tokens)
        return run_rewrite(page.registry, rewrite_given, spec=spec, engines=taken(EngineInputs, engines), progress=step_progress(progress))

    inputs = {"spec": page.spec, "text": log.text, "upload": log.uploaded, "rewritten": rewrite.rewritten, "template": rewrite.template}
    inputs |= {"tokens": run.measure.tokens}
    engines, outputs = by_name(run.engines), [rewrite.view, rewrite.json]  # the engines last: the API's earlier order stands
    rewrite.run.click(on_rewrite, inputs_kwargs=inputs | engines, outputs=outputs, api_name="audit_rewrite", **page.model_bound())

    @page.action
    def on_rewrite_on_server(spec, text, upload, rewritten, template, tokens, url, model, progress=gr.Progress(), **engines):
        rewrite_given = given(text, upload, rewritten, template, tokens)
        try:
            return run_rewrite_on_server(
                page.registry,
                rewrite_given,
                spec=spec,
                url=url,
                model=model,
                engines=taken(EngineInputs, engines),
                progress=step_progress(progress),
            )
        except ServerUnreachable as down:  # the person's server is down: information in the panel, no error badge
            notice(down)
            return down.markdown(), None

    rewrite.run_on_server.click(
        on_rewrite_on_server,
        inputs_kwargs=inputs | {"url": rewrite.url, "model": rewrite.model} | engines,
        outputs=outputs,
        api_name="audit_rewrite_on_server",
        **page.model_bound(),
    )


def wire_export(page: Page, shown: Results, button: gr.Button, files: gr.File) -> None:
    """Export the kept audit: its JSON, figures (on the shown axes), scenario and repaired template."""

    @page.action
    def on_export(session, x, y):
        return export_audit(page.exports, page.sessions, session=page.session_id(session), x=x, y=y)

    button.click(
        on_export,
        inputs_kwargs={"session": page.session, "x": shown.x, "y": shown.y},
        outputs=files,
        api_name="export_audit",
        concurrency_limit=None,
    )


def wire_policy(page: Page, widgets: PolicyWidgets) -> None:
    """Download the kept audit's policy and the hook's config, and say what it does."""

    @page.action
    def on_policy(session):
        return download_policy(page.exports, page.sessions, session=page.session_id(session))

    widgets.button.click(
        on_policy,
        inputs_kwargs={"session": page.session},
        outputs=[widgets.files, widgets.words],
        api_name="download_policy",
        concurrency_limit=None,
    )
