"""Token strip, attention and notes-map figures: data equal the inputs, big maps pooled, labels safe."""
import json

import numpy as np
import pytest

from engine.probes import probe_attention, probe_notes_map
from viz.common import MAX_COLUMNS
from viz.notes import attention_figure, notes_map_figure, token_strip_figure


@pytest.fixture(scope="module")
def notes_map(experiment):
    return probe_notes_map(experiment, top=4)


@pytest.fixture(scope="module")
def attention(experiment):
    return probe_attention(experiment)


def test_token_strip_wraps_rows_and_keeps_values(notes_map):
    values = notes_map.per_position()
    figure = token_strip_figure(notes_map.token_texts, values, notes_map.segments, "Notes per position", value_name="Δ margin")
    (heatmap,) = figure.data
    z = np.asarray(heatmap.z)
    rows = -(-len(values) // 24)
    assert z.shape == (rows, 24)
    assert np.allclose(z.flatten()[: len(values)], values, atol=1e-6) and np.isnan(z.flatten()[len(values):]).all()
    assert np.asarray(heatmap.text).flatten()[0] == "·REQ"
    assert "field:request_id" in np.asarray(heatmap.hovertext).flatten()[0]
    json.loads(figure.to_json())


def test_token_strip_diverges_at_zero_only_with_both_signs():
    mixed = token_strip_figure(["a", "b"], [-1.0, 1.0], ["x", "x"]).data[0]
    positive = token_strip_figure(["a", "b"], [0.1, 1.0], ["x", "x"]).data[0]
    assert mixed.zmid == 0 and positive.zmid is None
    assert mixed.colorscale != positive.colorscale


def test_token_strip_escapes_control_characters_and_checks_lengths():
    figure = token_strip_figure(["\x1b[0m", "<i>", "\n"], [0.0, 1.0, 2.0], ["seg\x00", "s", "s"])
    cells = list(np.asarray(figure.data[0].text).flatten()[:3])
    assert cells == ["�[0m", "&lt;i&gt;", "⏎"]
    assert "\x00" not in figure.to_json() and "\\u0000" not in figure.to_json()
    with pytest.raises(ValueError, match="must match"):
        token_strip_figure(["a"], [1.0, 2.0], ["s"])


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
    assert np.allclose(heatmap.z, effects) and heatmap.zmid == 0 and heatmap.colorscale is not None
    assert list(marks.y) == [check.layer for check in notes_map.entry_checks]
    columns = list(heatmap.x)
    assert [columns.index(x) for x in marks.x] == [notes_map.positions.index(c.position) for c in notes_map.entry_checks]
    assert all("exact Δ" in text for text in marks.hovertext)
    json.loads(figure.to_json())
