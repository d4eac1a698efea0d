"""Composition figures: logit bars, K/V deviation and the agent episode."""

import json
import math

import numpy as np
import pytest
import torch

from kvscope.engine.cache.decision import decide
from kvscope.engine.compose.agent import run_agent
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.placing import adhoc_scenario
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.viz.common import MAX_COLUMNS, NARROWEST_PLOT_PX, label_box
from kvscope.viz.compose import agent_figure, deviation_figure, logit_bars_figure
from tests.viz.figure_cases import WIDTHS


@pytest.fixture(scope="module")
def store():
    return SkillStore()


@pytest.fixture(scope="module")
def fidelity(lm, store):
    return compare(lm, adhoc_scenario(["account_gate"]), store, remedy=Remedy())


def _decision(logits):
    return decide({"yes": {"yes": -0.5}, "no": {"no": -1.0}}, torch.tensor(logits))


def test_logit_bars_show_the_union_of_both_top_k_side_by_side():
    spliced, recomputed = _decision([5.0, 4.0, 0.0, 0.0, 3.0]), _decision([5.0, 0.0, 4.0, 0.0, 0.0])
    agreement = {"cosine": 0.5, "kl": 0.125}  # the comparison's stored numbers are shown, not recomputed
    figure = logit_bars_figure(spliced, recomputed, agreement, lambda i: ["a", " b", "\n", "<x>", "a"][i], k=2)
    first, second = figure.data
    assert (first.name, second.name) == ("spliced", "recomputed") and figure.layout.barmode == "group"
    assert list(first.customdata) == [0, 2, 1]  # union {0, 1} ∪ {0, 2}, ordered by the recomputed probability
    assert list(second.x) == ["a", "⏎", "·b"]
    assert np.allclose(first.y, torch.softmax(torch.tensor([5.0, 4.0, 0.0, 0.0, 3.0]), -1)[[0, 2, 1]].numpy())
    title = figure.layout.title.text.replace("</sup><br><sup>", " ")  # the subtitle wraps
    assert "cosine 0.500000, KL(spliced‖recomputed) 1.25e-01" in title
    duplicated = logit_bars_figure(spliced, recomputed, agreement, lambda i: "a", k=2)
    assert len(set(duplicated.data[0].x)) == 3  # equal texts stay apart


def test_logit_bars_on_real_decisions(fidelity, lm):
    figure = logit_bars_figure(fidelity.spliced, fidelity.recomputed, fidelity.agreement, lambda i: lm.tokenizer.decode([i]), k=5)
    assert 5 <= len(figure.data[0].x) <= 10 and "cosine" in figure.layout.title.text
    json.loads(figure.to_json())


def test_deviation_map_equals_the_fidelity_deviation(fidelity, lm):
    figure = deviation_figure(fidelity)
    (heatmap,) = figure.data
    assert np.asarray(heatmap.z).shape == tuple(fidelity.deviation.shape)
    assert np.allclose(heatmap.z, fidelity.deviation.numpy())
    texts = ["tok"] * fidelity.deviation.shape[1]
    assert "tok" in deviation_figure(fidelity, texts).layout.xaxis.ticktext
    with pytest.raises(ValueError, match="token texts"):
        deviation_figure(fidelity, texts[1:])


def test_long_deviation_map_is_pooled(fidelity):
    long = type(fidelity)(**{**fidelity.__dict__, "deviation": torch.rand(3, 1500)})
    z = np.asarray(deviation_figure(long).data[0].z)
    assert z.shape[0] == 3 and z.shape[1] <= MAX_COLUMNS


def test_agent_episode_shows_three_decisions_per_turn_and_cumulative_ttft(lm, store):
    report = run_agent(lm, adhoc_scenario(["account_gate"]), store, turns=3, toggle=True, policy="every:2")
    figure = agent_figure(report)
    cached, clean, identical, wrong = figure.data[:4]
    assert list(cached.x) == [0, 1, 2, 3]
    assert list(cached.y) == pytest.approx([t.cached.margin for t in report.turns])
    assert list(clean.y) == pytest.approx([t.clean.margin for t in report.turns])
    assert list(identical.y) == pytest.approx([t.identical.margin for t in report.turns])
    assert list(wrong.x) == [t.turn for t in report.turns if t.cached.label != t.clean.label]
    ttft = figure.data[4:]
    assert list(ttft[0].y) == pytest.approx(np.cumsum([t.cached_ms for t in report.turns]))
    assert list(ttft[1].y) == pytest.approx(np.cumsum([t.clean_ms for t in report.turns]))
    assert sum(shape.type == "line" and shape.x0 == shape.x1 for shape in figure.layout.shapes) == sum(t.compacted for t in report.turns)
    json.loads(figure.to_json())


