"""Your prompt: a request log (or one prompt and a new value) audited for mutable fields in cached prefixes, every
repair measured; Open in Notes runs the edit, the notes map and knockout on it; a rewrite measured against the log."""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.audit_progress import AuditRuns
from kvscope.app.handlers.common import AppError, AppUnreachable
from kvscope.app.handlers.endpoint import run_rewrite_on_server
from kvscope.app.handlers.your_prompt import (
    AUDIT_REPAIRS,
    DEFAULTS,
    NO_GRAIN,
    AuditInputs,
    AuditView,
    audit_fidelity_view,
    audit_notes_choice,
    audit_notes_scenario,
    bundled_log_text,
    engine_settings,
    export_audit,
    given_log,
    nothing_to_audit,
    prompt_candidates,
    run_audit_value,
    run_rewrite,
    start_audit,
    upload_markdown,
)
from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider
from kvscope.app.page import PAIRED_PLOT_MIN_WIDTH, message_progress, notice, step_progress
from kvscope.app.tabs import TabContext
from kvscope.engine import DEFAULT_SAMPLE, GRAINS, OBSERVED_ENGINES, REPAIR_SUMMARIES, CacheSettings, bundled_logs, cancellable
from kvscope.viz.common import markdown_literal
from kvscope.viz.text import glossary

AUDIT_INTRO = """Paste a request log as your server or gateway records it (OpenAI chat, completions or Responses requests,
Anthropic Messages, ShareGPT, gateway records or batch lines; one JSON object a line, or a JSON array), upload one, or pick a
demo. A token pass covers every request, rendered with the loaded model's own chat template (tools included): each is matched
with the earlier request it shares the longest prefix with, sessions are kept apart, each miss gets its cause (a clock, an id,
tools changed, a prefix ending mid-block…), and three engines' caches are simulated (vLLM blocks, SGLang's radix tree,
llama.cpp's slots). Turns are grouped by what changed; the model then measures every repair on up to *K* turns of each group
against a clean prefill of the new request (next-token KL, top-1, N greedy tokens) and recommends the cheapest within your
threshold. Malformed records are skipped and named. Where a record says what the server cached, that count is drawn beside
the simulated engines and each request it served worse is marked, with what could explain it; requests to OpenAI or
Anthropic models also get that provider's caching simulated. For one prompt, open *One prompt* below and change a value."""
ONE_PROMPT_INTRO = (
    "Paste one prompt above (plain text is one user message). *Find volatile spans* marks dates and times, ids, hex "
    "strings, numbers and `key: value` values in the rendered prompt; pick one (or type the text to change), type "
    "its new value and audit the prompt as cached against the prompt as it arrives."
)
REWRITE_INTRO = (
    "Same requests, same order. Each engine's reuse before and after, and each rewritten prompt's output against "
    "the original's clean prefill (next-token KL, top-1, top-5, the N greedy tokens, the same text or not)."
)
# Markdown tables of the audit: a header never breaks inside a word (Gradio's prose breaks words anywhere: "to/ke/ns").
AUDIT_TABLE_CSS = """<style>
.kv-audit-tables th{white-space:nowrap;word-break:keep-all;overflow-wrap:normal}
.kv-audit-tables td{word-break:normal;overflow-wrap:break-word}
</style>"""
OPEN_IN_NOTES_JS = "() => { const button = document.querySelector('#run-edit'); if (button) { button.click(); } }"


def with_coarsen(grain: str, chosen: list[str] | None) -> list[str]:
    """The repairs ticked once a grain is picked: coarsen among them (it measures nothing without one)."""
    chosen = list(chosen or [])
    return chosen + ["coarsen"] if grain != NO_GRAIN and "coarsen" not in chosen else chosen


