"""The model comparison's figures and table: the paper's points beside the compared models, strings escaped."""

from kvscope.viz.benchmarks import compare_models_figure
from kvscope.viz.models import comparison_markdown, dropped_markdown, model_metrics_figure, notes_share_figure

PAPER = [
    {"model": "Mistral-7B", "parameters": 7_240_000_000, "field_only_recovery": 0.137, "notes_share": 0.863},
    {"model": "Llama-3.1-8B", "parameters": 8_030_000_000, "field_only_recovery": -0.028, "notes_share": 1.028},
]


def _row(model: str, parameters: int, share: float | None, missing: dict | None = None) -> dict:
    return {
        "model": model,
        "parameters": parameters,
        "notes_share": share,
        "recoveries": {"field_only": None if share is None else 1 - share, "erratum": 0.5, "field_erratum": 0.9},
        "notes_depth": 0.42,
        "read_heads": 7,
        "splice_cosine": 0.999,
        "details": {"dtype": "float32", "stale_decision": "no", "oracle_decision": "yes", "heads": 336, "missing": missing or {}},
    }


COMPARISON = {
    "scenario": "Refund <b>gate</b>",
    "field": "refund_eligible",
    "old": "false",
    "new": "true",
    "strategies": ["field_only", "erratum", "field_erratum"],
    "splice_skill": "refund_policy",
    "remedy": "prefix+seam:1+blend:0.7",
    "models": [
        _row("embedded:Qwen2.5-Coder-0.5B-Instruct", 630_167_424, 0.63),
        _row("smollm2:SmolLM2-135M-Instruct", 134_515_008, None, {"notes_share": "nothing to recover"}),
    ],
    "paper": PAPER,
}


def test_notes_share_figure_puts_the_paper_beside_the_models():
    figure = notes_share_figure(COMPARISON)
    names = [trace.name for trace in figure.data]
    assert names == ["Qwen2.5-Coder-0.5B-Instruct", "Mistral-7B (paper)", "Llama-3.1-8B (paper)"]
    assert [list(trace.y) for trace in figure.data[1:]] == [[0.863], [1.028]] and figure.layout.xaxis.type == "log"
    assert len({trace.marker.symbol for trace in figure.data[1:]}) == 2  # each paper model its own symbol
    assert all(trace.mode == "markers" and trace.cliponaxis is False for trace in figure.data)  # names in the legend, none clipped
    subtitle = figure.layout.title.text.replace("</sup><br><sup>", " ")
    assert "<b>" not in subtitle and "undefined for SmolLM2-135M-Instruct" in subtitle
    assert notes_share_figure({"models": []}).layout.annotations


def test_metrics_figure_and_table():
    figure = model_metrics_figure(COMPARISON)
    assert [trace.name for trace in figure.data[:3]] == ["field_only", "erratum", "field_erratum"]
    table = comparison_markdown(COMPARISON)
    assert "Refund &lt;b&gt;gate&lt;/b&gt;" in table and "7 of 336" in table and "| 0.630 |" in table
    assert "notes\\_share is missing: nothing to recover" in table and "Llama\\-3\\.1\\-8B 1.028" in table
    assert dropped_markdown([]) == "" and "dropped a" in dropped_markdown(["dropped a (4.0 GB)"])


def test_the_benchmark_figure_draws_every_model():
    summary = {
        "splice": {"cosine": {"median": 0.97}, "agreement": 0.5},
        "prefix+seam:1+blend:0.7": {"cosine": {"median": 0.999}, "agreement": 1.0},
    }
    data = {
        "dtype": "float32",
        "models": [
            {
                "model": "embedded:Qwen",
                "parameters": 6e8,
                "calibrate": {"total": 20, "flipping": 11, "notes_demos": 7},
                "study": {"summary": summary},
            },
            {
                "model": "qwen-1.5b:Qwen",
                "parameters": 1.5e9,
                "calibrate": {"total": 20, "flipping": 12, "notes_demos": 8},
                "study": {"summary": summary},
            },
        ],
    }
    figure = compare_models_figure(data)
    assert {trace.name for trace in figure.data} >= {"flip under a clean prefill", "notes demos"}
    assert "float32" in figure.layout.title.text


def test_the_side_by_side_names_are_upright_short_lines_inside_their_own_panel():
    long = "smollm2:HuggingFaceTB/SmolLM2-135M-Instruct"
    comparison = COMPARISON | {"models": [COMPARISON["models"][0] | {"model": long}]}
    figure = model_metrics_figure(comparison)
    names = {name for trace in figure.data for name in trace.x}
    assert names == {"HuggingFace<br>TB/SmolLM2-<br>135M-…"} and all(len(line) <= 11 for line in next(iter(names)).split("<br>"))
    assert {axis.tickangle for axis in (figure.layout.xaxis, figure.layout.xaxis2, figure.layout.xaxis3, figure.layout.xaxis4)} == {0}
    assert figure.layout.xaxis.domain[1] < figure.layout.xaxis2.domain[0]  # two panels a row, each half the width
