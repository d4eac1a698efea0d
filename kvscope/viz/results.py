"""Stored benchmark results drawn by kind: a file ``benchmarks/<folder>/results/<kind>-….json`` gets its kind's figure."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import plotly.graph_objects as go

from kvscope.viz import benchmarks, compose

FIGURES: dict[str, Callable[[dict], go.Figure]] = {  # result kind (the file stem before its first "-") -> its figure
    "ttft": benchmarks.ttft_figure,
    "edit": benchmarks.edit_latency_figure,
    "prefill": benchmarks.prefill_figure,
    "serving": benchmarks.serving_figure,
    "agent": benchmarks.agent_policy_figure,
    "soak": benchmarks.soak_figure,
    "compose_many": compose.remedy_choice_figure,
    "cache_reuse": benchmarks.cache_reuse_figure,
    "image": benchmarks.image_splice_figure,
    "compare_models": benchmarks.compare_models_figure,
    "audit": benchmarks.audit_benchmark_figure,
    "audit_replay": benchmarks.audit_replay_figure,
    "audit_cli": benchmarks.audit_cli_figure,
    "greedy_lookup": benchmarks.greedy_lookup_figure,
    "forward_paths": benchmarks.forward_paths_figure,
    "chat_replay": benchmarks.chat_replay_figure,
    "deploy": benchmarks.deploy_figure,
}


def result_kind(stem: str) -> str:
    """A result file's kind: its stem up to the first ``-`` (``ttft-refund_gate-cpu`` → ``ttft``)."""
    return stem.split("-")[0]


def result_figures(results: Mapping[str, dict]) -> list[go.Figure]:
    """A figure per result of a kind in ``FIGURES``, in order; with two or more serving results, the engines side by side
    before them."""
    figures = []
    serving = {stem: data for stem, data in results.items() if result_kind(stem) == "serving" and data.get("workload", "edit") == "edit"}
    for stem, data in results.items():
        if len(serving) > 1 and stem == next(iter(serving)):  # the engines side by side, before their own figures
            figures.append(benchmarks.serving_engines_figure(serving))
        if result_kind(stem) in FIGURES:
            figures.append(FIGURES[result_kind(stem)](data))
    return figures
