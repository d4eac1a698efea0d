"""The edit-report figure on real tiny-model reports."""

import json

import pytest

from kvscope.engine.cache.decision import Recovery
from kvscope.engine.edit.strategies import StrategyResult
from kvscope.viz.common import GREY
from kvscope.viz.strategies import strategy_figure


@pytest.fixture(scope="module")
def report(length_change):
    return length_change.report(("stale", "field_only", "erratum", "full_downstream", "oracle"))


def _bars(figure):
    return {name: (trace, i) for trace in figure.data for i, name in enumerate(trace.x)}


def test_every_applicable_strategy_is_a_bar_at_its_margin(report):
    figure = strategy_figure(report)
    bars = _bars(figure)
    assert set(bars) == set(report.strategies)
    for name, result in report.strategies.items():
        trace, i = bars[name]
        if result.applicable:
            assert trace.y[i] == pytest.approx(result.decision.margin)
            assert trace.name == f"decision: {result.decision.label}"
    assert all(trace.type == "bar" for trace in figure.data)
    assert list(figure.layout.xaxis.categoryarray) == list(report.strategies)


def test_not_applicable_strategy_is_grey_with_its_reason_in_hover(report):
    assert not report.strategies["field_only"].applicable
    trace, i = _bars(strategy_figure(report))["field_only"]
    assert trace.name == "not applicable" and trace.marker.color == GREY
    assert "not applicable" in trace.hovertext[i] and "tokens" in trace.hovertext[i]
    assert trace.text[i] == "n/a"


def test_stale_and_oracle_are_reference_lines(report):
    figure = strategy_figure(report)
    levels = sorted(shape.y0 for shape in figure.layout.shapes)
    assert levels == pytest.approx(sorted([report.stale.decision.margin, report.oracle.decision.margin]))
    texts = " ".join(a.text for a in figure.layout.annotations)
    assert "stale" in texts and "oracle" in texts


def test_recovery_is_annotated_when_defined(experiment):
    report = experiment.report(("field_only", "full_downstream"))
    trace, i = _bars(strategy_figure(report))["full_downstream"]
    assert trace.text[i] == f"R {report.strategies['full_downstream'].recovery.value:.2f}"


def test_user_text_in_hover_is_escaped(report):
    hostile = StrategyResult("field_only", False, reason="value <script>\x07 \n is 2 tokens")
    report = type(report)(**{**report.__dict__, "strategies": {"field_only": hostile}, "field": "a<b>"})
    figure = strategy_figure(report)
    hover = figure.data[-1].hovertext[0]
    assert "<script>" not in hover and "&lt;script&gt;" in hover and "\x07" not in hover
    assert "a&lt;b&gt;" in figure.layout.title.text
    json.loads(figure.to_json())


def test_auto_names_its_choice(report):
    auto = StrategyResult("auto", True, report.stale.decision, Recovery(None, "too small"), detail={"chosen": "erratum"})
    report = type(report)(**{**report.__dict__, "strategies": {"auto": auto}})
    assert "auto chose erratum" in strategy_figure(report).data[0].hovertext[0]
