"""The Your prompt tab's components, made in page order, each group that travels together one dataclass: the log given,
the settings (what the model pass measures; the engines simulated), the run's buttons, one prompt, the result panels,
Open in Notes, the rewrite, and the exports."""

from __future__ import annotations

from dataclasses import dataclass, fields

import gradio as gr

from kvscope.app.handlers.audit_settings import AUDIT_REPAIRS, AUTO_ENGINE, DEFAULTS, NO_GRAIN
from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider
from kvscope.app.page import PAIRED_PLOT_MIN_WIDTH
from kvscope.engine import DEFAULT_SAMPLE, GRAINS, OBSERVED_ENGINES, REPAIR_SUMMARIES, CacheSettings, ServerSize, bundled_logs
from kvscope.viz.audit import ENGINE_LABELS
from kvscope.viz.text import glossary


def by_name(group) -> dict[str, gr.components.Component]:
    """A group's components by field name: an event's keyword inputs (the handler's dataclass has the same names)."""
    return {field.name: getattr(group, field.name) for field in fields(group)}


@dataclass(frozen=True)
class LogWidgets:
    """The log the tab audits: a bundled demo, an upload (its path kept, named in ``info``) or the text box."""

    demo: gr.Dropdown
    upload: gr.UploadButton
    info: gr.Markdown
    uploaded: gr.State  # the uploaded file's path: the audit reads it while the text box is empty
    text: gr.Textbox


@dataclass(frozen=True)
class MeasureWidgets:
    """What the model pass measures, named as :class:`~kvscope.app.handlers.audit_settings.AuditInputs` names it."""

    repairs: gr.CheckboxGroup
    tokens: gr.Slider
    threshold: gr.Number
    min_agreement: gr.Slider
    grain: gr.Dropdown


@dataclass(frozen=True)
class EngineWidgets:
    """The simulated engines, named as :class:`~kvscope.app.handlers.audit_settings.EngineInputs` names them."""

    block: gr.Number
    budget_blocks: gr.Number
    budget_tokens: gr.Number
    cache_reuse: gr.Number
    observed_engine: gr.Dropdown
    replicas: gr.Textbox
    gpu_gib: gr.Number
    gpu_memory_utilization: gr.Number
    mem_fraction_static: gr.Number
    cpu_kvcache_gib: gr.Number
    llama_ctx: gr.Number
    llama_parallel: gr.Number


@dataclass(frozen=True)
class RunWidgets:
    """The audit's settings, its sample, and its buttons and status."""

    measure: MeasureWidgets
    engines: EngineWidgets
    sample: gr.Slider
    audit: gr.Button
    cancel: gr.Button
    status: gr.Markdown


@dataclass(frozen=True)
class OnePromptWidgets:
    """One prompt with a value changed: its candidate spans, the span or text to change, and the new value."""

    find_spans: gr.Button
    candidates: gr.HTML
    candidate: gr.Dropdown
    find: gr.Textbox
    new_value: gr.Textbox
    audit: gr.Button


def log_widgets() -> LogWidgets:
    """The demo menu, the upload button and the text box."""
    with gr.Row(equal_height=True):
        demo = gr.Dropdown(list(bundled_logs()), value=None, label="Bundled demo log", elem_id="audit-demo", scale=1)
        # a button, not a file box: a second upload replaces the first without clearing it first
        upload = gr.UploadButton(
            "…or upload a log or a prompt", file_types=[".jsonl", ".json", ".txt"], type="filepath", elem_id="audit-upload", scale=1
        )
    info = gr.Markdown(elem_id="audit-upload-info")
    uploaded = gr.State(None)
    text = gr.Textbox(
        label="Request log (JSONL or a JSON array of requests), or one prompt (text or messages JSON)",
        lines=12,
        max_lines=24,
        elem_id="audit-input",
    )
    return LogWidgets(demo, upload, info, uploaded, text)


def measure_widgets(most_tokens: int) -> MeasureWidgets:
    """The repairs, N greedy tokens (at most ``most_tokens``), the recommendation's bars and coarsen's grain."""
    repairs = LenientCheckboxGroup(
        AUDIT_REPAIRS,
        value=[name for name in AUDIT_REPAIRS if name != "coarsen"],  # coarsen needs a grain (picking one ticks it)
        label="Repairs (recompute, the exact reference, always runs)",
        info=glossary(REPAIR_SUMMARIES),
        elem_id="audit-repairs",
    )
    tokens = LenientSlider(
        1, most_tokens, value=min(DEFAULTS.tokens, most_tokens), step=1, label="N: greedy tokens per state", elem_id="audit-tokens"
    )
    threshold = gr.Number(DEFAULTS.threshold, label="KL threshold (nats, next token)", elem_id="audit-threshold")
    min_agreement = LenientSlider(
        0, 1, value=DEFAULTS.min_agreement, step=0.05, label="Minimum share of greedy tokens agreeing", elem_id="audit-min-agreement"
    )
    grain = gr.Dropdown([NO_GRAIN, *GRAINS], value=NO_GRAIN, label="coarsen: the date-time grain", elem_id="audit-grain")
    return MeasureWidgets(repairs, tokens, threshold, min_agreement, grain)


