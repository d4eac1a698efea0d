"""Every figure builder of kvscope/viz/, each drawn from small inputs (tiny-model engine results, the stored benchmark JSON, the
figure tests' own dictionaries), with the width the app gives it: the figure tests that look at all figures at once
(legibility in a browser, no template braces left) take them from here."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, replace
from pathlib import Path

import plotly.graph_objects as go
import torch

from kvscope.engine.cache.decision import Decision, Recovery, decide, recovery
from kvscope.engine.cache.patching import attribution_effects
from kvscope.engine.compose.agent import run_agent
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.keystone import KeystoneReport, keystone
from kvscope.engine.compose.placing import adhoc_scenario
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.report import EditReport, NotesShare
from kvscope.engine.edit.strategies import StrategyResult
from kvscope.engine.edit.weight_edit import MethodOutcome, WeightEditReport
from kvscope.engine.probes import probe_attention, probe_heads, probe_knockout, probe_notes_map, probe_suffix
from kvscope.engine.probes.attribution import captum_attribution
from kvscope.engine.probes.frontier import probe_frontier
from kvscope.engine.scenario import Scenario, bundled_scenarios
from kvscope.viz import audit, benchmarks, common, compose, decision, fleet, models, notes, probes, results, strategies, weights
from tests.viz.test_audit import DATA, TRAFFIC
from tests.viz.test_models import COMPARISON
from tests.viz.test_probes import _linear_result

ROOT = Path(__file__).resolve().parents[2]
RESULTS = {path.stem: json.loads(path.read_text()) for path in sorted(ROOT.glob("benchmarks/*/results/*.json"))}
# The width (px) of a plot in the app at a 1,000 and a 1,400 px window, measured in chromium: Gradio's container is
# 768 px wide below 1,024 px and 1,280 px below 1,536 px (32 px padding each side); a plot in a row of two is set to wrap
# below 560 px, so it has the whole width at 1,000 px and half of it at 1,400 px.
WIDTHS = {"full": {1000: 704, 1400: 1216}, "half": {1000: 704, 1400: 600}}


ROUTINGS = ("round_robin", "session", "prefix", "least_loaded")
FLEET = {  # one server's hit rates and four routers at 2 and 8 replicas (the audit's JSON keys)
    "engines": {"hit_rate": {"vllm": 0.52, "sglang": 0.54, "llama_cpp": 0.49}},
    "fleet": [
        {
            "replicas": replicas,
            "routing": routing,
            "reused_tokens": {engine: 1000 * rank for engine in ("vllm", "sglang", "llama_cpp")},
            "hit_rate": {engine: 0.54 * rank / 4 / (replicas / 2) ** (rank < 3) for engine in ("vllm", "sglang", "llama_cpp")},
        }
        for replicas in (2, 8)
        for rank, routing in enumerate(ROUTINGS, 1)
    ],
}


@dataclass(frozen=True)
class Case:
    """A figure as the app shows it: the builder's name, the figure, and whether it fills the row or shares it."""

    builder: str
    figure: go.Figure
    layout: str = "full"

    def width(self, window: int) -> int:
        return WIDTHS[self.layout][window]


