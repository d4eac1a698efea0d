"""Figures and text views of an 8k-token edit stay small and exact: per-token axes pooled below MAX_COLUMNS
(each column the strongest value of its run), the text view drawn as windows around the field and the
strongest notes, everything else summarised."""

import html
import json
import re

import numpy as np
import pytest

from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.placing import with_skills
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.probes import AttentionMap
from kvscope.engine.probes.analysis import analyse_edit
from kvscope.engine.probes.attribution import AttributionResult, Feature
from kvscope.viz.common import MAX_COLUMNS, pool_columns
from kvscope.viz.compose import deviation_figure
from kvscope.viz.notes import (
    MAX_TEXT_TOKENS,
    attention_figure,
    effect_map_figure,
    effect_text_html,
    shown_tokens,
)
from kvscope.viz.probes import attribution_figure
from tests.shared import long_scenario

TOKENS = 8192
MAX_FIGURE_BYTES = 200_000  # a pooled 8k-token map measures ~46 kB; unpooled it would be ~1 MB per layer row set
MAX_TEXT_BYTES = 250_000  # 1,024 drawn tokens of ~160 bytes each; all 8k tokens were 1.26 MB


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def analysis(lm):
    experiment = EditExperiment(lm, long_scenario(lm.tokenizer, TOKENS), settings=EditSettings(min_gap=0.01), capture_attention=True)
    return analyse_edit(experiment, ["field_only"])  # the oracle's attention and the notes effects are what is drawn


def _strongest(values: np.ndarray, runs) -> np.ndarray:
    """Ground truth of a pooled map: per run of columns, the value of largest magnitude (layers, runs)."""
    return np.stack([values[:, run][np.arange(len(values)), np.abs(values[:, run]).argmax(1)] for run in runs], 1)


def _runs(names: list[str], positions: list[int]) -> list[range]:
    """The source columns of each pooled column, read back from the positions in its hover name ("#a–#b (...)"
    or "#a"); ``positions`` are the source columns' positions."""
    column = {position: index for index, position in enumerate(positions)}
    runs = []
    for name in names:
        first, _, last = re.match(r"#(\d+)(–#?(\d+))?", name).groups()
        runs.append(range(column[int(first)], column[int(last or first)] + 1))
    assert runs[0].start == 0 and runs[-1].stop == len(positions) and all(a.stop == b.start for a, b in zip(runs, runs[1:]))
    return runs


def test_attention_at_8k_tokens_is_pooled_small_and_keeps_each_runs_peak(analysis):
    oracle = analysis.attention.oracle
    array = np.asarray(oracle.attention, dtype=np.float32)  # (layers, heads, tokens)
    assert array.shape[2] > 8000
    for head in (None, 1):
        figure = attention_figure(oracle, head=head)
        (heatmap,) = figure.data
        assert len(figure.to_json()) < MAX_FIGURE_BYTES
        assert len(heatmap.x) <= MAX_COLUMNS and len(figure.layout.xaxis.tickvals) <= 40
        source = array.mean(1) if head is None else array[:, head]
        runs = _runs(list(heatmap.x), oracle.positions)
        assert np.allclose(heatmap.z, _strongest(source, runs), atol=1e-7)
        assert float(np.asarray(heatmap.z).max()) == pytest.approx(float(source.max()))
        (outline,) = figure.layout.shapes  # the field, findable among 8k pooled tokens
        field = [column for column, run in enumerate(runs) if any(oracle.segments[i].startswith("field:") for i in run)]
        assert (outline.x0, outline.x1) == (field[0] - 0.5, field[-1] + 0.5)
        assert [note.text for note in figure.layout.annotations] == ["request_id"]


@pytest.mark.parametrize("all_positions", [False, True])
def test_notes_map_at_8k_tokens_is_pooled_small_and_keeps_signed_peaks(analysis, all_positions):
    effects, notebook = analysis.effects, analysis.experiment.stale.notebook
    texts, segments = notebook.token_texts(), notebook.visible_segments()
    figure = effect_map_figure(effects, texts, segments, all_positions=all_positions)
    (heatmap,) = figure.data
    assert len(figure.to_json()) < MAX_FIGURE_BYTES and len(heatmap.x) <= MAX_COLUMNS
    source = effects.effects.numpy()
    if all_positions:
        source = np.concatenate([np.zeros((len(source), effects.positions[0]), dtype=np.float32), source], 1)
    positions = list(range(source.shape[1])) if all_positions else effects.positions
    assert source.shape[1] > 4000
    assert np.allclose(heatmap.z, _strongest(source, _runs(list(heatmap.x), positions)), atol=1e-7)


