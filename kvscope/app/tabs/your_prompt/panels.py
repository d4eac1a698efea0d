"""The Your prompt tab's result panels (:class:`Results`: what an audit fills, cleared when one fails or has nothing to
read), its Open in Notes row, the rewrite's folded part and the exports."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from kvscope.app.handlers.audit_view import AuditView
from kvscope.app.tabs.your_prompt.layout import paired_plots

# Markdown tables of the audit: a header never breaks inside a word (Gradio's prose breaks words anywhere: "to/ke/ns").
AUDIT_TABLE_CSS = """<style>
.kv-audit-tables th{white-space:nowrap;word-break:keep-all;overflow-wrap:normal}
.kv-audit-tables td{word-break:normal;overflow-wrap:break-word}
</style>"""
TABLES = ["kv-audit-tables"]
REWRITE_INTRO = (
    "Same requests, same order. Each engine's reuse before and after, and each rewritten prompt's output against "
    "the original's clean prefill (next-token KL, top-1, top-5, the N greedy tokens, the same text or not)."
)


@dataclass(frozen=True)
class Results:
    """The panels an audit fills, in page order: the log's traffic (sessions, engines, groups, fleets), the measured
    turns (recommendations, timeline, fidelity and its axes, the marked prompts), Open in Notes, and the JSON."""

    traffic: gr.Markdown
    sessions: gr.Plot
    engines: gr.Plot
    groups: gr.Markdown
    fleet_table: gr.Markdown
    fleet: gr.Plot
    recommendation: gr.Markdown
    timeline: gr.Plot
    fidelity: gr.Plot
    x: gr.Radio
    y: gr.Radio
    prompt: gr.HTML
    notes_field: gr.Dropdown
    labels: gr.Textbox
    open_notes: gr.Button
    open_status: gr.Markdown
    json: gr.JSON

    def filled(self, session: gr.State) -> list[gr.components.Component]:
        """The panels an audit's view fills and the browser's ``session``, in the API's order of outputs (the axes, the
        labels and the button are the user's)."""
        measured = [self.recommendation, self.timeline, self.fidelity, self.prompt, self.json, self.open_status]
        return [*measured, self.traffic, self.sessions, self.engines, self.groups, self.fleet_table, self.fleet, session, self.notes_field]

    def show(self, view: AuditView) -> dict:
        """``view`` in the panels, by component."""
        return {
            self.traffic: view.traffic_markdown,
            self.sessions: view.sessions_figure,
            self.engines: view.engines_figure,
            self.groups: view.groups_markdown,
            self.fleet_table: view.fleet_markdown,
            self.fleet: gr.update(value=view.fleet_figure, visible=view.fleet_figure is not None),
            self.recommendation: view.recommendation_markdown,
            self.timeline: view.timeline_figure,
            self.fidelity: view.fidelity_figure,
            self.prompt: view.prompt_html,
            self.notes_field: gr.update(choices=view.notes_menu, value=view.notes_pick),
            self.open_status: view.notes_markdown,
            self.json: view.summary,
        }

    def cleared(self, words: str) -> dict:
        """Every panel emptied, ``words`` (Markdown) in the traffic panel: what the page says of the log just given, so
        no panel shows an earlier log's results beside it."""
        empty = {component: None for component in (self.recommendation, self.timeline, self.fidelity, self.prompt, self.json)}
        return empty | {
            self.open_status: "",
            self.traffic: words,
            self.sessions: None,
            self.engines: None,
            self.groups: "",
            self.fleet_table: "",
            self.fleet: gr.update(value=None, visible=False),
            self.notes_field: gr.update(choices=[], value=None),
        }


