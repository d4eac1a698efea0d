"""Hybrids (recurrent layers beside attention): reads, chunked prefills and appends equal the model's own forward;
everything that rewrites an entry is refused, naming the recurrent layers."""

import json

import pytest
import torch

from kvscope.engine.cache.recurrent import RecurrentContext
from kvscope.engine.checks.support import TOLERANCE
from kvscope.engine.cli import main
from kvscope.engine.edit.hybrid import hybrid_edit, read_scenario
from kvscope.engine.errors import NotebookError
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Scenario
from tests.shared import SAME_LENGTH_SCENARIO

DECODE, ANSWERS = [5, 6, 7], {"a": [[8]], "b": [[9, 10, 11]]}


@pytest.fixture(scope="module", params=["bamba", "qwen3_next"])
def lm(request):
    return tiny_model(request.param)


def _ids(count, seed):
    return torch.randint(10, 590, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _forward(lm, ids):
    with torch.no_grad():
        return torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)


def test_a_read_scores_every_answer_as_the_models_forward_does(lm):
    context = _ids(40, 0)
    decision = RecurrentContext.prefill(lm, context).read(DECODE, ANSWERS)
    whole = _forward(lm, context + DECODE + [9, 10])
    assert float((torch.log_softmax(decision.next_token_logits, -1) - whole[len(context) + 2]).abs().max()) <= TOLERANCE
    three = float(whole[-3, 9] + whole[-2, 10] + whole[-1, 11])  # the multi-token answer, token by token
    assert abs(decision.string_logprobs["b"]["0"] - three) <= TOLERANCE
    assert abs(decision.string_logprobs["a"]["0"] - float(whole[-3, 8])) <= TOLERANCE


def test_chunks_and_appends_equal_one_run_and_leave_the_context_as_it_was(lm):
    context, erratum = _ids(40, 1), _ids(9, 2)
    once = RecurrentContext.prefill(lm, context + erratum)
    chunked = RecurrentContext.prefill(lm, context, chunk_size=7)
    before = chunked.read(DECODE, ANSWERS).next_token_logits
    appended = chunked.append(erratum, "erratum")
    for other in (chunked.append(erratum, "erratum"), appended):
        assert (
            float((other.read(DECODE, ANSWERS).next_token_logits - once.read(DECODE, ANSWERS).next_token_logits).abs().max()) <= TOLERANCE
        )
    assert torch.equal(chunked.read(DECODE, ANSWERS).next_token_logits, before)  # reads and appends never change a context
    assert appended.segments[-1] == "erratum" and len(appended) == 49


def test_an_edit_on_a_hybrid_reads_the_erratum_against_a_clean_prefill_and_refuses_in_place_strategies(lm):
    scenario = Scenario.from_toml(SAME_LENGTH_SCENARIO)
    report = hybrid_edit(lm, scenario, names=["field_only", "erratum", "full_downstream"])
    oracle = read_scenario(lm, scenario, {report.field: report.new})
    assert report.oracle.decision.margin == pytest.approx(oracle.decision.margin, abs=1e-6)
    erratum = report.strategies["erratum"]
    gap = report.oracle.decision.margin - report.stale.decision.margin
    expected = (erratum.decision.margin - report.stale.decision.margin) / gap
    assert erratum.applicable and (erratum.recovery.value is None or erratum.recovery.value == pytest.approx(expected))
    for name in ("field_only", "full_downstream"):
        assert not report.strategies[name].applicable and "layers [0, 2] keep a recurrent state" in report.strategies[name].reason
    assert report.as_dict()["hybrid"] is True
    every = hybrid_edit(lm, scenario).strategies  # the CLI's default: every strategy, the references read, not refused
    assert every["stale"].applicable and every["oracle"].applicable and every["oracle"].recovery.value == 1.0
    assert every["oracle"].decision.margin == pytest.approx(report.oracle.decision.margin, abs=1e-6)


def test_the_append_only_path_is_refused_on_a_model_without_recurrent_layers():
    with pytest.raises(NotebookError, match="has no recurrent layers"):
        RecurrentContext.prefill(tiny_model("qwen2"), _ids(5, 3))


def test_cli_decide_and_edit_run_on_a_hybrid(capsys):
    assert main(["decide", "--model", "tiny-bamba", "--scenario", "demos/scenarios/refund_gate.toml", "--json"]) == 0
    decided = json.loads(capsys.readouterr().out)
    assert decided["hybrid"] and decided["decision"] in ("yes", "no") and decided["context_tokens"] > 100
    assert (
        main(
            [
                "edit",
                "--model",
                "tiny-bamba",
                "--scenario",
                "demos/scenarios/refund_gate.toml",
                "--strategies",
                "field_only,erratum",
                "--json",
            ]
        )
        == 0
    )
    edited = json.loads(capsys.readouterr().out)
    assert edited["strategies"]["erratum"]["applicable"] and not edited["strategies"]["field_only"]["applicable"]
    assert edited["stale"]["margin"] == pytest.approx(decided["margin"], abs=1e-4)
