"""Greedy decoding with a draft (kvscope.engine.cache.generation.greedy): the draft checked in one forward gives greedy
decoding's tokens, whether the draft is right throughout, wrong from a token on, wrong at once, or ends where a stop
token ends greedy decoding; and a right draft costs one forward instead of one per token."""

import pytest

from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.models.tiny import tiny_model

TOKENS = 12


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


@pytest.fixture
def forwards(lm, monkeypatch):
    """The new tokens of every forward the model runs."""
    ran = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: ran.append(k["input_ids"].shape[1]) or forward(*a, **k))
    return ran


def _prompt(lm):
    ids = lm.tokenizer("The ledger says the parcel left on Monday, and", add_special_tokens=False).input_ids
    return Notebook.empty(lm).step(ids, "request")


def test_a_right_draft_gives_the_greedy_tokens_in_one_forward(lm, forwards):
    state, logits = _prompt(lm)
    _, plain = state.greedy(logits, TOKENS)
    forwards.clear()
    _, drafted = state.greedy(logits, TOKENS, draft=plain)
    assert drafted == plain and len(plain) == TOKENS
    assert forwards == [TOKENS - 1]  # the draft less its last token (greedy never runs the last one)


@pytest.mark.parametrize("wrong_at", [1, 5, TOKENS - 2])
def test_a_draft_wrong_from_a_token_on_gives_the_greedy_tokens(lm, forwards, wrong_at):
    state, logits = _prompt(lm)
    _, plain = state.greedy(logits, TOKENS)
    draft = [*plain[:wrong_at], (plain[wrong_at] + 1) % lm.model.config.vocab_size, *plain[wrong_at + 1 :]]
    forwards.clear()
    _, drafted = state.greedy(logits, TOKENS, draft=draft)
    assert drafted == plain
    # the check, the taken tokens again, then a token at a time up to the last (not run)
    assert forwards == [TOKENS - 1, wrong_at] + [1] * (TOKENS - 1 - wrong_at)


def test_a_draft_wrong_at_its_first_token_is_not_run(lm, forwards):
    state, logits = _prompt(lm)
    _, plain = state.greedy(logits, TOKENS)
    forwards.clear()
    _, drafted = state.greedy(logits, TOKENS, draft=[(plain[0] + 1) % lm.model.config.vocab_size, *plain[1:]])
    assert drafted == plain and forwards == [1] * (TOKENS - 1)


def test_a_draft_that_ends_at_a_stop_token_stops_there(lm):
    state, logits = _prompt(lm)
    _, plain = state.greedy(logits, TOKENS)
    stop = plain[4]
    first = plain.index(stop)  # greedy stops at the stop token's first occurrence
    _, stopped = state.greedy(logits, TOKENS, [stop])
    _, drafted = state.greedy(logits, TOKENS, [stop], draft=stopped)
    assert stopped == plain[:first] == drafted
    told = []
    _, overlong = state.greedy(logits, TOKENS, [stop], draft=plain, on_forward=told.append)  # runs past the stop
    assert overlong == stopped and told[0] == TOKENS - 1
