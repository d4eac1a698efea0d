"""Probes on a tiny random model: exact identities and mechanics (tiny models do not flip decisions)."""

import json
from dataclasses import replace

import pytest
import torch

from kvscope.engine.cache.notebook import Knockout, Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.probes import (
    ProbeError,
    probe_attention,
    probe_false_note,
    probe_heads,
    probe_knockout,
    probe_locality,
    probe_notes_map,
    probe_suffix,
    probe_trigger,
)
from kvscope.engine.probes.registry import PROBES
from kvscope.engine.scenario import Scenario, bundled_scenarios, render

ATOL = 1e-5
# The request-id scenario keeps the context length under the tiny tokenizer (REQ-1042 → REQ-7719);
# the refund gate's false → true does not, and " never" → " only" is a one-token rule flip after the field.
SAME_LENGTH = "request_id_control"
LENGTH_CHANGE = "refund_gate"
TRIGGER = {"find": "never", "replace": "only"}


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def _experiment(lm, name: str = SAME_LENGTH, **options) -> EditExperiment:
    return EditExperiment(lm, Scenario.load(bundled_scenarios()[name]), **options)


@pytest.fixture(scope="module")
def experiment(lm):
    return _experiment(lm)


def _margin(experiment: EditExperiment, notebook: Notebook, knockout=None) -> float:
    return notebook.read_prompt(experiment.prompt, knockout=knockout).margin


def _with_donor(experiment: EditExperiment, notebook: Notebook) -> EditExperiment:
    """The same edit measured against another reference notebook (e.g. a small perturbation)."""
    donor = replace(experiment.oracle, notebook=notebook, decision=notebook.read_prompt(experiment.prompt))
    return EditExperiment(
        experiment.lm, experiment.scenario, experiment.field, experiment.new, experiment.settings, stale=experiment.stale, oracle=donor
    )


CAUSAL_PROBES = ["locality", "notes_map", "suffix", "knockout", "heads", "false_note", "trigger", "attention"]


def test_registry_names_every_probe():
    assert list(PROBES) == [*CAUSAL_PROBES, "linear", "attribution", "frontier"]


@pytest.mark.parametrize("name", CAUSAL_PROBES)
def test_every_result_is_json_ready_and_reports_progress(experiment, name):
    calls = []
    options = TRIGGER if name == "trigger" else {}
    result = PROBES[name](experiment, progress=lambda done, total: calls.append((done, total)), **options)
    data = json.loads(json.dumps(result.as_dict()))
    assert data and calls[-1][0] == calls[-1][1]
    assert [done for done, _ in calls] == list(range(1, len(calls) + 1))


def test_locality_full_downstream_is_the_oracle(experiment):
    result = probe_locality(experiment)
    assert result.full_downstream.margin == pytest.approx(experiment.oracle.decision.margin, abs=1e-4)
    assert result.full_downstream.recovery == pytest.approx(1.0, abs=1e-3)
    assert result.field_only is not None and not result.reasons


def test_locality_reports_field_only_not_applicable_for_a_length_change(lm):
    result = probe_locality(_experiment(lm, LENGTH_CHANGE))
    assert result.field_only is None and "tokens" in result.reasons["field_only"]
    assert result.full_downstream is not None


def test_notes_map_layout(experiment):
    result = probe_notes_map(experiment, top=4)
    layers = len(experiment.stale.notebook.keys)
    assert result.positions == experiment.field_positions + experiment.downstream_positions
    assert len(result.effects) == layers and all(len(row) == len(result.positions) for row in result.effects)
    assert result.segments[0] == "field:request_id" and len(result.token_texts) == len(result.positions)
    assert len(result.entry_checks) == 4 and len(result.position_checks) >= 8
    data = result.as_dict()
    gap = experiment.oracle.decision.margin - experiment.stale.decision.margin
    assert data["per_position_fraction"][0] == pytest.approx(result.per_position()[0] / gap, abs=1e-4)


def test_notes_map_of_a_run_with_itself_is_exactly_zero(lm):
    same = _experiment(lm, new="REQ-1042")
    result = probe_notes_map(same, exact=True)
    assert all(value == 0 for row in result.effects for value in row)
    assert all(abs(check.exact) < ATOL for check in result.entry_checks + result.position_checks)
    assert all(abs(value) < ATOL for value in result.exact_effects)


def test_notes_map_attribution_matches_exact_for_a_small_perturbation(lm):
    experiment = _experiment(lm)
    stale = experiment.stale.notebook
    generator = torch.Generator().manual_seed(0)

    def nudge(tensors):
        return tuple(t + 1e-3 * torch.randn(t.shape, generator=generator) for t in tensors)

    experiment = _with_donor(
        experiment, replace(stale.materialized(), computed_keys=nudge(stale.keys), computed_values=nudge(stale.values))
    )
    result = probe_notes_map(experiment, exact=True)
    pearson = torch.corrcoef(torch.tensor([result.per_position(), result.exact_effects]))[0, 1]
    assert float(pearson) > 0.99
    assert result.entry_correlation[0] > 0.9 and result.position_correlation[0] > 0.9
    assert result.exact_overlap >= 0.75 and result.top_overlap >= 0.75