def results() -> Results:
    """The result panels, with the audit tables' CSS."""
    gr.HTML(AUDIT_TABLE_CSS, padding=False, elem_id="audit-table-css")
    traffic = gr.Markdown(elem_id="audit-traffic", elem_classes=TABLES)
    sessions, engines = paired_plots(("Requests per session", "audit-sessions"), ("Tokens each engine reuses", "audit-engines"))
    groups = gr.Markdown(elem_id="audit-groups", elem_classes=TABLES)
    fleet_table = gr.Markdown(elem_id="audit-fleet-table", elem_classes=TABLES)
    fleet = gr.Plot(label="Hit rate by router and replicas", elem_id="audit-fleet", visible=False)  # shown with replicas
    recommendation = gr.Markdown(elem_id="audit-recommendation")
    timeline, fidelity = paired_plots(("Reused fraction per turn", "audit-timeline"), ("Fidelity against cost", "audit-fidelity"))
    with gr.Row():
        x = gr.Radio([("computed tokens", "computed"), ("TTFT speed-up", "ttft")], value="computed", label="x", elem_id="audit-x")
        y = gr.Radio([("KL divergence", "kl"), ("greedy agreement", "agreement")], value="kl", label="y", elem_id="audit-y")
    prompt = gr.HTML(elem_id="audit-prompt")
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
    json = gr.JSON(label="Audit", elem_id="audit-json")
    return Results(
        traffic,
        sessions,
        engines,
        groups,
        fleet_table,
        fleet,
        recommendation,
        timeline,
        fidelity,
        x,
        y,
        prompt,
        notes_field,
        labels,
        open_notes,
        open_status,
        json,
    )


@dataclass(frozen=True)
class RewriteWidgets:
    """A rewrite of the log, measured on the loaded model or on a server: the rewritten log (or template), the server's
    URL and model, the buttons and the result."""

    rewritten: gr.Textbox
    template: gr.Checkbox
    run: gr.Button
    url: gr.Textbox
    model: gr.Textbox
    run_on_server: gr.Button
    view: gr.Markdown
    json: gr.JSON


def rewrite_widgets() -> RewriteWidgets:
    """The folded rewrite part."""
    with gr.Accordion("Measure a rewrite of this log: a linter's rewritten log, or your new prompt template", open=False):
        gr.Markdown(REWRITE_INTRO)
        with gr.Row():
            rewritten = gr.Textbox(label="Rewritten log (JSONL), or a prompt template", lines=6, elem_id="audit-rewritten", scale=3)
            with gr.Column(scale=1):
                template = gr.Checkbox(
                    False, label="It is a prompt template ({placeholders}, as Export writes)", elem_id="audit-as-template"
                )
                run = gr.Button("Measure the rewrite", variant="primary", elem_id="run-rewrite")
        with gr.Row():
            url = gr.Textbox(
                label="Measure on a server: its OpenAI-compatible base URL (vLLM, SGLang, llama-server; API key from the environment)",
                placeholder="http://127.0.0.1:8000",
                elem_id="audit-server-url",
                scale=2,
            )
            model = gr.Textbox(label="Served model (empty: the one it serves)", elem_id="audit-server-model", scale=1)
            run_on_server = gr.Button("Measure on a server", elem_id="run-rewrite-server", scale=1)
        view = gr.Markdown(elem_id="audit-rewrite", elem_classes=TABLES)
        json = gr.JSON(label="Rewrite", elem_id="audit-rewrite-json")
    return RewriteWidgets(rewritten, template, run, url, model, run_on_server, view, json)


def export_widgets() -> tuple[gr.Button, gr.File]:
    """The export button and its files."""
    with gr.Row():
        button = gr.Button("Export JSON, figures, scenario TOML + repaired template", elem_id="export-audit")
        files = gr.File(label="Exported files", file_count="multiple", elem_id="audit-files")
    return button, files


@dataclass(frozen=True)
class PolicyWidgets:
    """Download policy: its button, the policy file and the proxy's config, and the policy in words."""

    button: gr.Button
    files: gr.File
    words: gr.Markdown


def policy_widgets() -> PolicyWidgets:
    """After an audit: the policy a gateway applies (the repairs measured within the bars) and the LiteLLM hook's config."""
    with gr.Row():
        button = gr.Button("Download policy + LiteLLM hook config", elem_id="download-policy")
        files = gr.File(label="Policy and proxy config", file_count="multiple", elem_id="policy-files")
    words = gr.Markdown(elem_id="policy-words")
    return PolicyWidgets(button, files, words)
