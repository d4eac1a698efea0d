"""The agent loop: both references per turn, erratum compaction, several fields, erratum wordings."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.compose.agent import (
    Compaction,
    compacted,
    run_agent,
    state_schedule,
    value_schedule,
)
from kvscope.engine.compose.placing import adhoc_scenario
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.edit.erratum import WORDINGS as ERRATUM_WORDINGS
from kvscope.engine.edit.runs import render_for, run_scenario
from kvscope.engine.scenario import Scenario, ScenarioError

TWO_FIELDS = '''
name = "Two fields"
description = "Access depends on a badge and a shift."
context = """
STATE
badge: {badge}
shift: {shift}
RULE
Open the door only if badge is valid and shift is day.
"""
question = "Open the door? Answer yes or no."

[fields.badge]
old = "valid"
new = "revoked"

[fields.shift]
old = "day"
new = "night"

[answers]
yes = ["yes"]
no = ["no"]
'''


def test_identical_token_reference_is_exact_on_a_cached_prefix(lm, store):
    report = run_agent(lm, adhoc_scenario(["account_gate"]), store, turns=4, toggle=True, remedy=Remedy(seam=1))
    data = report.as_dict()
    assert [t["values"][report.fields[0]] for t in data["turns"]] == value_schedule(("basic", "premium"), 4, True)
    assert data["min_cosine_vs_identical_tokens"] > 0.9999 and data["identical_tokens_agreement"] == 1.0
    assert data["turns"][2]["errata"] == 2 and data["compactions"] == 0


def test_clean_state_reference_equals_an_independent_clean_prefill(lm, store):
    scenario = Scenario.from_toml(TWO_FIELDS)
    report = run_agent(lm, scenario, store, turns=4, fields=["badge", "shift"], toggle=True)
    for turn in report.turns:
        independent = run_scenario(lm, scenario, turn.values).decision
        assert turn.clean.margin == pytest.approx(independent.margin, abs=1e-5)
        assert torch.allclose(turn.clean.next_token_logits, independent.next_token_logits, atol=1e-5)
    assert [t.changed for t in report.turns] == [None, "badge", "shift", "badge", "shift"]
    assert [t.values for t in report.turns][1:3] == [{"badge": "revoked", "shift": "day"}, {"badge": "revoked", "shift": "night"}]


def test_compaction_equals_a_clean_prefill_of_the_compacted_text(lm):
    scenario = Scenario.from_toml(TWO_FIELDS)
    base_prompt = render_for(lm, scenario)
    base = Notebook.from_prompt(lm, base_prompt).append([5, 6, 7], "erratum")  # errata the compaction must drop
    prompt = render_for(lm, scenario, {"shift": "night"})
    folded, computed = compacted(Notebook.from_prompt(lm, base_prompt), base_prompt, prompt)
    clean = Notebook.from_prompt(lm, prompt)
    assert 0 < computed < len(prompt.context_ids)
    assert folded.visible_token_ids() == list(prompt.context_ids) and len(base) > len(base_prompt.context_ids)
    positions = list(range(len(prompt.context_ids)))
    for mine, theirs in zip(folded.keys, clean.keys):
        assert torch.allclose(mine[:, :, folded.entries_at(positions)], theirs, atol=2e-5)
    a, b = folded.read_prompt(prompt), clean.read_prompt(prompt)
    assert a.margin == pytest.approx(b.margin, abs=1e-5)


def test_every_turn_compaction_tracks_the_clean_state(lm, store):
    report = run_agent(lm, Scenario.from_toml(TWO_FIELDS), store, turns=4, fields=["badge", "shift"], toggle=True, policy="every:1")
    assert all(t.compacted and t.errata == 0 for t in report.turns[1:])
    for turn in report.turns:
        assert turn.cached.margin == pytest.approx(turn.clean.margin, abs=1e-4)
    assert report.as_dict()["clean_state_agreement"] == 1.0


def test_adaptive_compaction_leaves_no_erratum_behind_when_it_fires(lm, store):
    report = run_agent(lm, Scenario.from_toml(TWO_FIELDS), store, turns=6, field_name="badge", toggle=True, policy="adaptive:0.999")
    for turn in report.turns:
        if turn.compacted:
            assert turn.errata == 0 and turn.cached.margin == pytest.approx(turn.clean.margin, abs=1e-4)
    assert report.policy == "adaptive:0.999"


def test_every_k_policy_counts_errata_since_the_last_compaction(lm, store):
    report = run_agent(lm, Scenario.from_toml(TWO_FIELDS), store, turns=6, field_name="badge", toggle=True, policy="every:3")
    assert [t.errata for t in report.turns] == [0, 1, 2, 0, 1, 2, 0]
    assert [t.compacted for t in report.turns] == [False, False, False, True, False, False, True]


@pytest.mark.parametrize("wording", list(ERRATUM_WORDINGS))
def test_every_erratum_wording_runs(lm, store, wording):
    data = run_agent(lm, Scenario.from_toml(TWO_FIELDS), store, turns=1, wording=wording).as_dict()
    assert data["wording"] == wording and data["min_cosine_vs_identical_tokens"] > 0.9999


def test_bad_policy_wording_and_schedule_are_refused(lm, store):
    for text in ("sometimes", "every:0", "every:x", "adaptive:2"):
        with pytest.raises(ScenarioError, match="policy"):
            Compaction.parse(text)
    with pytest.raises(ScenarioError, match="unknown erratum wording 'shout'"):
        run_agent(lm, Scenario.from_toml(TWO_FIELDS), store, turns=1, wording="shout")
    schedule = state_schedule(Scenario.from_toml(TWO_FIELDS), ["badge"], 3, toggle=False)
    assert [values["badge"] for values, _ in schedule] == ["valid", "revoked", "valid", "revoked"]