@pytest.mark.parametrize("probe", [probe_notes_map, probe_suffix, probe_knockout, probe_heads, probe_false_note])
def test_patching_probes_refuse_a_length_change(lm, probe):
    with pytest.raises(ProbeError, match="refund_eligible.*226 to 225 tokens"):
        probe(_experiment(lm, LENGTH_CHANGE))


def test_suffix_at_all_downstream_equals_patching_everything_downstream(experiment):
    downstream = experiment.downstream_positions
    result = probe_suffix(experiment, ks=[1, len(downstream)])
    everything = _margin(experiment, experiment.stale.notebook.patch(experiment.oracle.notebook, downstream))
    last = result.points[-1]
    assert last.k == len(downstream) and sorted(last.positions) == downstream
    assert last.all_layers.margin == pytest.approx(everything, abs=ATOL)
    assert last.random.margin == pytest.approx(everything, abs=ATOL)
    late = experiment.stale.notebook.patch(experiment.oracle.notebook, downstream, result.bands["late"])
    assert last.bands["late"].margin == pytest.approx(_margin(experiment, late), abs=ATOL)


def test_suffix_default_ks_double_up_to_all_and_bands_split_the_layers(experiment):
    result = probe_suffix(experiment, seeds=1)
    count = len(experiment.downstream_positions)
    assert [p.k for p in result.points] == [1, 2, 4, 8, 16, 32, 64, 128, count]
    assert sum(result.bands.values(), []) == list(range(len(experiment.stale.notebook.keys)))
    with pytest.raises(ProbeError, match=f"K={count + 1} is outside 1..{count}"):
        probe_suffix(experiment, ks=[count + 1])


def test_knockout_k0_is_the_oracle_and_all_equals_hiding_everything(experiment):
    downstream = experiment.downstream_positions
    result = probe_knockout(experiment, ks=[0, 3, len(downstream)])
    first, last = result.points[0], result.points[-1]
    assert first.k == 0 and first.random is None
    assert first.top.margin == pytest.approx(experiment.oracle.decision.margin, abs=ATOL)
    assert first.top.recovery == pytest.approx(1.0, abs=1e-4)
    hidden = _margin(experiment, experiment.oracle.notebook, Knockout(tuple(downstream)))
    assert last.top.margin == pytest.approx(hidden, abs=ATOL)
    assert len(result.points[1].random.margins) == 3


def test_heads_knocking_out_every_head_equals_the_position_knockout(experiment):
    result = probe_heads(experiment, heads=100, notes=5)  # capped at 3 layers × 4 heads
    assert len(result.top_heads) == 12 and len(set(result.top_heads)) == 12
    assert result.top.margin == pytest.approx(result.all_heads.margin, abs=ATOL)
    assert len(result.mass_last) == 3 and all(len(row) == 4 for row in result.mass_last)
    assert all(0 <= value <= 1 + ATOL for row in result.mass_last + result.mass_mean for value in row)
    hidden = _margin(experiment, experiment.oracle.notebook, Knockout(tuple(result.notes)))
    assert result.all_heads.margin == pytest.approx(hidden, abs=ATOL)


def test_heads_ranks_by_last_token_mass(experiment):
    result = probe_heads(experiment, heads=3)
    masses = [result.mass_last[layer][head] for layer, head in result.top_heads]
    assert masses == sorted(masses, reverse=True)
    others = [v for layer, row in enumerate(result.mass_last) for head, v in enumerate(row) if (layer, head) not in result.top_heads]
    assert min(masses) >= max(others)
    assert len(result.random.margins) == 3


def test_false_note_with_every_note_equals_patching_everything_downstream(experiment):
    downstream = experiment.downstream_positions
    result = probe_false_note(experiment, k=len(downstream))
    everything = _margin(experiment, experiment.stale.notebook.patch(experiment.oracle.notebook, downstream))
    assert result.injected.margin == pytest.approx(everything, abs=ATOL)
    assert result.all_downstream.margin == pytest.approx(everything, abs=ATOL)
    assert result.as_dict()["follows_note"] is None  # the tiny model's stale and oracle labels agree
    with pytest.raises(ProbeError, match="k=0"):
        probe_false_note(experiment, k=0)


def test_trigger_notes_and_trigger_split_the_flip(experiment, lm):
    result = probe_trigger(experiment, **TRIGGER)
    scenario = experiment.scenario
    flipped_prompt = render(
        replace(scenario, context=scenario.context.replace("never", "only")), lm.tokenizer, experiment.stale.prompt.values
    )
    flipped = Notebook.from_prompt(lm, flipped_prompt)
    assert result.trigger_texts == [(" never", " only")]
    assert result.gap.oracle == pytest.approx(_margin(experiment, flipped), abs=ATOL)
    assert min(result.note_positions) == result.trigger_positions[0] + 1
    notes = experiment.stale.notebook.patch(flipped, result.note_positions)
    assert result.notes_patched.margin == pytest.approx(_margin(experiment, notes), abs=ATOL)
    both = notes.patch(flipped, result.trigger_positions)
    assert _margin(experiment, both) == pytest.approx(result.gap.oracle, abs=ATOL)
    assert result.as_dict()["original_margin"] == pytest.approx(experiment.stale.decision.margin, abs=1e-4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs the options find=WORD and replace=WORD"),
        ({"find": "never"}, "needs the options"),
        ({"find": "never", "replace": "always"}, "changes the context from 210 to 211 tokens"),
        ({"find": "refund", "replace": "return"}, "occurs 6 times"),
        ({"find": "nowhere", "replace": "only"}, "occurs 0 times"),
        ({"find": "SESSION", "replace": "session"}, "must come after field 'request_id'"),
        ({"find": "never", "replace": "{x}"}, "braces"),
    ],
)
def test_trigger_errors_name_the_input(experiment, options, message):
    with pytest.raises(ProbeError, match=message):
        probe_trigger(experiment, **options)