def test_keystone_diagonal_places_each_strategy_at_its_two_recoveries(lm, store):
    from kvscope.engine.compose.keystone import keystone
    from kvscope.engine.scenario import Scenario, bundled_scenarios
    from kvscope.viz.compose import keystone_figure

    report = keystone(
        lm,
        Scenario.load(bundled_scenarios()["keystone_safety"]),
        store,
        remedy=Remedy(seam=1),
        strategies=("field_only", "erratum", "full_downstream"),
    )
    figure = keystone_figure(report, band=0.15)
    points = figure.data[2]
    gaps = {name: gap for name, gap in report.recovery_gaps().items() if gap is not None}
    assert list(points.text) == list(gaps)
    assert list(points.x) == pytest.approx([report.recomputed.strategies[n].recovery.value for n in gaps])
    assert list(points.y) == pytest.approx([report.composed.strategies[n].recovery.value for n in gaps])
    red = [colour == "#d62828" for colour in points.marker.color]
    assert red == [abs(gap) > 0.15 for gap in gaps.values()]
    assert f"{report.delta_margin:+.2f}" in figure.layout.title.text.replace("</sup><br><sup>", " ")
    json.loads(figure.to_json())


def _label_boxes(figure, width: int) -> tuple[list, list, tuple[float, float]]:
    """The strategies' label boxes and marker boxes (px from the plot area's bottom left) where a ``width`` px figure draws
    them, and the plot area's size."""
    layout, points = figure.layout, figure.data[2]
    plot = width - layout.margin.l - layout.margin.r, layout.height - layout.margin.t - layout.margin.b
    (x0, x1), (y0, y1) = layout.xaxis.range, layout.yaxis.range
    at = [((a - x0) / (x1 - x0) * plot[0], (b - y0) / (y1 - y0) * plot[1]) for a, b in zip(points.x, points.y)]
    labels = [label_box(a, b, text, place, points.marker.size) for (a, b), text, place in zip(at, points.text, points.textposition)]
    markers = [(a - 6, a + 6, b - 6, b + 6) for a, b in at]
    return labels, markers, plot


@pytest.mark.parametrize("remedy", ["prefix+seam:16", "splice", "seam:1", "prefix+ape:1,0.7", "prefix+seam:1+blend:0.7"])
@pytest.mark.parametrize("width", [NARROWEST_PLOT_PX, *WIDTHS["full"].values()])
def test_keystone_labels_cover_no_other_label_or_point_and_stay_inside_the_axes(remedy, width):
    """The embedded model's stored keystone (six strategies, erratum and field_erratum 0.08 apart in the top right
    corner): each name is placed clear of the others and of every other point, nearer its own point than any other, and
    within the axis ranges, at the app's narrowest width and wider."""
    from kvscope.viz.compose import keystone_figure
    from tests.viz.figure_cases import stored_keystone

    report = stored_keystone(remedy)
    figure = keystone_figure(report)
    points = figure.data[2]
    assert list(points.text) == [name for name, gap in report.recovery_gaps().items() if gap is not None]
    labels, markers, (right, top) = _label_boxes(figure, width)
    clash = lambda a, b: min(a[1], b[1]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[2], b[2])  # noqa: E731
    centre = lambda box: ((box[0] + box[1]) / 2, (box[2] + box[3]) / 2)  # noqa: E731
    for i, box in enumerate(labels):
        assert 0 <= box[0] and box[1] <= right and 0 <= box[2] and box[3] <= top, (points.text[i], box, (right, top))
        assert not any(clash(box, other) for j, other in enumerate(labels) if j != i), points.text[i]
        assert not any(clash(box, marker) for j, marker in enumerate(markers) if j != i), points.text[i]
        nearest = min(range(len(markers)), key=lambda j: math.dist(centre(box), centre(markers[j])))
        assert nearest == i, f"{points.text[i]} reads as {points.text[nearest]}'s label"
    # the band and the diagonal span the grown axes
    band, diagonal = figure.data[0], figure.data[1]
    assert min(diagonal.x) <= figure.layout.xaxis.range[0] and max(diagonal.x) >= figure.layout.xaxis.range[1]
    assert min(band.x) <= figure.layout.xaxis.range[0] and max(band.y) >= figure.layout.yaxis.range[1]


