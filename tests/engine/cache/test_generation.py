"""Greedy decoding with guesses (kvscope.engine.cache.generation.greedy): a draft checked in one forward gives greedy
decoding's tokens, whether the draft is right throughout, wrong from a token on, wrong at once, or ends where a stop
token ends greedy decoding; a right draft costs one forward instead of one per token, and a wrong one no forward
more than decoding without it. Prompt lookup (guesses from the context) gives the same tokens as decoding a token a
forward, on contexts and models of every kind here, in fewer forwards where the model copies its context."""

import pytest

from kvscope.engine.cache.generation import LOOKUP_TOKENS
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.models.tiny import TINY_ARCHS, tiny_model

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
    _, drafted = state.greedy(logits, TOKENS, draft=draft, lookup=0)
    assert drafted == plain
    # the check (its right tokens kept), then a token at a time up to the last (not run)
    assert forwards == [TOKENS - 1] + [1] * (TOKENS - 1 - wrong_at)


def test_a_draft_wrong_at_its_first_token_is_not_run(lm, forwards):
    state, logits = _prompt(lm)
    _, plain = state.greedy(logits, TOKENS)
    forwards.clear()
    _, drafted = state.greedy(logits, TOKENS, draft=[(plain[0] + 1) % lm.model.config.vocab_size, *plain[1:]], lookup=0)
    assert drafted == plain and forwards == [1] * (TOKENS - 1)


def test_a_draft_that_ends_at_a_stop_token_stops_there(lm):
    state, logits = _prompt(lm)
    _, plain = state.greedy(logits, TOKENS, lookup=0)
    stop = next(token for token in plain if token != plain[0])  # a stop token after the first
    first = plain.index(stop)  # greedy stops at the stop token's first occurrence
    _, stopped = state.greedy(logits, TOKENS, [stop])
    _, drafted = state.greedy(logits, TOKENS, [stop], draft=stopped)
    assert stopped == plain[:first] == drafted
    told = []
    _, overlong = state.greedy(logits, TOKENS, [stop], draft=plain, on_forward=told.append)  # runs past the stop
    assert overlong == stopped and told[0] == TOKENS - 1 and len(told) == 1
    told.clear()
    _, none = state.greedy(logits, TOKENS, [plain[0]], draft=plain, on_forward=told.append)
    assert none == [] and told == []  # the first token is a stop: nothing runs


def _one_a_forward(state, logits, tokens: int, stops=()) -> list[int]:
    """Greedy decoding a token a forward: no guess."""
    return state.greedy(logits, tokens, stops, lookup=0)[1]


@pytest.mark.parametrize("family", TINY_ARCHS)
def test_prompt_lookup_gives_the_tokens_of_decoding_a_token_a_forward(family):
    lm = tiny_model(family)
    vocab = lm.model.config.get_text_config().vocab_size
    for seed in range(3):  # contexts that repeat themselves (lookup guesses) and that do not
        ids = [(seed * 7 + i * (3 if seed else 1)) % min(vocab, 50) + 3 for i in range(40)]
        state, logits = Notebook.empty(lm).step(ids, "request")
        plain = _one_a_forward(state, logits, 24)
        _, looked = state.greedy(logits, 24)
        assert looked == plain, (family, seed)


def test_prompt_lookup_takes_copied_runs_in_fewer_forwards_and_stops_where_decoding_stops(lm, forwards):
    state, logits = _prompt(lm)
    plain = _one_a_forward(state, logits, 3 * TOKENS)
    forwards.clear()
    _, looked = state.greedy(logits, 3 * TOKENS)
    assert looked == plain and len(plain) == 3 * TOKENS
    assert len(forwards) < len(plain) - 1 and max(forwards) <= 1 + LOOKUP_TOKENS  # the random model repeats itself
    stop = plain[TOKENS]
    first = plain.index(stop)
    _, stopped = state.greedy(logits, 3 * TOKENS, [stop])
    assert stopped == plain[:first] == _one_a_forward(state, logits, 3 * TOKENS, [stop])
