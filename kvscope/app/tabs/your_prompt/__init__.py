"""Your prompt: a request log (or one prompt and a new value) audited for mutable fields in cached prefixes, every
repair measured; Open in Notes runs the edit, the notes map and knockout on it; a rewrite measured against the log.

Its parts: ``layout`` (the inputs, each group one dataclass), ``panels`` (the results, the rewrite, the exports),
``audit_events`` (the log given, Audit and Cancel, one prompt) and ``follow_ups`` (axes, Open in Notes, rewrite, export).
"""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.audit_settings import NO_GRAIN
from kvscope.app.page import UI_ONLY
from kvscope.app.tabs import TabContext
from kvscope.app.tabs.your_prompt.audit_events import wire_audit, wire_log, wire_one_prompt
from kvscope.app.tabs.your_prompt.follow_ups import wire_axes_and_notes, wire_export, wire_open_in_notes, wire_policy, wire_rewrite
from kvscope.app.tabs.your_prompt.layout import log_widgets, one_prompt_widgets, run_widgets
from kvscope.app.tabs.your_prompt.panels import export_widgets, policy_widgets, results, rewrite_widgets

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


def with_coarsen(grain: str, chosen: list[str] | None) -> list[str]:
    """The repairs ticked once a grain is picked: coarsen among them (it measures nothing without one)."""
    chosen = list(chosen or [])
    return chosen + ["coarsen"] if grain != NO_GRAIN and "coarsen" not in chosen else chosen


def build(ctx: TabContext) -> None:
    """The Your prompt tab."""
    page = ctx.page
    with gr.Tab("Your prompt", id="your-prompt"):
        gr.Markdown(AUDIT_INTRO)
        with gr.Row():
            with gr.Column(scale=2):
                log = log_widgets()
            with gr.Column(scale=1):
                run = run_widgets(page.registry.profile.max_audit_tokens or 128)
        one = one_prompt_widgets(ONE_PROMPT_INTRO)
        shown = results()
        rewrite = rewrite_widgets()
        export_button, export_files = export_widgets()
        policy = policy_widgets()
    measure = run.measure
    measure.grain.input(
        with_coarsen,
        inputs=[measure.grain, measure.repairs],
        outputs=measure.repairs,
        **UI_ONLY,
        show_progress="hidden",
    )
    wire_log(page, log)
    wire_audit(page, log, run, shown)
    wire_one_prompt(page, log, run, one, shown)
    wire_axes_and_notes(page, shown)
    wire_open_in_notes(ctx, shown)
    wire_rewrite(page, log, run, rewrite)
    wire_export(page, shown, export_button, export_files)
    wire_policy(page, policy)
