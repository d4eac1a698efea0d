"""Notebook operations against ground truth: HF forwards, clean prefills, exact identities."""

from dataclasses import replace

import pytest
import torch

from kvscope.engine.cache.notebook import Knockout, Notebook, NotebookError
from kvscope.engine.models.tiny import tiny_model

# The full operation suite runs on these; the newer families (latent attention, per-layer rope, sinks, NoPE,
# hybrids) are proved by the ground-truth matrix in test_support.py, which covers the same identities.
NOTEBOOK_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt_neox", "phi", "llama3_scaling", "yarn", "gpt2")
ROPE_ARCHS = [arch for arch in NOTEBOOK_ARCHS if arch != "gpt2"]
ATOL = 2e-5


@pytest.fixture(scope="module", params=NOTEBOOK_ARCHS)
def lm(request):
    return tiny_model(request.param)


def _ids(lm, count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, lm.model.config.vocab_size, (count,), generator=generator).tolist()


def _max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _hf_logits(lm, ids):
    """Ground truth: the model's own forward (its own masks, windows and caches)."""
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0].float()


DECODE = [5, 6, 7]
ANSWERS = {"a": [[8]], "b": [[9, 10, 11]]}


def test_prefill_read_matches_hf_forward(lm):
    ids = _ids(lm, 40)
    decision = Notebook.prefill(lm, ids).read(DECODE, ANSWERS)
    reference = _hf_logits(lm, ids + DECODE)[-1]
    assert torch.allclose(decision.next_token_logits, reference, atol=ATOL)


def test_multi_token_answer_logprob_matches_hf_forward(lm):
    ids = _ids(lm, 30)
    decision = Notebook.prefill(lm, ids).read(DECODE, ANSWERS)
    full = ids + DECODE + ANSWERS["b"][0]
    log_probs = torch.log_softmax(_hf_logits(lm, full), -1)
    start = len(ids) + len(DECODE) - 1
    expected = sum(float(log_probs[start + i, token]) for i, token in enumerate(ANSWERS["b"][0]))
    assert decision.scores["b"] == pytest.approx(expected, abs=1e-4)
    assert decision.margin == pytest.approx(decision.scores["a"] - decision.scores["b"], abs=1e-6)


def test_chunked_prefill_equals_one_prefill(lm):
    ids = _ids(lm, 45)
    whole, chunked = Notebook.prefill(lm, ids), Notebook.prefill(lm, ids, chunk_size=7)
    assert _max_diff(whole.keys + whole.values, chunked.keys + chunked.values) < ATOL


def test_erratum_append_equals_prefill_of_concatenation(lm):
    ids, erratum = _ids(lm, 30), _ids(lm, 6, seed=1)
    appended = Notebook.prefill(lm, ids).append(erratum, "erratum")
    whole = Notebook.prefill(lm, ids + erratum)
    assert _max_diff(appended.keys + appended.values, whole.keys + whole.values) < ATOL
    assert appended.visible_segments()[-6:] == ["erratum"] * 6


def test_replace_with_own_value_changes_nothing(lm):
    ids = _ids(lm, 30)
    notebook = Notebook.prefill(lm, ids)
    same = notebook.replace(range(8, 11), ids[8:11])
    assert abs(same.read(DECODE, ANSWERS).margin - notebook.read(DECODE, ANSWERS).margin) < 1e-4
    assert same.visible_token_ids() == ids


@pytest.mark.parametrize("new_length", [2, 3, 5])
def test_full_downstream_recompute_equals_oracle(lm, new_length):
    if lm.name == "tiny-gpt2" and new_length != 3:
        pytest.skip("length-changing edits need RoPE (checked in test_gpt2_refusals)")
    ids, new = _ids(lm, 30), _ids(lm, new_length, seed=2)
    edited = Notebook.prefill(lm, ids).replace(range(8, 11), new)
    downstream = [p for p in edited.visible_positions() if p >= 8 + new_length]
    repaired = edited.recompute(downstream)
    oracle = Notebook.prefill(lm, ids[:8] + new + ids[11:])
    assert repaired.visible_token_ids() == oracle.visible_token_ids()
    assert torch.allclose(repaired.read(DECODE, ANSWERS).next_token_logits, oracle.read(DECODE, ANSWERS).next_token_logits, atol=1e-4)


def test_field_only_edit_is_exact_for_the_field(lm):
    ids, new = _ids(lm, 30), _ids(lm, 3, seed=3)
    edited = Notebook.prefill(lm, ids).replace(range(8, 11), new)
    oracle = Notebook.prefill(lm, ids[:8] + new + ids[11:])
    field = edited.entries_at(range(8, 11))
    assert _max_diff([k[:, :, field] for k in edited.keys], [k[:, :, 8:11] for k in oracle.keys]) < ATOL