def build(ctx: TabContext) -> None:
    """The Your prompt tab."""
    page = ctx.page
    notes, tabs = ctx.shared_notes(), ctx.tabs
    most_tokens = page.registry.profile.max_audit_tokens or 128
    with gr.Tab("Your prompt", id="your-prompt"):
        gr.Markdown(AUDIT_INTRO)
        with gr.Row():
            with gr.Column(scale=2):
                with gr.Row(equal_height=True):
                    demo = gr.Dropdown(list(bundled_logs()), value=None, label="Bundled demo log", elem_id="audit-demo", scale=1)
                    # a button, not a file box: a second upload replaces the first without clearing it first
                    upload = gr.UploadButton(
                        "…or upload a log or a prompt",
                        file_types=[".jsonl", ".json", ".txt"],
                        type="filepath",
                        elem_id="audit-upload",
                        scale=1,
                    )
                upload_info = gr.Markdown(elem_id="audit-upload-info")
                uploaded = gr.State(None)  # the uploaded file's path: the audit reads it while the text box is empty
                log_text = gr.Textbox(
                    label="Request log (JSONL or a JSON array of requests), or one prompt (text or messages JSON)",
                    lines=12,
                    max_lines=24,
                    elem_id="audit-input",
                )
            with gr.Column(scale=1):
                repairs = LenientCheckboxGroup(
                    AUDIT_REPAIRS,
                    value=[name for name in AUDIT_REPAIRS if name != "coarsen"],  # coarsen needs a grain (picking one ticks it)
                    label="Repairs (recompute, the exact reference, always runs)",
                    info=glossary(REPAIR_SUMMARIES),
                    elem_id="audit-repairs",
                )
                tokens = LenientSlider(
                    1,
                    most_tokens,
                    value=min(DEFAULTS.tokens, most_tokens),
                    step=1,
                    label="N: greedy tokens per state",
                    elem_id="audit-tokens",
                )
                threshold = gr.Number(DEFAULTS.threshold, label="KL threshold (nats, next token)", elem_id="audit-threshold")
                min_agreement = LenientSlider(
                    0,
                    1,
                    value=DEFAULTS.min_agreement,
                    step=0.05,
                    label="Minimum share of greedy tokens agreeing",
                    elem_id="audit-min-agreement",
                )
                grain = gr.Dropdown([NO_GRAIN, *GRAINS], value=NO_GRAIN, label="coarsen: the date-time grain", elem_id="audit-grain")
                grain.input(
                    with_coarsen, inputs=[grain, repairs], outputs=repairs, api_name=False, concurrency_limit=None, show_progress="hidden"
                )
                sample = LenientSlider(
                    0,
                    10,
                    value=DEFAULT_SAMPLE,
                    step=1,
                    label="--sample K: turns the model measures per change signature (0: the token pass only)",
                    elem_id="audit-sample",
                )
                with gr.Accordion("Simulated engines", open=False, elem_id="audit-engine-settings"):
                    block = gr.Number(CacheSettings.block, precision=0, label="vLLM block size (tokens)", elem_id="audit-block")
                    budget_blocks = gr.Number(0, precision=0, label="vLLM block budget (0: unbounded)", elem_id="audit-budget-blocks")
                    budget_tokens = gr.Number(0, precision=0, label="SGLang token budget (0: unbounded)", elem_id="audit-budget-tokens")
                    cache_reuse = gr.Number(0, precision=0, label="llama.cpp --cache-reuse N (0: off)", elem_id="audit-cache-reuse")
                    observed_engine = gr.Dropdown(
                        list(OBSERVED_ENGINES),
                        value="vllm",
                        label="the engine the log's observed cached tokens are compared with",
                        elem_id="audit-observed-engine",
                    )
                    replicas = gr.Textbox(
                        "", label="Fleets: replica counts behind each router, e.g. 2,4,8 (empty: one server)", elem_id="audit-replicas"
                    )
                with gr.Row():
                    audit_button = gr.Button("Audit the log", variant="primary", elem_id="run-audit", scale=2)
                    cancel_button = gr.Button("Cancel", variant="stop", visible=False, elem_id="cancel-audit", scale=1)
                audit_status = gr.Markdown(elem_id="audit-status")
        with gr.Accordion("One prompt: change a value", open=False, elem_id="audit-one-prompt"):
            gr.Markdown(ONE_PROMPT_INTRO)
            find_button = gr.Button("Find volatile spans", elem_id="audit-find-spans")
            candidates_view = gr.HTML(elem_id="audit-candidates")
            with gr.Row():
                candidate = gr.Dropdown([], value=None, label="Candidate span", elem_id="audit-choice")
                find = gr.Textbox(label="…or the text to change (its first occurrence)", elem_id="audit-find")
                new_value = gr.Textbox(label="New value", elem_id="audit-new-value")
                value_button = gr.Button("Audit this change", variant="primary", elem_id="run-audit-value")
        gr.HTML(AUDIT_TABLE_CSS, padding=False, elem_id="audit-table-css")
        traffic_view = gr.Markdown(elem_id="audit-traffic", elem_classes=["kv-audit-tables"])
        with gr.Row():
            sessions_plot = gr.Plot(label="Requests per session", elem_id="audit-sessions", min_width=560)
            engines_plot = gr.Plot(label="Tokens each engine reuses", elem_id="audit-engines", min_width=560)
        groups_view = gr.Markdown(elem_id="audit-groups", elem_classes=["kv-audit-tables"])
        fleet_view = gr.Markdown(elem_id="audit-fleet-table", elem_classes=["kv-audit-tables"])
        fleet_plot = gr.Plot(label="Hit rate by router and replicas", elem_id="audit-fleet", visible=False)  # shown with replicas
        recommendation = gr.Markdown(elem_id="audit-recommendation")
        with gr.Row():
            timeline_plot = gr.Plot(label="Reused fraction per turn", elem_id="audit-timeline", min_width=PAIRED_PLOT_MIN_WIDTH)
            fidelity_plot = gr.Plot(label="Fidelity against cost", elem_id="audit-fidelity", min_width=PAIRED_PLOT_MIN_WIDTH)
        with gr.Row():
            x_axis = gr.Radio([("computed tokens", "computed"), ("TTFT speed-up", "ttft")], value="computed", label="x", elem_id="audit-x")
            y_axis = gr.Radio([("KL divergence", "kl"), ("greedy agreement", "agreement")], value="kl", label="y", elem_id="audit-y")
        prompt_view = gr.HTML(elem_id="audit-prompt")
        notes_field = gr.Dropdown(
            [],
            value=None,
            label="Changed field to open in Notes (each with the model's pre-check: does its change move the answer?)",
            elem_id="audit-notes-field",
        )
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
            gr.Markdown(REWRITE_INTRO)
            with gr.Row():
                rewritten = gr.Textbox(label="Rewritten log (JSONL), or a prompt template", lines=6, elem_id="audit-rewritten", scale=3)
                with gr.Column(scale=1):
                    as_template = gr.Checkbox(
                        False, label="It is a prompt template ({placeholders}, as Export writes)", elem_id="audit-as-template"
                    )
                    rewrite_button = gr.Button("Measure the rewrite", variant="primary", elem_id="run-rewrite")
            with gr.Row():
                server_url = gr.Textbox(
                    label="Measure on a server: its OpenAI-compatible base URL (vLLM, SGLang, llama-server; API key from the environment)",
                    placeholder="http://127.0.0.1:8000",
                    elem_id="audit-server-url",
                    scale=2,
                )
                server_model = gr.Textbox(label="Served model (empty: the one it serves)", elem_id="audit-server-model", scale=1)
                server_button = gr.Button("Measure on a server", elem_id="run-rewrite-server", scale=1)
            rewrite_view = gr.Markdown(elem_id="audit-rewrite", elem_classes=["kv-audit-tables"])
            rewrite_json = gr.JSON(label="Rewrite", elem_id="audit-rewrite-json")
        with gr.Row():
            export_button = gr.Button("Export JSON, figures, scenario TOML + repaired template", elem_id="export-audit")
            export_files = gr.File(label="Exported files", file_count="multiple", elem_id="audit-files")

    demo.input(page.action(bundled_log_text), inputs_kwargs={"name": demo}, outputs=log_text, api_name="audit_demo", concurrency_limit=None)

    @page.action
    def on_upload(path):
        if not path:
            raise AppError("no file uploaded")
        return path, upload_markdown(path), ""

    upload.upload(
        on_upload,
        inputs_kwargs={"path": upload},
        outputs=[uploaded, upload_info, log_text],
        api_name="audit_upload",
        concurrency_limit=None,
    )

    measure = {"repairs": repairs, "tokens": tokens, "threshold": threshold, "min_agreement": min_agreement, "grain": grain}
    measure |= {"x": x_axis, "y": y_axis}
    engines = {"block": block, "budget_blocks": budget_blocks, "budget_tokens": budget_tokens, "cache_reuse": cache_reuse}
    shown = [recommendation, timeline_plot, fidelity_plot, prompt_view, audit_json, open_status]
    shown += [traffic_view, sessions_plot, engines_plot, groups_view, fleet_view, fleet_plot, page.session, notes_field]

    def _shown(view: AuditView, sid: str) -> tuple:
        figures = view.timeline_figure, view.fidelity_figure
        traffic = view.traffic_markdown, view.sessions_figure, view.engines_figure, view.groups_markdown
        traffic += (view.fleet_markdown, gr.update(value=view.fleet_figure, visible=view.fleet_figure is not None))
        menu = gr.update(choices=view.notes_menu, value=view.notes_pick)
        return view.recommendation_markdown, *figures, view.prompt_html, view.summary, view.notes_markdown, *traffic, sid, menu

    def _nothing(words: str, sid: str) -> tuple:
        """An empty log: the words in the traffic panel, every other panel as it was (no error badges)."""
        return tuple(words if component is traffic_view else sid if component is page.session else gr.update() for component in shown)

    runs = AuditRuns()  # each browser tab's running audit, for its Cancel

    def ended() -> dict:
        """Cancel hidden, with the audit's last outputs (a step after them hid it seconds after the result showed)."""
        return gr.update(visible=False)

    @page.action
    def on_audit(
        session,
        spec,
        text,
        upload,
        block,
        budget_blocks,
        budget_tokens,
        cache_reuse,
        replicas,
        sample,
        observed_engine,
        request: gr.Request,
        progress=gr.Progress(),
        **settings,
    ):
        sid = page.session_id(session)
        text = given_log(text, upload)
        if words := nothing_to_audit(text):
            yield *_nothing(words, sid), ended()
            return
        simulated = engine_settings(block=block, budget_blocks=budget_blocks, budget_tokens=budget_tokens, cache_reuse=cache_reuse)
        with runs.running(request.session_hash) as token:
            try:
                with cancellable(token):
                    started = start_audit(
                        page.registry,
                        page.sessions,
                        text,
                        session=sid,
                        spec=spec,
                        inputs=AuditInputs(**settings),
                        sample=sample,
                        engines=simulated,
                        observed_engine=observed_engine,
                        replicas=replicas,
                        progress=message_progress(progress),
                    )
                if started.pending is not None:  # the token pass, shown while the model pass runs (Cancel stays)
                    yield *_shown(started.pending, sid), gr.update()
                with cancellable(token):
                    view = started.finish()
            except AppError:
                if not token.cancelled:
                    raise
                yield *(gr.skip() for _ in shown), ended()  # cancelled: information (the Cancel said so), not an error
                return
        yield *_shown(view, sid), ended()

    # Cancel shows only while an audit runs: from the click (which also clears the last run's status) to the audit's end,
    # done or cancelled (hidden by the audit's own outputs), or failed
    started = audit_button.click(
        lambda: ("", gr.update(visible=True)), outputs=[audit_status, cancel_button], api_name=False, concurrency_limit=None
    )
    audit_event = started.then(
        on_audit,
        inputs_kwargs={
            "session": page.session,
            "spec": page.spec,
            "text": log_text,
            "upload": uploaded,
            **measure,
            "sample": sample,
            **engines,
            "observed_engine": observed_engine,
            "replicas": replicas,
        },
        outputs=[*shown, cancel_button],
        # the bar under the buttons and on the panels the model pass fills: the token pass, shown first, stays readable
        show_progress_on=[audit_status, recommendation, timeline_plot, fidelity_plot],
        api_name="audit",
        **page.model_bound(),
    )
    # after an error the page runs only .failure steps (gradio 6.31)
    audit_event.failure(ended, outputs=cancel_button, api_name=False, concurrency_limit=None)

    def on_cancel(request: gr.Request):
        said = runs.cancel(request.session_hash)
        gr.Info(said)
        return said

    # the token stops the audit before its next forward, and the audit returns as cancelled (information); no cancels=:
    # gradio's own cancel of a running event sometimes left every output with an Error badge
    cancel_button.click(on_cancel, outputs=audit_status, api_name="cancel_audit", concurrency_limit=None)

    @page.action
    def on_candidates(spec, text, upload):
        view, menu = prompt_candidates(page.registry, given_log(text, upload), spec=spec)
        return view, gr.update(choices=menu, value=menu[0][1] if menu else None)

    find_button.click(
        on_candidates,
        inputs_kwargs={"spec": page.spec, "text": log_text, "upload": uploaded},
        outputs=[candidates_view, candidate],
        api_name="audit_candidates",
        **page.model_bound(),
    )

    @page.action
    def on_audit_value(session, spec, text, upload, candidate, find, new_value, progress=gr.Progress(), **settings):
        sid = page.session_id(session)
        text = given_log(text, upload)
        if words := nothing_to_audit(text):
            return _nothing(words, sid)
        view = run_audit_value(
            page.registry,
            page.sessions,
            text,
            session=sid,
            spec=spec,
            candidate=candidate,
            find=find,
            new_value=new_value,
            inputs=AuditInputs(**settings),
            progress=step_progress(progress),
        )
        return _shown(view, sid)

    value_button.click(
        on_audit_value,
        inputs_kwargs={
            "session": page.session,
            "spec": page.spec,
            "text": log_text,
            "upload": uploaded,
            "candidate": candidate,
            "find": find,
            "new_value": new_value,
            **measure,
        },
        outputs=shown,
        api_name="audit_value",
        **page.model_bound(),
    )
    for axis in (x_axis, y_axis):
        axis.change(
            lambda session, x, y: audit_fidelity_view(page.sessions, session=page.session_id(session), x=x, y=y),
            inputs_kwargs={"session": page.session, "x": x_axis, "y": y_axis},
            outputs=fidelity_plot,
            api_name="audit_axes" if axis is x_axis else False,
            concurrency_limit=None,
        )

    notes_field.input(
        page.action(lambda session, field: audit_notes_choice(page.sessions, session=page.session_id(session), field=field)),
        inputs_kwargs={"session": page.session, "field": notes_field},
        outputs=open_status,
        api_name="audit_notes_field",
        concurrency_limit=None,
    )

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

    open_outputs = [notes.editor, notes.description, notes.field, notes.new_value, tabs, open_status]
    open_outputs += [notes.scenario_pick, *notes.stale_outputs]
    opened = open_notes.click(
        on_open,
        inputs_kwargs={"session": page.session, "labels": labels, "field": notes_field},
        outputs=open_outputs,
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

    @page.action
    def on_rewrite(spec, text, upload, progress=gr.Progress(), **values):
        return run_rewrite(page.registry, given_log(text, upload), spec=spec, progress=step_progress(progress), **values)

    rewrite_inputs = {"spec": page.spec, "text": log_text, "upload": uploaded, "rewritten": rewritten, "template": as_template}
    rewrite_inputs |= {"tokens": tokens}
    rewrite_button.click(
        on_rewrite,
        inputs_kwargs=rewrite_inputs,
        outputs=[rewrite_view, rewrite_json],
        api_name="audit_rewrite",
        **page.model_bound(),
    )

    @page.action
    def on_rewrite_on_server(spec, text, upload, progress=gr.Progress(), **values):
        try:
            return run_rewrite_on_server(page.registry, given_log(text, upload), spec=spec, progress=step_progress(progress), **values)
        except AppUnreachable as unreachable:  # the person's server is down: information in the panel, no error badge
            return notice(unreachable), None

    server_button.click(
        on_rewrite_on_server,
        inputs_kwargs=rewrite_inputs | {"url": server_url, "model": server_model},
        outputs=[rewrite_view, rewrite_json],
        api_name="audit_rewrite_on_server",
        **page.model_bound(),
    )

    @page.action
    def on_export(session, x, y):
        return export_audit(page.exports, page.sessions, session=page.session_id(session), x=x, y=y)

    export_button.click(
        on_export,
        inputs_kwargs={"session": page.session, "x": x_axis, "y": y_axis},
        outputs=export_files,
        api_name="export_audit",
        concurrency_limit=None,
    )
