"""The cache-reuse comparison: llama-server's answer parsing, the metrics, and both cases against ground truth
(a stub server that prefills every prompt exactly stands in for llama-server on a tiny random-weight model)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.interop import cache_reuse
from benchmarks.interop.cache_reuse import (
    NextToken,
    at_decision_point,
    first_token_margin,
    parse_completion,
    run,
)
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.scenario import Skill, bundled_skills


class ExactServer:
    """Answers every prompt with a full prefill's next-token log-probs: no reuse, no error."""

    def __init__(self, lm) -> None:
        self.lm, self.calls = lm, []

    def next_token(self, ids: list[int], *, cache: bool, reuse_chunk: int = 0, vocab: int = 0) -> NextToken:
        self.calls.append((len(ids), cache, reuse_chunk))
        with torch.no_grad():
            logits = self.lm.model(torch.tensor([ids])).logits[0, -1]
        return NextToken.from_logits(logits, len(ids), 1.0)


def test_a_completion_becomes_log_probs_over_the_vocabulary():
    data = {
        "completion_probabilities": [
            {
                "top_logprobs": [
                    {"id": 2, "logprob": -0.1},
                    {"id": 0, "logprob": -2.5},
                    {"id": 1, "logprob": None},
                    {"id": 7, "logprob": -0.2},
                ]
            }
        ],
        "timings": {"prompt_n": 17, "prompt_ms": 42.5},
    }
    parsed = parse_completion(data, vocab=4)
    assert parsed.logprobs.tolist() == pytest.approx([-2.5, -50.0, -0.1, -50.0]) and parsed.evaluated == 17 and parsed.ms == 42.5
    assert first_token_margin(parsed.logprobs, {"yes": ((2, 5),), "no": ((0,), (3,))}) == pytest.approx(
        -0.1 - torch.logsumexp(torch.tensor([-2.5, -50.0]), 0).item()
    )


def test_answers_are_read_where_they_first_differ():
    from kvscope.engine.scenario import RenderedPrompt

    prompt = RenderedPrompt((1, 2), ("context",) * 2, {}, (3,), {"approve": ((9, 7, 5),), "deny": ((9, 7, 6, 8), (9, 4))}, {})
    read = at_decision_point(prompt)
    assert read.decode_ids == (3, 9) and read.answer_ids == {"approve": ((7, 5),), "deny": ((7, 6, 8), (4,))}
    single = RenderedPrompt((1,), ("context",), {}, (3,), {"yes": ((5,),), "no": ((6,),)}, {})
    assert at_decision_point(single) == single


def test_moved_and_edit_cases_match_ground_truth(monkeypatch):
    lm = tiny_model("qwen2")
    server = ExactServer(lm)
    monkeypatch.setattr(cache_reuse, "next_token", lambda stub, ids, **options: stub.next_token(ids, **options))
    cases = run(
        lm,
        server,
        ["keystone_safety"],
        Skill.load(bundled_skills()["refund_policy"]),
        Skill.load(bundled_skills()["tone_guide"]),
        [0, 10_000],
        chunk=16,
    )
    moved, edit = [case for case in cases if case["case"] == "moved"], [case for case in cases if case["case"] == "edit"]
    assert len(moved) == 2 and len(edit) == 1 and moved[0]["moved_by"] > 0
    for case in moved:
        for row in case["llama_cpp"].values():  # the stub recomputes: exact
            assert row["kl"] == pytest.approx(0.0, abs=1e-6) and row["margin_error"] == pytest.approx(0.0, abs=1e-4)
        whole = case["kvscope"]["move, seam 10000"]  # a seam over the whole moved tail is a prefill
        assert whole["kl"] == pytest.approx(0.0, abs=1e-5) and whole["logit_cosine"] == pytest.approx(1.0, abs=1e-5)
        assert (
            case["kvscope"]["move, seam 0"]["kl"] > 1e-6 and case["kvscope"]["move, seam 0"]["evaluated_tokens"] < whole["evaluated_tokens"]
        )
        assert case["kvscope"]["compiled skill, seam:10000"]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert set(edit[0]["kvscope"]) >= {"field_only", "erratum", "full_downstream"} and "erratum" in edit[0]["llama_cpp"]
    assert edit[0]["kvscope"]["full_downstream"]["kl"] == pytest.approx(0.0, abs=1e-5)
    assert {call[1] for call in server.calls} == {True, False} and any(call[2] == 16 for call in server.calls)