def test_knock_out_nothing_changes_nothing(lm):
    notebook = Notebook.prefill(lm, _ids(lm, 30)).materialized()  # reads of computed K/V are bit-identical
    base = notebook.read(DECODE, ANSWERS)
    for knockout in (None, Knockout(()), Knockout((), layers=(0,), heads=(1,))):
        assert notebook.read(DECODE, ANSWERS, knockout=knockout).margin == base.margin


def test_knockout_all_layers_equals_hiding_the_entries(lm):
    notebook = Notebook.prefill(lm, _ids(lm, 30))
    hidden = notebook.visible.clone()
    hidden[[4, 5, 17]] = False
    reference = replace(notebook, visible=hidden).read(DECODE, ANSWERS)
    knocked = notebook.read(DECODE, ANSWERS, knockout=Knockout((4, 5, 17)))
    assert torch.allclose(knocked.next_token_logits, reference.next_token_logits, atol=ATOL)
    assert knocked.scores["b"] == pytest.approx(reference.scores["b"], abs=1e-4)


def test_per_head_knockout_zeroes_only_those_heads(lm):
    notebook = Notebook.prefill(lm, _ids(lm, 30))
    knocked = notebook.read(DECODE, ANSWERS, knockout=Knockout((24, 27), layers=(1,), heads=(0, 2)), capture_attention=True)
    attention = knocked.attention  # (layers, heads, decode, entries)
    assert attention.shape[:3] == (lm.model.config.num_hidden_layers, lm.model.config.num_attention_heads, len(DECODE))
    assert float(attention[1][[0, 2]][..., [24, 27]].abs().max()) == 0.0
    assert float(attention[1, 1][..., [24, 27]].sum()) > 0
    assert float(attention[0, 0][..., [24, 27]].sum()) > 0


def test_captured_attention_is_a_distribution(lm):
    notebook = Notebook.prefill(lm, _ids(lm, 20))
    decision = notebook.read(DECODE, ANSWERS, capture_attention=True)
    attention = decision.attention  # (layers, heads, decode, stored + decode)
    assert attention.shape[-1] == 20 + len(DECODE)
    totals = attention.sum(-1)
    if any(hasattr(module, "sinks") for module in lm.model.modules()):  # a sink takes part of each row's mass
        assert float(totals.max()) < 1.0 and float(totals.min()) > 0.0
    else:
        assert torch.allclose(totals, torch.ones(attention.shape[:3]), atol=1e-5)
    assert float(attention[:, :, 0, 21:].abs().max()) == 0.0  # causal: the first decode token sees no later one


def _forks(lm):
    ids = _ids(lm, 30)
    stale = Notebook.prefill(lm, ids).materialized()
    new, erratum = _ids(lm, 3, seed=4), _ids(lm, 5, seed=5)
    return stale, {
        "stale": stale,
        "field": stale.replace(range(8, 11), new),
        "erratum": stale.append(erratum, "erratum"),
        "both": stale.replace(range(8, 11), new).append(erratum, "erratum"),
        "downstream": stale.replace(range(8, 30), new + ids[11:]),
    }


def test_deferred_steps_read_in_one_forward_equal_step_by_step(lm):
    _, forks = _forks(lm)
    fused = forks["both"]
    assert len(fused.pending) == 2
    stepwise = (
        forks["stale"]
        .replace(range(8, 11), fused.token_ids[30:33].tolist())
        .materialized()
        .append(fused.token_ids[33:].tolist(), "erratum")
    )
    reference = stepwise.materialized()
    decision = fused.read(DECODE, ANSWERS)
    assert torch.allclose(decision.next_token_logits, reference.read(DECODE, ANSWERS).next_token_logits, atol=ATOL)
    assert _max_diff(fused.keys + fused.values, reference.keys + reference.values) < ATOL
    assert fused.materialized().pending == () and fused.materialized() is fused.materialized()


def test_read_many_equals_separate_reads_and_keeps_forks_apart(lm):
    _, forks = _forks(lm)
    separate = {
        name: Notebook.read_many([notebook], DECODE, ANSWERS, capture_attention=True)[0] for name, notebook in _forks(lm)[1].items()
    }
    together = dict(zip(forks, Notebook.read_many(list(forks.values()), DECODE, ANSWERS, capture_attention=True)))
    for name, decision in together.items():
        assert torch.allclose(decision.next_token_logits, separate[name].next_token_logits, atol=ATOL), name
        assert decision.scores["b"] == pytest.approx(separate[name].scores["b"], abs=1e-4)
        assert decision.attention.shape == separate[name].attention.shape
        assert torch.allclose(decision.attention, separate[name].attention, atol=1e-5)
    for notebook in forks.values():
        assert notebook.materialized().pending == ()
    assert together["stale"].margin != pytest.approx(together["field"].margin, abs=1e-6)