def test_text_view_at_8k_tokens_draws_windows_around_the_field_and_strongest_notes(analysis):
    effects, notebook = analysis.effects, analysis.experiment.stale.notebook
    texts, segments = notebook.token_texts(), notebook.visible_segments()
    values = np.zeros(len(texts), dtype=np.float32)
    values[effects.positions] = effects.per_position().numpy()
    page = effect_text_html(effects, texts, segments)
    assert len(page.encode()) < MAX_TEXT_BYTES
    spans = re.findall(r'<span class="kv-tok( kv-field)?" title="#(\d+) [^"]*" data-value="([^"]*)"', page)
    drawn = [int(position) for _, position, _ in spans]
    hidden = [int(count) for count in re.findall(r'data-hidden="(\d+)"', page)]
    assert len(drawn) == MAX_TEXT_TOKENS and drawn == sorted(drawn)
    assert len(drawn) + sum(hidden) == len(texts) and f'data-tokens="{len(texts)}"' in page
    assert [float(value) for *_, value in spans] == pytest.approx(values[drawn].tolist(), rel=1e-3, abs=1e-6)
    field = analysis.experiment.field_positions
    assert [p for (outlined, p, _) in spans if outlined] == [str(p) for p in field]
    strongest = np.argsort(-np.abs(values))[:20]
    assert set(strongest.tolist()) <= set(drawn)
    assert f"showing {MAX_TEXT_TOKENS:,} of {len(texts):,} tokens" in page


def test_shown_tokens_take_the_field_then_the_strongest_with_neighbours():
    values = np.zeros(5000)
    values[4000], values[100] = -3.0, 2.0
    outlined = np.zeros(5000, dtype=bool)
    outlined[2500:2502] = True
    shown = shown_tokens(values, outlined, cap=99)
    assert int(shown.sum()) == 99
    assert shown[2484:2518].all() and shown[3984:4017].all()  # the field ±16 (34), the strongest ±16 (33)
    assert np.flatnonzero(shown[:2000]).tolist() == list(range(84, 116))  # the 32 left, nearest the next strongest first
    assert shown_tokens(values[:50], outlined[:50], cap=99).all()


def test_each_field_is_outlined_over_its_pooled_columns():
    segments = ["context"] * 3000
    segments[1000:1003] = ["field:a"] * 3
    segments[2990:2995] = ["field:b<"] * 5
    figure = attention_figure(AttentionMap("no", list(range(3000)), ["t"] * 3000, segments, np.zeros((2, 1, 3000)).tolist(), {}))
    step = len(pool_columns(np.zeros((1, 3000)))[1][0])
    assert [(shape.x0, shape.x1) for shape in figure.layout.shapes] == [
        (1000 // step - 0.5, 1002 // step + 0.5),
        (2990 // step - 0.5, 2994 // step + 0.5),
    ]
    assert [note.text for note in figure.layout.annotations] == ["a", "b&lt;"]


def test_deviation_at_8k_tokens_is_pooled_small(lm):
    scenario = with_skills(long_scenario(lm.tokenizer, TOKENS), ["refund_policy"])
    fidelity = compare(lm, scenario, SkillStore())
    figure = deviation_figure(fidelity)
    (heatmap,) = figure.data
    deviation = fidelity.deviation.float().numpy()
    assert deviation.shape[1] > 8000 and len(heatmap.x) <= MAX_COLUMNS and len(figure.to_json()) < MAX_FIGURE_BYTES
    assert np.allclose(heatmap.z, _strongest(deviation, _runs(list(heatmap.x), list(range(deviation.shape[1])))), atol=1e-7)


def test_attribution_of_8k_token_features_shows_the_strongest_forty():
    scores = np.random.default_rng(0).normal(size=TOKENS)
    features = [Feature(i, i + 1, f"t{i}<", "field:x" if i == 7 else "context", float(score)) for i, score in enumerate(scores)]
    result = AttributionResult("tiny", "long", "stale", "gradient", "tokens", "margin", "<pad>", 1.0, 0.0, features, 1.0, 8)
    figure = attribution_figure(result)
    (bars,) = figure.data
    top = sorted(np.argsort(-np.abs(scores))[:40].tolist())
    assert list(bars.x) == pytest.approx(scores[top].tolist())
    assert list(bars.y) == [f"#{i} t{i}&lt;" for i in top]
    assert len(figure.to_json()) < 50_000 and figure.layout.height <= 1400
    assert f"top 40 of {TOKENS} features" in html.unescape(figure.layout.title.text.replace("</sup><br><sup>", " "))
    json.loads(figure.to_json())