def figure_builders() -> set[str]:
    """Every public function of kvscope/viz/ annotated to return a figure (``go.Figure`` or a list of them)."""
    names = set()
    for path in sorted((ROOT / "kvscope" / "viz").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and "Figure" in ast.unparse(node.returns or ""):
                names.add(node.name)
    return names


def _layer_token_map() -> go.Figure:
    """The layer × token heatmap the notes, attention and deviation figures share, on 4 layers of a 12-token prompt with
    one field (its columns pooled and outlined as theirs are)."""
    texts = ["Status", ":", " shipped", ".", "\n", "Refund", "?", " The", " order", " is", " shipped", "."]
    segments = ["context"] * 2 + ["field:status"] + ["context"] * 9
    z = torch.arange(48, dtype=torch.float32).reshape(4, 12).numpy() / 48
    figure, _, _ = common.layer_token_map(z, "prompt token", texts, list(range(12)), segments, colorscale="Blues")
    return figure


def _scaled(report, stale: float, oracle: float):
    """``report`` with its margins mapped linearly so that stale and oracle read ``stale`` and ``oracle`` (a tiny random
    model's margins are hundredths; a real edit's are units, e.g. −1.24 → +2.81), recoveries recomputed."""
    low, high = report.stale.decision.margin, report.oracle.decision.margin
    span = (high - low) or 1.0

    def moved(result):
        if result.decision is None:
            return result
        margin = stale + (result.decision.margin - low) / span * (oracle - stale)
        value = recovery(margin, stale, oracle)
        return replace(
            result, decision=replace(result.decision, margin=margin), recovery=value if value.value is not None else Recovery(1.0)
        )

    return replace(
        report,
        stale=moved(report.stale),
        oracle=moved(report.oracle),
        strategies={name: moved(result) for name, result in report.strategies.items()},
    )


def stored_keystone(remedy: str = DEFAULT_REMEDY.name, stem: str = "keystone-embedded-cpu") -> KeystoneReport:
    """The keystone the app draws on the embedded model (its stored run, ``benchmarks/studies/results``), with ``remedy``:
    six strategies, erratum and field_erratum a few hundredths apart near the top right corner."""
    stored = RESULTS[stem]["remedies"][remedy]

    def result(name: str, row: dict) -> StrategyResult:
        decision = Decision(row["scores"], {}, row["margin"], row["decision"], torch.zeros(1))
        return StrategyResult(name, row["applicable"], decision, Recovery(row["recovery"]), row["tokens_recomputed"], row["ms"])

    def side(key: str) -> EditReport:
        rows = {name: result(name, row[key]) for name, row in stored["strategies"].items()}
        stale, oracle = rows.pop("stale"), rows.pop("oracle")
        notes = NotesShare(None, None, None, stale.decision.label, oracle.decision.label)
        return EditReport("embedded", RESULTS[stem]["scenario"], stored["field"], "old", "new", stale, oracle, rows, notes)

    return KeystoneReport(stored["field"], Remedy.parse(remedy), side("composed"), side("recomputed"))


def _weight_report(row: dict) -> WeightEditReport:
    return WeightEditReport(**{**row, "methods": {name: MethodOutcome(**outcome) for name, outcome in row["methods"].items()}})


def _study_row(agree: int, speedup: float, fraction: float, reference: bool = False) -> dict:
    return {
        "recomputed_fraction": fraction,
        "agreement": agree / 10,
        "agree_decisive": agree,
        "decisive": 10,
        "ties": 1,
        "needs_reference": reference,
        "cosine": {"median": 0.99},
        "speedup": {"min": speedup, "median": speedup, "max": speedup},
        "by_n": {"1": {"mean_abs_margin_error": 0.1}, "2": {"mean_abs_margin_error": 0.3}, "3": {"mean_abs_margin_error": 0.5}},
    }


def _linear_probe_data() -> dict:
    """A linear probe on a 24-layer model whose conclusion is written at layer 12 and commits at 13 (adjacent lines)."""
    data = _linear_result().as_dict()
    rise = [min(1.0, 0.5 + 0.04 * layer) for layer in range(25)]
    accuracy = {target: {group: (None if rows[group] is None else rise) for group in rows} for target, rows in data["accuracy"].items()}
    return {**data, "num_layers": 24, "accuracy": accuracy, "write_layer": 12, "commit_layer": 13}


def every_case(lm, experiment, length_change) -> list[Case]:
    """One or more figures of every builder (several where its inputs take different shapes)."""
    store = SkillStore()
    report = length_change.report(("stale", "field_only", "erratum", "full_downstream", "oracle"))
    same_length = experiment.report(("stale", "field_only", "erratum", "field_erratum", "full_downstream", "oracle"))
    fidelity = compare(lm, adhoc_scenario(["account_gate"]), store, remedy=Remedy())
    texts, segments = experiment.stale.notebook.token_texts(), experiment.stale.notebook.visible_segments()
    effects = attribution_effects(
        experiment.stale.notebook,
        experiment.oracle.notebook,
        experiment.prompt,
        experiment.field_positions + experiment.downstream_positions,
    )
    notes_map = probe_notes_map(experiment, top=4)
    knockout = probe_knockout(experiment, ks=[0, 1, 4], seeds=2)
    keystone_report = keystone(
        lm,
        Scenario.load(bundled_scenarios()["keystone_safety"]),
        store,
        remedy=Remedy(seam=1),
        strategies=("field_only", "erratum", "full_downstream"),
    )
    yes_no = decide({"dispense": {" dispense": -0.3, " Dispense": -1.9}, "hold": {" hold": -2.1}}, torch.zeros(4))
    weight = _weight_report(RESULTS["weight_edit-embedded-cpu"]["rows"][0])
    study = {
        "summary": {
            "splice": _study_row(7, 6.1, 0.0),
            "prefix+seam:16": _study_row(10, 4.2, 0.12),
            "tail:8": _study_row(9, 5.0, 0.05),
            "deviation:0.3": _study_row(10, 1.3, 0.3, reference=True),
        },
        "best": "prefix+seam:16",
        "cases": [{}] * 52,
    }
    studies = [RESULTS["compose_many-embedded-cpu"], RESULTS["compose_many-qwen-1.5b-cpu"]]
    cases = [
        Case("strategy_figure", strategies.strategy_figure(_scaled(same_length, -1.24, 2.81)), "half"),
        Case("strategy_figure", strategies.strategy_figure(_scaled(report, -0.47, 1.93)), "half"),
        Case("decision_figure", decision.decision_figure(yes_no, title="after knockout")),
        Case("attention_figure", notes.attention_figure(probe_attention(experiment).oracle), "half"),
        Case("effect_map_figure", notes.effect_map_figure(effects, texts, segments), "half"),
        Case("effect_map_figure", notes.effect_map_figure(effects, texts, segments, all_positions=True), "half"),
        Case("notes_map_figure", notes.notes_map_figure(notes_map), "half"),
        Case("frontier_figure", notes.frontier_figure(probe_frontier(experiment)), "half"),
        Case("dose_response_figure", probes.dose_response_figure(knockout)),
        Case("suffix_figure", probes.suffix_figure(probe_suffix(experiment, ks=[1, 2, 4], seeds=1))),
        Case("heads_figure", probes.heads_figure(probe_heads(experiment, heads=3, notes=2, seeds=2))),
        Case("linear_probe_figure", probes.linear_probe_figure(_linear_probe_data())),
        Case("linear_probe_figure", probes.linear_probe_figure(_linear_result(write=None, decodable=False))),
        Case("attribution_figure", probes.attribution_figure(captum_attribution(length_change, method="ablation", granularity="segments"))),
        Case(
            "readings_figure",
            probes.readings_figure("trigger", {"stale_margin": -1.2, "oracle_margin": 2.8, "found": {"margin": 2.1, "label": "yes"}}),
        ),
        Case("probe_figure", probes.probe_figure("knockout", knockout)),
        Case(
            "logit_bars_figure",
            compose.logit_bars_figure(fidelity.spliced, fidelity.recomputed, fidelity.agreement, lambda i: lm.tokenizer.decode([i]), k=5),
            "half",
        ),
        Case("deviation_figure", compose.deviation_figure(fidelity), "half"),
        Case(
            "agent_figure",
            compose.agent_figure(run_agent(lm, adhoc_scenario(["account_gate"]), store, turns=4, toggle=True, policy="every:2")),
        ),
        Case("keystone_figure", compose.keystone_figure(keystone_report)),
        Case("keystone_figure", compose.keystone_figure(stored_keystone())),  # the app's: labels crowd the top right
        Case("keystone_figure", compose.keystone_figure(stored_keystone("splice"))),
        Case("study_figure", compose.study_figure(study)),
        Case("remedy_choice_figure", compose.remedy_choice_figure(RESULTS["compose_many-embedded-cpu"])),
        Case("remedy_choice_figure", compose.remedy_choice_figure(RESULTS["compose_many-long-embedded-cpu"])),
        Case("frontiers_figure", compose.frontiers_figure(studies)),
        Case("weight_edit_figure", weights.weight_edit_figure(weight)),
        Case("notes_share_figure", models.notes_share_figure(COMPARISON)),
        Case("model_metrics_figure", models.model_metrics_figure(COMPARISON)),
        Case("reuse_timeline_figure", audit.reuse_timeline_figure(DATA), "half"),
        Case("fidelity_cost_figure", audit.fidelity_cost_figure(DATA), "half"),
        Case("fidelity_cost_figure", audit.fidelity_cost_figure(DATA, "ttft", "agreement"), "half"),
        Case("session_timeline_figure", audit.session_timeline_figure(TRAFFIC), "half"),
        Case("engine_reuse_figure", audit.engine_reuse_figure(TRAFFIC), "half"),
        Case("fleet_figure", fleet.fleet_figure(FLEET)),
        Case("message_figure", common.message_figure("run an edit first: the notes map belongs to an edit")),
        Case("layer_token_map", _layer_token_map()),
    ]
    stored = {stem: data for stem, data in RESULTS.items() if results.result_kind(stem) in results.FIGURES}
    for stem, data in stored.items():
        builder = results.FIGURES[results.result_kind(stem)]
        cases.append(Case(builder.__name__, builder(data)))
    serving = {stem: data for stem, data in stored.items() if results.result_kind(stem) == "serving"}
    cases.append(Case("serving_engines_figure", benchmarks.serving_engines_figure(serving)))
    cases.append(Case("result_figures", results.result_figures({"ttft-x": RESULTS["ttft-refund_gate-embedded-cpu"]})[0]))
    return cases
