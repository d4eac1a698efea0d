"""The Your prompt tab's audit events: a demo or an upload given, Audit (its token pass shown while the model pass runs)
and its Cancel, and one prompt's spans and audit. An audit that fails, or finds no log, clears the panels and says why in
the traffic panel: no panel keeps an earlier log's results beside it."""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.audit_log import bundled_log_text, given_log, nothing_to_audit, upload_markdown
from kvscope.app.handlers.audit_progress import AuditRuns
from kvscope.app.handlers.audit_settings import AuditInputs, EngineInputs, taken
from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.your_prompt import prompt_candidates, run_audit_value, start_audit
from kvscope.app.page import UI_ONLY, Page, message_progress, step_progress
from kvscope.app.tabs.your_prompt.layout import LogWidgets, OnePromptWidgets, RunWidgets, by_name
from kvscope.app.tabs.your_prompt.panels import Results
from kvscope.engine import cancellable
from kvscope.viz.common import markdown_literal

HIDDEN = gr.update(visible=False)


def failed_words(error: AppError) -> str:
    """The traffic panel's words for an audit that failed: why, and that the earlier results were cleared."""
    why = markdown_literal(str(error))
    return f"⚠️ **This log could not be audited:** {why}. The panels below are cleared (they held the earlier audit)."


def wire_log(page: Page, log: LogWidgets) -> None:
    """A demo's text into the box; an upload named and kept (the box emptied, so the audit reads the file)."""
    demo_text = page.action(bundled_log_text)
    log.demo.input(demo_text, inputs_kwargs={"name": log.demo}, outputs=log.text, api_name="audit_demo", concurrency_limit=None)

    @page.action
    def on_upload(path):
        if not path:
            raise AppError("no file uploaded")
        return path, upload_markdown(path), ""

    log.upload.upload(
        on_upload,
        inputs_kwargs={"path": log.upload},
        outputs=[log.uploaded, log.info, log.text],
        api_name="audit_upload",
        concurrency_limit=None,
    )


def wire_audit(page: Page, log: LogWidgets, run: RunWidgets, shown: Results) -> None:
    """Audit and Cancel: Cancel shows only while an audit runs, from the click (which also clears the last run's status)
    to the audit's end, done or cancelled (hidden by the audit's own outputs), or failed."""
    runs = AuditRuns()  # each browser tab's running audit, for its Cancel

    @page.action
    def on_audit(session, spec, text, upload, sample, request: gr.Request, progress=gr.Progress(), **values):
        sid = page.session_id(session)
        text = given_log(text, upload)
        if words := nothing_to_audit(text):
            yield shown.cleared(words) | {page.session: sid, run.cancel: HIDDEN}
            return
        options = {
            "session": sid,
            "spec": spec,
            "sample": sample,
            "inputs": taken(AuditInputs, values),
            "engines": taken(EngineInputs, values),
        }
        with runs.running(request.session_hash) as token:
            try:
                with cancellable(token):
                    started = start_audit(page.registry, page.sessions, text, **options, progress=message_progress(progress))
                if started.pending is not None:  # the token pass, shown while the model pass runs (Cancel stays)
                    yield shown.show(started.pending) | {page.session: sid}
                with cancellable(token):
                    view = started.finish()
            except AppError as error:
                if token.cancelled:  # information (the Cancel said so), not an error
                    yield {run.cancel: HIDDEN}
                    return
                yield shown.cleared(failed_words(error)) | {page.session: sid, run.cancel: HIDDEN}
                raise
        yield shown.show(view) | {page.session: sid, run.cancel: HIDDEN}

    started = run.audit.click(lambda: ("", gr.update(visible=True)), outputs=[run.status, run.cancel], **UI_ONLY)
    inputs = {"session": page.session, "spec": page.spec, "text": log.text, "upload": log.uploaded} | by_name(run.measure)
    audit_event = started.then(
        on_audit,
        inputs_kwargs=inputs | {"x": shown.x, "y": shown.y, "sample": run.sample} | by_name(run.engines),  # the API's order
        outputs=[*shown.filled(page.session), run.cancel],
        # the bar under the buttons and on the panels the model pass fills: the token pass, shown first, stays readable
        show_progress_on=[run.status, shown.recommendation, shown.timeline, shown.fidelity],
        api_name="audit",
        **page.model_bound(),
    )
    # after an error the page runs only .failure steps (gradio 6.31)
    audit_event.failure(lambda: HIDDEN, outputs=run.cancel, **UI_ONLY)

    def on_cancel(request: gr.Request):
        said = runs.cancel(request.session_hash)
        gr.Info(said)
        return said

    # the token stops the audit before its next forward, and the audit returns as cancelled (information); no cancels=:
    # gradio's own cancel of a running event sometimes left every output with an Error badge
    run.cancel.click(on_cancel, outputs=run.status, api_name="cancel_audit", concurrency_limit=None)


def wire_one_prompt(page: Page, log: LogWidgets, run: RunWidgets, one: OnePromptWidgets, shown: Results) -> None:
    """Find volatile spans, and Audit this change (a failure clears the panels as a log's does)."""

    @page.action
    def on_candidates(spec, text, upload):
        view, menu = prompt_candidates(page.registry, given_log(text, upload), spec=spec)
        return view, gr.update(choices=menu, value=menu[0][1] if menu else None)

    given = {"spec": page.spec, "text": log.text, "upload": log.uploaded}
    one.find_spans.click(
        on_candidates, inputs_kwargs=given, outputs=[one.candidates, one.candidate], api_name="audit_candidates", **page.model_bound()
    )

    @page.action
    def on_audit_value(session, spec, text, upload, candidate, find, new_value, progress=gr.Progress(), **values):
        sid = page.session_id(session)
        text = given_log(text, upload)
        if words := nothing_to_audit(text):
            yield shown.cleared(words) | {page.session: sid}
            return
        change = {"candidate": candidate, "find": find, "new_value": new_value}
        try:
            view = run_audit_value(
                page.registry,
                page.sessions,
                text,
                session=sid,
                spec=spec,
                inputs=taken(AuditInputs, values),
                progress=step_progress(progress),
                **change,
            )
        except AppError as error:
            yield shown.cleared(failed_words(error)) | {page.session: sid}
            raise
        yield shown.show(view) | {page.session: sid}

    change = {"candidate": one.candidate, "find": one.find, "new_value": one.new_value}
    one.audit.click(
        on_audit_value,
        inputs_kwargs={"session": page.session, **given, **change} | by_name(run.measure) | {"x": shown.x, "y": shown.y},
        outputs=shown.filled(page.session),
        api_name="audit_value",
        **page.model_bound(),
    )
