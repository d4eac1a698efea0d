"""8k-token contexts on a tiny model: reads equal HF forwards, and no forward grows with the whole work.

Masks are explicit, so a forward costs (new tokens) × (keys it is given): long work runs in chunks of at most
MAX_FORWARD_TOKENS new tokens, and a forward leaves out stored entries none of its tokens sees.
"""

import pytest
import torch

from kvscope.engine.cache import adapter
from kvscope.engine.cache.budget import MAX_FORWARD_TOKENS
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.models.tiny import tiny_model
from tests.shared import long_scenario

TOKENS = 8192
ATOL = 2e-5
DECODE = [5, 6, 7]
ANSWERS = {"a": [[8]], "b": [[9, 10, 11]]}


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids(lm):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(10, lm.model.config.vocab_size, (TOKENS,), generator=generator).tolist()


@pytest.fixture(scope="module")
def notebook(lm, ids):
    return Notebook.prefill(lm, ids).materialized()


@pytest.fixture
def forwards(monkeypatch):
    """(new tokens, keys) of every forward the engine runs."""
    sizes = []
    original = adapter.forward

    def counting(model, keys, values, key_positions, input_ids, *args, **kwargs):
        sizes.append((len(input_ids), len(key_positions) + len(input_ids)))
        return original(model, keys, values, key_positions, input_ids, *args, **kwargs)

    monkeypatch.setattr(adapter, "forward", counting)
    return sizes


@pytest.fixture(scope="module")
def hf():
    """Ground truth: the same tiny model, never run by the engine (HF's own masks and SDPA)."""
    return tiny_model("llama")


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf.model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()


def test_read_at_8k_tokens_matches_hf_forward(hf, ids, notebook):
    decision = notebook.read(DECODE, ANSWERS)
    assert len(notebook) == TOKENS
    assert torch.allclose(decision.next_token_logits, _hf_logits(hf, ids + DECODE), atol=ATOL)


def test_long_prefill_runs_in_bounded_chunks(lm, ids, notebook, forwards):
    again = Notebook.prefill(lm, ids).materialized()
    assert forwards == [(MAX_FORWARD_TOKENS, MAX_FORWARD_TOKENS * (i + 1)) for i in range(TOKENS // MAX_FORWARD_TOKENS)]
    assert all(torch.equal(a, b) for a, b in zip(again.keys + again.values, notebook.keys + notebook.values))


def test_fused_read_of_long_forks_is_exact_and_leaves_unseen_entries_out(hf, ids, notebook, forwards):
    """The last 2k tokens recomputed, and token 6000 replaced with everything after it recomputed, read together:
    each equals the HF forward of its ids; no forward takes the stale entries the forks hide (they would add
    2k and 2.2k keys), and the captured attention is 0 there."""
    start, changed = TOKENS - 2048, 6000
    new_ids = ids[:changed] + [ids[changed] + 1] + ids[changed + 1 :]
    forks = [
        notebook.recompute(range(start, TOKENS)),
        notebook.replace([changed], [new_ids[changed]]).recompute(range(changed + 1, TOKENS)),
    ]
    decisions = Notebook.read_many(forks, DECODE, ANSWERS, capture_attention=True)
    assert torch.allclose(decisions[0].next_token_logits, _hf_logits(hf, ids + DECODE), atol=ATOL)
    assert torch.allclose(decisions[1].next_token_logits, _hf_logits(hf, new_ids + DECODE), atol=ATOL)
    question = len(DECODE) + len(ANSWERS["b"][0]) - 1
    assert max(new for new, _ in forwards) <= MAX_FORWARD_TOKENS + question
    assert max(keys for _, keys in forwards) <= TOKENS + question
    for fork, decision in zip(forks, decisions):
        hidden = ~fork.latest().visible
        attention = decision.attention[..., : len(hidden)]  # (layers, heads, decode tokens, entries)
        assert int(hidden.sum()) > 2000 and float(attention[..., hidden].abs().max()) == 0.0
        assert torch.allclose(decision.attention.sum(-1), torch.ones(()), atol=1e-5)


def test_edit_at_8k_tokens_reads_stale_and_oracle_as_hf_does(lm, hf, forwards):
    """A whole edit (stale, oracle and four strategies read together) on an 8k-token scenario: stale and oracle
    decisions equal HF forwards of their prompts; no forward runs more than MAX_FORWARD_TOKENS new tokens and a question."""
    experiment = EditExperiment(lm, long_scenario(lm.tokenizer, TOKENS), settings=EditSettings(min_gap=0.01))
    report = experiment.report(["field_only", "erratum", "field_erratum", "full_downstream"], fused=True)
    assert len(experiment.prompt.context_ids) > 8000
    for run in (experiment.stale, experiment.oracle):
        reference = _hf_logits(hf, [*run.prompt.context_ids, *run.prompt.decode_ids])
        assert torch.allclose(run.decision.next_token_logits, reference, atol=ATOL)
    assert report.strategies["full_downstream"].decision.margin == pytest.approx(experiment.oracle.decision.margin, abs=1e-4)
    prompt = experiment.prompt
    question = len(prompt.decode_ids) + sum(len(answer) for answers in prompt.answer_ids.values() for answer in answers)
    assert max(new for new, _ in forwards) <= MAX_FORWARD_TOKENS + question
