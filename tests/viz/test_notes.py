"""Context text, attention, notes-map and frontier figures: data equal the inputs, big maps pooled, labels safe."""

import html
import json
import re

import numpy as np
import pytest

from kvscope.engine.cache.patching import attribution_effects
from kvscope.engine.probes import probe_attention, probe_notes_map
from kvscope.engine.probes.frontier import probe_frontier
from kvscope.viz.common import MAX_COLUMNS, robust_limit
from kvscope.viz.notes import (
    attention_figure,
    effect_map_figure,
    frontier_figure,
    notes_map_figure,
    token_text_html,
)


@pytest.fixture(scope="module")
def notes_map(experiment):
    return probe_notes_map(experiment, top=4)


@pytest.fixture(scope="module")
def attention(experiment):
    return probe_attention(experiment)


def test_token_text_keeps_every_token_value_and_line(notes_map):
    values = list(notes_map.per_position())
    page = token_text_html(notes_map.token_texts, values, notes_map.segments, value_name="Δ margin")
    spans = re.findall(r'<span class="kv-tok( kv-field)?" title="([^"]*)" data-value="([^"]*)"', page)
    assert len(spans) == len(values)
    assert [float(value) for *_, value in spans] == pytest.approx(values, rel=1e-3, abs=1e-6)
    field = [i for i, segment in enumerate(notes_map.segments) if segment.startswith("field:")]
    assert [i for i, (outlined, *_) in enumerate(spans) if outlined] == field
    assert "field:request_id" in spans[field[0]][1]
    assert html.unescape(re.sub(r"<[^>]+>", "", page.split('class="kv-body">', 1)[1])) == "".join(notes_map.token_texts)
    assert f'data-tokens="{len(values)}"' in page


def test_token_text_colours_on_a_robust_symmetric_scale():
    values = [0.0, 0.1, -0.1, 0.05] * 25 + [50.0]  # one outlier must not wash the rest out
    page = token_text_html([f"t{i}" for i in range(len(values))], values, ["s"] * len(values))
    limit = float(re.search(r'data-limit="([^"]+)"', page).group(1))
    assert limit == pytest.approx(robust_limit(np.asarray(values)), rel=1e-3) and limit < 1.0
    alphas = [float(a) for a in re.findall(r"rgba\((?:214,39,40|31,119,180),([0-9.]+)\)", page.split('class="kv-body">', 1)[1])]
    assert alphas[1] == pytest.approx(0.85 * 0.1 / limit, abs=2e-3) and alphas[-1] == pytest.approx(0.85)
    assert "rgba(31,119,180" in page and "rgba(214,39,40" in page


def test_token_text_escapes_markup_and_checks_lengths():
    page = token_text_html(["<script>x</script>", "&amp;", "\n"], [0.0, 1.0, 2.0], ['seg"><b>', "s", "s"])
    assert "<script>" not in page and "&lt;script&gt;" in page and "&amp;amp;" in page
    assert '"><b>' not in page
    with pytest.raises(ValueError, match="must match"):
        token_text_html(["a"], [1.0, 2.0], ["s"])


def test_effect_map_defaults_to_field_and_downstream_and_can_show_every_position(experiment):
    texts, segments = experiment.stale.notebook.token_texts(), experiment.stale.notebook.visible_segments()
    effects = attribution_effects(
        experiment.stale.notebook,
        experiment.oracle.notebook,
        experiment.prompt,
        experiment.field_positions + experiment.downstream_positions,
    )
    narrow, wide = (effect_map_figure(effects, texts, segments, all_positions=flag).data[0] for flag in (False, True))
    assert np.asarray(narrow.z).shape == (effects.effects.shape[0], len(effects.positions))
    assert np.asarray(wide.z).shape == (effects.effects.shape[0], len(texts))
    first = effects.positions[0]
    assert np.allclose(np.asarray(wide.z)[:, :first], 0) and np.allclose(np.asarray(wide.z)[:, first:], narrow.z)
    limit = robust_limit(np.asarray(narrow.z))
    assert narrow.zmin == pytest.approx(-limit) and narrow.zmax == pytest.approx(limit) and limit > 0


def test_attention_map_from_the_probe_is_layers_by_tokens(attention):
    stale = attention.stale
    array = np.asarray(stale.attention)
    figure = attention_figure(stale)
    (heatmap,) = figure.data
    assert np.asarray(heatmap.z).shape == (array.shape[0], array.shape[2])
    assert np.allclose(heatmap.z, array.mean(1), atol=1e-6)
    assert len(heatmap.x) == array.shape[2] and len(set(heatmap.x)) == len(heatmap.x)
    assert "mean over heads" in figure.layout.title.text


def test_attention_one_head_and_plain_array():
    array = np.random.default_rng(0).random((3, 2, 5)).astype(np.float32)
    figure = attention_figure(array, texts=list("abcde"), head=1)
    assert np.allclose(figure.data[0].z, array[:, 1])
    assert list(figure.layout.xaxis.ticktext) == list("abcde")
    with pytest.raises(ValueError, match="head 2"):
        attention_figure(array, head=2)
    with pytest.raises(ValueError, match="layers, heads, tokens"):
        attention_figure(array[0])
    with pytest.raises(ValueError, match="token texts"):
        attention_figure(array, texts=["a"])


def test_big_attention_map_is_pooled_below_the_cap():
    array = np.zeros((4, 2, 3000), dtype=np.float32)
    array[2, :, 2999] = 0.9
    figure = attention_figure(array, texts=["t"] * 3000)
    z = np.asarray(figure.data[0].z)
    assert z.shape[0] == 4 and z.shape[1] <= MAX_COLUMNS and z.dtype == np.float32
    assert z.max() == pytest.approx(0.9) and z[2, -1] == pytest.approx(0.9)
    assert len(figure.layout.xaxis.tickvals) <= 40


def test_notes_map_z_equals_the_effects_with_checks_marked(notes_map):
    figure = notes_map_figure(notes_map)
    heatmap, marks = figure.data
    assert heatmap.type == "heatmap" and marks.type == "scatter"
    effects = np.asarray(notes_map.effects, dtype=np.float32)
    assert np.asarray(heatmap.z).shape == effects.shape
    assert np.allclose(heatmap.z, effects) and heatmap.zmin == -heatmap.zmax and heatmap.colorscale is not None
    assert list(marks.y) == [check.layer for check in notes_map.entry_checks]
    columns = list(heatmap.x)
    assert [columns.index(x) for x in marks.x] == [notes_map.positions.index(c.position) for c in notes_map.entry_checks]
    assert all("exact Δ" in text for text in marks.hovertext)
    json.loads(figure.to_json())


def test_frontier_figure_draws_every_point_with_its_recovery(experiment):
    result = probe_frontier(experiment)
    figure = frontier_figure(result)
    assert [trace.name for trace in figure.data] == result.methods()
    for trace in figure.data:
        points = [p for p in result.points if p.method == trace.name]
        assert list(trace.x) == pytest.approx([100 * p.fraction for p in points])
        assert list(trace.y) == pytest.approx([p.recovery for p in points])
        assert list(trace.marker.symbol) == ["circle" if p.correct else "circle-open" for p in points]
    assert figure.layout.xaxis.type == "log" and "Notes" in figure.layout.title.text
    json.loads(figure.to_json())