def test_read_many_applies_a_knockout_to_every_fork_only_at_the_question(lm):
    _, forks = _forks(lm)
    knockout = Knockout((4, 5, 17))
    together = Notebook.read_many([forks["field"], forks["erratum"]], DECODE, ANSWERS, knockout=knockout)
    fresh = _forks(lm)[1]
    for decision, name in zip(together, ("field", "erratum")):
        reference = fresh[name].materialized().read(DECODE, ANSWERS, knockout=knockout)
        assert torch.allclose(decision.next_token_logits, reference.next_token_logits, atol=ATOL)


def test_answers_with_several_multi_token_strings_do_not_see_each_other(lm):
    ids = _ids(lm, 25)
    answers = {"a": [[8, 12], [13, 14, 15]], "b": [[9, 10, 11]]}
    decision = Notebook.prefill(lm, ids).read(DECODE, answers)
    for label, strings in answers.items():
        for index, answer in enumerate(strings):
            log_probs = torch.log_softmax(_hf_logits(lm, ids + DECODE + answer), -1)
            start = len(ids) + len(DECODE) - 1
            expected = sum(float(log_probs[start + i, token]) for i, token in enumerate(answer))
            assert decision.string_logprobs[label][str(index)] == pytest.approx(expected, abs=1e-4)


def test_read_many_groups_forks_of_different_notebooks(lm):
    first, second = Notebook.prefill(lm, _ids(lm, 20)), Notebook.prefill(lm, _ids(lm, 24, seed=7))
    decisions = Notebook.read_many([first, second.append([3, 4]), first.append([5])], DECODE, ANSWERS)
    expected = [first.read(DECODE, ANSWERS), second.append([3, 4]).read(DECODE, ANSWERS), first.append([5]).read(DECODE, ANSWERS)]
    for decision, reference in zip(decisions, expected):
        assert torch.allclose(decision.next_token_logits, reference.next_token_logits, atol=ATOL)


def test_patch_every_position_equals_donor_and_self_patch_is_identity(lm):
    ids, new = _ids(lm, 30), _ids(lm, 3, seed=4)
    stale, oracle = Notebook.prefill(lm, ids), Notebook.prefill(lm, ids[:8] + new + ids[11:])
    positions = range(30)
    patched = stale.patch(oracle, positions)
    assert patched.read(DECODE, ANSWERS).margin == pytest.approx(oracle.read(DECODE, ANSWERS).margin, abs=1e-4)
    assert stale.patch(stale, positions, layers=[0]).read(DECODE, ANSWERS).margin == stale.read(DECODE, ANSWERS).margin


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_splice_at_original_position_equals_prefill(arch):
    lm = tiny_model(arch)
    ids = _ids(lm, 36)
    source = Notebook.prefill(lm, ids, ["prefix"] * 12 + ["skill"] * 16 + ["after"] * 8)
    composed = Notebook.prefill(lm, ids[:12], "prefix").splice(source.block("skill")).append(ids[28:], "after").compact()  # reading order
    assert _max_diff(composed.keys + composed.values, source.keys + source.values) < ATOL


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_splice_shifted_with_whole_seam_equals_prefill(arch):
    lm = tiny_model(arch)
    ids = _ids(lm, 30)
    skill = Notebook.prefill(lm, ids[10:], "skill", start_position=3).block("skill")
    composed = Notebook.prefill(lm, ids[:10], "prefix").splice(skill, seam=len(skill))
    reference = Notebook.prefill(lm, ids)
    assert torch.allclose(composed.read(DECODE, ANSWERS).next_token_logits, reference.read(DECODE, ANSWERS).next_token_logits, atol=ATOL)
    compact = composed.compact()
    assert _max_diff(compact.keys + compact.values, reference.keys + reference.values) < ATOL


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_splice_into_pending_steps_equals_splice_into_computed_ones(arch):
    """Composing without computing first (prefix, block, seam and tail in one forward) changes nothing."""
    lm = tiny_model(arch)
    ids = _ids(lm, 40)
    skill = Notebook.prefill(lm, ids[10:30], "skill", start_position=3).block("skill")
    fused = Notebook.prefill(lm, ids[:10], "prefix").splice(skill, seam=2).append(ids[30:], "tail")
    stepwise = Notebook.prefill(lm, ids[:10], "prefix").materialized().splice(skill, seam=2).materialized().append(ids[30:], "tail")
    assert len(fused.pending) == 3
    assert fused.visible_token_ids() == stepwise.visible_token_ids() == ids
    assert fused.visible_segments() == stepwise.visible_segments()
    assert torch.allclose(fused.read(DECODE, ANSWERS).next_token_logits, stepwise.read(DECODE, ANSWERS).next_token_logits, atol=ATOL)
    order_f, order_s = fused.order, stepwise.order
    assert _max_diff([k[:, :, order_f] for k in fused.keys], [k[:, :, order_s] for k in stepwise.keys]) < ATOL