def test_place_labels_moves_a_crowded_label_and_widens_the_range_for_one_at_the_edge():
    from kvscope.viz.common import place_labels

    # two points 10 px apart: the second label cannot sit above its point too; a point at the right edge
    placed = place_labels([0.0, 0.02, 1.0], [0.5, 0.5, 0.5], ["first", "second", "a_long_name_at_the_edge"], (0, 1), (0, 1), (500, 300))
    assert placed.positions[0] == "top center" and placed.positions[1] != "top center"
    assert placed.x_range[0] < 0 or placed.positions[0] != "middle left"
    assert placed.x_range[1] > 1 or placed.positions[2] in ("middle left", "top left", "bottom left")
    assert place_labels([], [], [], (0, 1), (0, 1), (500, 300)).positions == []


def test_study_figure_puts_each_remedy_at_its_recompute_share_and_agreement():
    from kvscope.viz.compose import study_figure

    row = lambda fraction, agreement, ranked: {  # noqa: E731
        "recomputed_fraction": fraction,
        "agreement": agreement,
        "agree_decisive": 3,
        "decisive": 4,
        "ties": 1,
        "needs_reference": ranked,
        "cosine": {"median": 0.99},
        "speedup": {"median": 2.0},
        "by_n": {"1": {"mean_abs_margin_error": 0.1}, "2": {"mean_abs_margin_error": 0.3}},
    }
    study = {"summary": {"splice": row(0.0, 0.75, False), "deviation:0.3": row(0.3, 1.0, True)}, "best": "splice", "cases": [{}] * 5}
    figure = study_figure(study)
    markers = [trace for trace in figure.data if trace.mode == "markers"]
    assert [(m.x[0], m.y[0]) for m in markers] == [(0.0, 0.75), (30.0, 1.0)]
    assert [m.marker.symbol for m in markers] == ["circle", "circle-open"]
    lines = [trace for trace in figure.data if trace.mode == "lines+markers"]
    assert list(lines[0].x) == [1, 2] and list(lines[0].y) == [0.1, 0.3]
    assert "best deployable: splice" in figure.layout.title.text.replace("</sup><br><sup>", " ")


def test_frontiers_figure_draws_each_model_beside_the_other_with_its_own_default_and_goal():
    from kvscope.engine.compose.choice import choice_record
    from kvscope.viz.compose import frontiers_figure

    def row(agree, speedup, fraction=0.0):
        return {
            "agree_decisive": agree,
            "decisive": 10,
            "ties": 2,
            "agreement": agree / 10,
            "speedup": {"min": speedup, "median": speedup, "max": speedup},
            "recomputed_fraction": fraction,
            "mean_abs_margin_error": 0.1,
            "needs_reference": False,
        }

    small = {"splice": row(8, 6.0), "prefix+seam:1+blend:0.3": row(10, 3.5, 0.3)}
    large = {"splice": row(10, 5.0), "prefix+ape:0.9,0.9": row(10, 4.8)}
    gaps = ({"splice": 0.6, "prefix+seam:1+blend:0.3": 0.07}, {})  # the small model's keystone: splice fails its bar
    studies = [
        {"model": m, "dtype": d, "summary": s, **choice_record(s, g)}
        for (m, d, s), g in zip((("e:small", "float32", small), ("q:large", "bfloat16", large)), gaps)
    ]
    figure = frontiers_figure(studies)
    drawn = [trace for trace in figure.data if trace.mode == "markers" and trace.x[0] is not None]
    assert [(m.name, m.xaxis, m.x[0], m.y[0]) for m in drawn] == [
        ("splice", "x", 6.0, 0.8),
        ("prefix+seam:1+blend:0.3", "x", 3.5, 1.0),
        ("splice", "x2", 5.0, 1.0),
        ("prefix+ape:0.9,0.9", "x2", 4.8, 1.0),
    ]
    assert drawn[0].marker.color == drawn[2].marker.color and not any(m.showlegend for m in drawn)
    # each panel stars its own default; a remedy past the keystone bar is open, one unmeasured there filled
    assert [m.marker.symbol for m in drawn] == ["circle-open", "star", "star", "circle"]
    legend = [trace for trace in figure.data if trace.mode == "markers" and trace.x[0] is None]
    assert [m.name for m in legend] == ["splice", "prefix+seam:1+blend:0.3", "prefix+ape:0.9,0.9"]  # one plain dot each
    assert all(m.marker.symbol is None and m.showlegend is not False for m in legend)
    assert [a.text for a in figure.layout.annotations][:2] == ["small (float32)", "large (bfloat16)"]
    assert [shape.x0 for shape in figure.layout.shapes] == [pytest.approx(0.7 * 6.0), pytest.approx(0.7 * 5.0)]
    with pytest.raises(ValueError, match="at least one stored study"):
        frontiers_figure([])