def test_attention_is_in_reading_order_whatever_the_storage_order(lm):
    experiment = _experiment(lm)
    before = probe_attention(experiment)
    # Recomputing the field appends its entries at the end of storage; the reading order is unchanged.
    stored_later = replace(experiment.stale, notebook=experiment.stale.notebook.recompute(experiment.field_positions))
    after = probe_attention(_experiment(lm, stale=stored_later))
    assert after.stale.positions == before.stale.positions == list(range(len(experiment.prompt.context_ids)))
    assert torch.allclose(torch.tensor(after.stale.attention), torch.tensor(before.stale.attention), atol=1e-4)


def test_attention_shapes_and_masses(experiment):
    result = probe_attention(experiment)
    attention = torch.tensor(result.stale.attention)  # (layers, heads, context)
    assert attention.shape == (3, 4, len(experiment.prompt.context_ids))
    assert float(attention.sum(-1).max()) <= 1 + 1e-3
    field = experiment.field_positions
    expected = attention[..., field[0] : field[-1] + 1].sum(-1).mean(1)
    assert torch.allclose(torch.tensor(result.stale.mass["field"]), expected, atol=1e-3)
    for run, mass in ((experiment.stale, result.stale.mass), (experiment.oracle, result.oracle.mass)):
        # "rest" read off the full attention row: the context before the field plus the question tokens themselves
        captured = run.notebook.read_prompt(
            experiment.prompt, capture_attention=True
        ).attention  # (layers, heads, decode, entries + decode)
        row, decode = captured[:, :, -1], captured.shape[2]
        prefix = run.notebook.entries_at([p for p in run.notebook.visible_positions() if p < field[0]])
        rest = (row[..., prefix].sum(-1) + row[..., -decode:].sum(-1)).mean(1)
        assert torch.allclose(torch.tensor(mass["rest"]), rest, atol=1e-4)


def test_attention_json_keeps_every_head_while_small_and_the_mean_over_heads_past_the_cap(experiment, monkeypatch):
    from kvscope.engine.probes import attention as attention_module

    result = probe_attention(experiment)
    small = result.stale.as_dict()
    assert small["attention_heads"] == "all" and small["attention"] == result.stale.attention
    monkeypatch.setattr(attention_module, "MAX_JSON_VALUES", 10)  # as a 4k-token map of a 24-layer, 14-head model would be
    large = result.stale.as_dict()
    mean = torch.tensor(result.stale.attention, dtype=torch.float64).mean(1)
    assert large["attention_heads"] == "mean" and torch.allclose(torch.tensor(large["attention"], dtype=torch.float64), mean, atol=1e-4)


@pytest.mark.parametrize("name", [*CAUSAL_PROBES, "frontier"])
def test_every_result_says_what_it_means_in_one_sentence(experiment, name):
    result = PROBES[name](experiment, **(TRIGGER if name == "trigger" else {}))
    sentence = result.as_dict()["headline"]
    assert sentence == result.headline() and sentence.endswith(".") and "{" not in sentence and "None" not in sentence
    assert sentence.count(". ") == 0, sentence  # one sentence


def test_the_knockout_sentence_is_computed_from_its_numbers(experiment):
    result = probe_knockout(experiment, ks=[0, 1, 2, 4], seeds=2)
    point, gap = result.points[-1], result.gap  # K=4: the largest K up to 8
    moved = point.top.margin - gap.oracle
    assert result.headline().startswith(f"Knocking out the top 4 notes moves the new-value margin by {moved:+.2f}")
    assert f"4 random positions move it by {point.random.margin - gap.oracle:+.2f}" in result.headline()
    one = probe_knockout(experiment, ks=[0, 1], seeds=1)
    assert one.headline().startswith("Knocking out the top 1 note moves") and "1 random position move" in one.headline()


def test_the_locality_sentence_gives_the_notes_share_of_the_edit(lm):
    experiment = _experiment(lm, settings=EditSettings(min_gap=0.01))
    result = probe_locality(experiment)
    share = 1 - result.field_only.recovery
    assert f"recomputing the field alone gives recovery {result.field_only.recovery:.2f}" in result.headline()
    assert f"the notes after it carry {max(0.0, share):.0%} of the " in result.headline()
    assert experiment.notes_share().share == pytest.approx(share, abs=1e-9)  # the notes share the Notes tab shows