@pytest.mark.parametrize("arch", ROPE_ARCHS)
def test_spliced_keys_equal_keys_prefilled_at_the_target(arch):
    """Without seam repair a spliced block equals the same block prefilled alone at the target position."""
    lm = tiny_model(arch)
    ids = _ids(lm, 20)
    at_zero = Notebook.prefill(lm, ids, "skill").block("skill")
    at_target = Notebook.prefill(lm, ids, "skill", start_position=50)
    relocated = Notebook.prefill(lm, _ids(lm, 50, seed=9), "prefix").splice(at_zero).block("skill")
    scale = max(float(k.abs().max()) for k in at_target.keys)
    assert _max_diff(relocated.keys, at_target.keys) / scale < 1e-5
    assert relocated.start_position == 50


def test_splice_in_the_middle_moves_later_tokens(lm):
    if lm.name == "tiny-gpt2":
        pytest.skip("splice needs RoPE")
    ids = _ids(lm, 30)
    skill = Notebook.prefill(lm, ids[20:], "skill").block("skill")
    base = Notebook.prefill(lm, ids[:10], "prefix").append(ids[10:20], "after")
    composed = base.splice(skill, at=10)
    assert composed.visible_token_ids() == ids[:10] + ids[20:] + ids[10:20]
    assert composed.visible_segments()[10:20] == ["skill"] * 10
    assert composed.next_position == 30


def test_gpt2_refusals():
    lm = tiny_model("gpt2")
    ids = _ids(lm, 20)
    notebook = Notebook.prefill(lm, ids, ["a"] * 10 + ["b"] * 10)
    with pytest.raises(NotebookError, match="no rotary position embedding"):
        Notebook.prefill(lm, ids[:10]).splice(notebook.block("b"))
    with pytest.raises(NotebookError, match="needs to move later tokens"):
        notebook.replace(range(3, 5), ids[3:6])


def test_fork_is_free_and_operations_do_not_mutate():
    lm = tiny_model("llama")
    ids = _ids(lm, 20)
    notebook = Notebook.prefill(lm, ids)
    snapshot = [k.clone() for k in notebook.keys]
    notebook.replace(range(2, 4), [3, 4, 5]).patch(notebook, range(5)).recompute(range(10, 12))
    assert _max_diff(notebook.keys, snapshot) == 0.0
    fork = replace(notebook)
    assert fork.memory_bytes() == notebook.memory_bytes() > 0


def test_bad_operations_have_specific_errors():
    lm = tiny_model("llama")
    notebook = Notebook.prefill(lm, _ids(lm, 20), ["prefix"] * 5 + ["skill"] * 15)
    with pytest.raises(NotebookError, match="position 25 is not in the notebook"):
        notebook.read(DECODE, ANSWERS, knockout=Knockout((25,)))
    with pytest.raises(NotebookError, match="layer 9 does not exist"):
        notebook.patch(notebook, [1], layers=[9])
    with pytest.raises(NotebookError, match="head 7 does not exist"):
        notebook.read(DECODE, ANSWERS, knockout=Knockout((1,), heads=(7,)))
    with pytest.raises(NotebookError, match="seam 40"):
        notebook.splice(notebook.block("skill"), seam=40)
    with pytest.raises(NotebookError, match="outside the context"):
        notebook.splice(notebook.block("skill"), at=99)
    with pytest.raises(NotebookError, match="segment 'nope'"):
        notebook.block("nope")
    other = tiny_model("llama", seed=1)
    with pytest.raises(NotebookError, match="computed by"):
        Notebook.prefill(other, [1, 2, 3]).splice(notebook.block("skill"))


def test_read_many_computes_equal_forks_once_and_keeps_their_own_labels(lm):
    stale, forks = _forks(lm)
    relabelled = stale.replace(range(8, 30), forks["downstream"].token_ids[30:].tolist(), ["other"] * 22)
    assert relabelled.computation() == forks["downstream"].computation() != forks["field"].computation()
    decisions = Notebook.read_many([forks["downstream"], relabelled], DECODE, ANSWERS)
    assert torch.equal(decisions[0].next_token_logits, decisions[1].next_token_logits)
    assert relabelled.keys[0] is forks["downstream"].keys[0]
    assert relabelled.visible_segments()[8:] == ["other"] * 22 and forks["downstream"].visible_segments()[8] != "other"
