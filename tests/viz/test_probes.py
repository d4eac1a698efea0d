"""Probe figures: dose-response, suffix, read heads, linear probe and attribution."""

import json

import numpy as np
import pytest

from kvscope.engine.probes import Gap, probe_heads, probe_knockout, probe_suffix
from kvscope.engine.probes.attribution import AttributionResult, Feature, captum_attribution
from kvscope.engine.probes.linear import GROUPS, LinearProbeResult, Sample
from kvscope.viz.probes import (
    attribution_figure,
    dose_response_figure,
    heads_figure,
    linear_probe_figure,
    suffix_figure,
)


@pytest.fixture(scope="module")
def knockout(experiment):
    return probe_knockout(experiment, ks=[0, 1, 4], seeds=2)


def test_dose_response_plots_recovery_of_top_and_random(knockout):
    figure = dose_response_figure(knockout)
    top, mean, draws = figure.data
    assert list(top.x) == [0, 1, 4]
    assert list(top.y) == pytest.approx([p.top.recovery for p in knockout.points])
    assert list(mean.x) == [1, 4]  # K = 0 has no random control
    assert list(mean.y) == pytest.approx([p.random.recovery for p in knockout.points[1:]])
    assert len(draws.y) == 2 * 2
    assert "recovery" in figure.layout.yaxis.title.text
    assert sorted(shape.y0 for shape in figure.layout.shapes) == pytest.approx([0.0, 1.0])


def test_dose_response_falls_back_to_margins_when_the_gap_is_too_small(knockout):
    gap = Gap(-0.1, -0.12, "no", "no", min_gap=0.25)
    small = type(knockout)(gap, knockout.points)
    figure = dose_response_figure(small)
    assert list(figure.data[0].y) == pytest.approx([p.top.margin for p in knockout.points])
    assert figure.layout.yaxis.title.text == "decision margin"
    assert "nothing to recover" in figure.layout.title.text.replace("</sup><br><sup>", " ")


def test_suffix_has_all_layers_each_band_and_random(experiment):
    result = probe_suffix(experiment, ks=[1, 2], seeds=1)
    figure = suffix_figure(result)
    names = [trace.name for trace in figure.data]
    assert names[0] == "top-K, all layers" and len(names) == 1 + len(result.bands) + 2
    assert any(name.startswith("top-K, early") for name in names)
    assert list(figure.data[0].y) == pytest.approx([p.all_layers.recovery for p in result.points])
    late = next(trace for trace in figure.data if trace.name.startswith("top-K, late"))
    assert list(late.y) == pytest.approx([p.bands["late"].recovery for p in result.points])
    assert figure.layout.xaxis.type == "log"


def test_heads_map_is_layers_by_heads_with_top_heads_marked(experiment):
    result = probe_heads(experiment, heads=3, notes=2, seeds=2)
    figure = heads_figure(result)
    heatmap, marks, bars, draws = figure.data
    assert np.asarray(heatmap.z).shape == np.asarray(result.mass_last).shape
    assert np.allclose(heatmap.z, result.mass_last)
    assert list(zip(marks.y, marks.x)) == result.top_heads and list(marks.text) == ["1", "2", "3"]
    assert list(bars.x) == ["top heads", "random heads", "all heads"]
    assert bars.y[0] == pytest.approx(1 - result.top.recovery)
    assert bars.y[1] == pytest.approx(1 - result.random.recovery)
    assert len(draws.y) == 2
    json.loads(figure.to_json())


def _linear_result(write=1, decodable=True) -> LinearProbeResult:
    layers = 4
    rise = [0.5, 0.6, 0.95, 1.0, 1.0]
    return LinearProbeResult(
        model="tiny",
        scenario="s<cript>",
        field="status",
        num_layers=layers,
        samples=[Sample(f"v{i}", "a" if i % 2 else "b", "yes" if i < 4 else "no") for i in range(8)],
        conclusion={g: (rise if decodable and g != "others" else None) for g in GROUPS},
        value={g: [1.0] * (layers + 1) for g in GROUPS},
        conclusion_decodable=decodable,
        reason=None if decodable else "all 8 samples lead to 'yes'",
        write_layer=write,
        lens=[["no", "no", "yes", "yes", "yes"]] * 4 + [["no"] * 5] * 4,
        ms=1.0,
    )


def test_linear_probe_lines_per_group_with_write_and_commit():
    result = _linear_result()
    for source in (result, result.as_dict()):
        figure = linear_probe_figure(source)
        conclusion = [t for t in figure.data if t.xaxis == "x"]
        assert [t.name for t in conclusion] == ["field", "aggregators", "decision"]  # "others" has no accuracies
        assert list(conclusion[1].y) == [0.5, 0.6, 0.95, 1.0, 1.0] and list(conclusion[1].x) == [0, 1, 2, 3, 4]
        assert len([t for t in figure.data if t.xaxis == "x2"]) == len(GROUPS)
        vertical = sorted({shape.x0 for shape in figure.layout.shapes if shape.x0 == shape.x1})
        assert vertical == [result.write_layer, result.commit_layer] == [1, 2]
        chance = {shape.y0 for shape in figure.layout.shapes if shape.y0 == shape.y1}
        assert chance == {0.5}
        assert "s&lt;cript&gt;" in figure.layout.title.text.replace("</sup><br><sup>", " ")


def test_linear_probe_says_why_the_conclusion_is_not_decodable():
    figure = linear_probe_figure(_linear_result(write=None, decodable=False))
    assert all(t.xaxis == "x2" for t in figure.data)
    assert any("all 8 samples" in (a.text or "") for a in figure.layout.annotations)
    assert {shape.x0 for shape in figure.layout.shapes if shape.x0 == shape.x1} == {2}  # the commit layer only


def test_attribution_bars_equal_the_scores_in_reading_order(length_change):
    result = captum_attribution(length_change, method="ablation", granularity="segments")
    figure = attribution_figure(result)
    (bars,) = figure.data
    assert bars.orientation == "h" and list(bars.x) == pytest.approx([f.score for f in result.features])
    assert len(set(bars.y)) == len(result.features) and figure.layout.yaxis.autorange == "reversed"
    field = [i for i, f in enumerate(result.features) if f.kind.startswith("field:")]
    assert field and all(bars.marker.line.width[i] == 2 for i in field)


def test_attribution_keeps_the_strongest_and_truncates_labels():
    features = [Feature(i, i + 1, f"line {i} " + "x" * 80 + "\x1b\n", "context", float(i % 7 - 3)) for i in range(100)]
    result = AttributionResult("tiny", "s", "stale", "ablation", "tokens", "margin", "<pad>", 1.0, 0.0, features, 1.0)
    figure = attribution_figure(result, top=10)
    (bars,) = figure.data
    assert len(bars.x) == 10 and all(abs(v) == 3 for v in bars.x)
    assert all(len(label) < 60 and "\x1b" not in label for label in bars.y)
    assert "top 10 of 100" in figure.layout.title.text.replace("</sup><br><sup>", " ")
