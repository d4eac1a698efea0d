"""Benchmarks: figures of the stored results, and a quick live TTFT check on the loaded model."""

from __future__ import annotations

import gradio as gr

from kvscope.app.handlers.benchmarks import benchmark_results, quick_ttft
from kvscope.app.page import step_progress
from kvscope.app.tabs import TabContext
from kvscope.viz.common import figure_label
from kvscope.viz.results import result_figures

PLOT_SLOTS = 40  # stored results shown at most (hidden slots wait for more)


def build(ctx: TabContext) -> None:
    """The Benchmarks tab."""
    page = ctx.page
    with gr.Tab("Benchmarks", id="benchmarks"):
        gr.Markdown("Results written by the scripts under `benchmarks/` (JSON in each folder's `results/`).")
        bench_refresh = gr.Button("Show stored results", elem_id="bench-refresh")
        bench_quick = gr.Button("Run a quick TTFT check live (2 lengths)", elem_id="bench-quick")
        bench_plots = [gr.Plot(label="Stored result", visible=False, elem_id=f"bench-plot-{index}") for index in range(PLOT_SLOTS)]
        # One result's JSON at a time: all of them (1.4 MB) kept the browser busy for a minute before a figure showed.
        bench_pick = gr.Dropdown(label="A result's JSON", choices=[], value=None, elem_id="bench-pick")
        bench_json = gr.JSON(label="Result")
        shown_results = gr.State({})

    def shown(results: dict, pick: str | None = None) -> tuple:
        figures = result_figures(results)[:PLOT_SLOTS]
        updates = [gr.update(value=figure, visible=True, label=figure_label(figure)) for figure in figures]
        updates += [gr.update(visible=False)] * (PLOT_SLOTS - len(figures))
        return (*updates, gr.update(choices=list(results), value=pick), results.get(pick), results)

    outputs = [*bench_plots, bench_pick, bench_json, shown_results]
    bench_refresh.click(lambda: shown(benchmark_results()), outputs=outputs, api_name="benchmarks", concurrency_limit=None)
    bench_pick.input(lambda pick, results: results.get(pick), inputs=[bench_pick, shown_results], outputs=bench_json, api_name=False)

    @page.action
    def on_quick(spec, progress=gr.Progress()):
        return shown({"ttft-live": quick_ttft(page.registry, spec, progress=step_progress(progress))}, "ttft-live")

    bench_quick.click(on_quick, inputs_kwargs={"spec": page.spec}, outputs=outputs, api_name="benchmark_quick", **page.model_bound())