def engine_widgets() -> EngineWidgets:
    """The simulated engines' settings, folded away."""
    with gr.Accordion("Simulated engines", open=False, elem_id="audit-engine-settings"):
        return EngineWidgets(
            # 0: the block a vLLM log's counts show, else the default (``ScanSettings.for_log``)
            block=gr.Number(0, precision=0, label=f"vLLM block size (0: the log's, else {CacheSettings.block})", elem_id="audit-block"),
            budget_blocks=gr.Number(0, precision=0, label="vLLM block budget (0: unbounded)", elem_id="audit-budget-blocks"),
            budget_tokens=gr.Number(0, precision=0, label="SGLang token budget (0: unbounded)", elem_id="audit-budget-tokens"),
            cache_reuse=gr.Number(0, precision=0, label="llama.cpp --cache-reuse N (0: off)", elem_id="audit-cache-reuse"),
            observed_engine=gr.Dropdown(
                [("as the log's answers name it (else vLLM)", AUTO_ENGINE), *((ENGINE_LABELS[name], name) for name in OBSERVED_ENGINES)],
                value=AUTO_ENGINE,
                label="the server the log's observed cached tokens are compared with",
                elem_id="audit-observed-engine",
            ),
            replicas=gr.Textbox(
                "", label="Fleets: replica counts behind each router, e.g. 2,4,8 (empty: one server)", elem_id="audit-replicas"
            ),
            **server_size_widgets(),
        )


def server_size_widgets() -> dict[str, gr.Number]:
    """The budgets as a server of this size computes them for the loaded model, where a budget above is 0 (the CLI's
    server-size flags; 0: not given)."""
    gr.Markdown("Budgets from a server's size (each engine's budget left at 0 is computed as its server computes it):")
    with gr.Row():
        sizes = {
            "gpu_gib": gr.Number(0, label="GPU memory, GiB (--gpu-memory-gib)", elem_id="audit-gpu-gib"),
            "gpu_memory_utilization": gr.Number(
                ServerSize.gpu_memory_utilization, label="vLLM --gpu-memory-utilization", elem_id="audit-gpu-utilization"
            ),
            "mem_fraction_static": gr.Number(0, label="SGLang --mem-fraction-static (0: 0.88 assumed)", elem_id="audit-mem-fraction"),
        }
    with gr.Row():
        sizes |= {
            "cpu_kvcache_gib": gr.Number(0, label="vLLM CPU: VLLM_CPU_KVCACHE_SPACE, GiB", elem_id="audit-cpu-kvcache"),
            "llama_ctx": gr.Number(0, precision=0, label="llama.cpp -c, tokens", elem_id="audit-llama-ctx"),
            "llama_parallel": gr.Number(0, precision=0, label="llama.cpp -np (0: auto, 4 slots)", elem_id="audit-llama-parallel"),
        }
    return sizes


def run_widgets(most_tokens: int) -> RunWidgets:
    """The settings column: what is measured, the sample, the engines, and Audit / Cancel with the run's status."""
    measure = measure_widgets(most_tokens)
    sample = LenientSlider(
        0,
        10,
        value=DEFAULT_SAMPLE,
        step=1,
        label="--sample K: turns the model measures per change signature (0: the token pass only)",
        elem_id="audit-sample",
    )
    engines = engine_widgets()
    with gr.Row():
        audit = gr.Button("Audit the log", variant="primary", elem_id="run-audit", scale=2)
        cancel = gr.Button("Cancel", variant="stop", visible=False, elem_id="cancel-audit", scale=1)
    status = gr.Markdown(elem_id="audit-status")
    return RunWidgets(measure, engines, sample, audit, cancel, status)


def one_prompt_widgets(intro: str) -> OnePromptWidgets:
    """The folded "One prompt" part."""
    with gr.Accordion("One prompt: change a value", open=False, elem_id="audit-one-prompt"):
        gr.Markdown(intro)
        find_spans = gr.Button("Find volatile spans", elem_id="audit-find-spans")
        candidates = gr.HTML(elem_id="audit-candidates")
        with gr.Row():
            candidate = gr.Dropdown([], value=None, label="Candidate span", elem_id="audit-choice")
            find = gr.Textbox(label="…or the text to change (its first occurrence)", elem_id="audit-find")
            new_value = gr.Textbox(label="New value", elem_id="audit-new-value")
            audit = gr.Button("Audit this change", variant="primary", elem_id="run-audit-value")
    return OnePromptWidgets(find_spans, candidates, candidate, find, new_value, audit)


def paired_plots(left: tuple[str, str], right: tuple[str, str], min_width: int = PAIRED_PLOT_MIN_WIDTH) -> tuple[gr.Plot, gr.Plot]:
    """Two plots side by side (wrapping one to a row on a narrow page), each given as (label, elem_id)."""
    with gr.Row():
        return tuple(gr.Plot(label=label, elem_id=elem_id, min_width=min_width) for label, elem_id in (left, right))
