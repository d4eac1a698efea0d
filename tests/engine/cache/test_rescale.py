"""APE's rescaled attention over spliced entries against ground truth: plain splice at T = S = 1, APE's two-part
softmax computed by hand, and the refusals."""

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from kvscope.engine.cache.adapter import AttentionRescale, RescalePlan, attention_logits
from kvscope.engine.cache.notebook import Notebook, NotebookError
from kvscope.engine.models.tiny import TINY_ARCHS, tiny_model

# Every tiny family that splices (docs/support-matrix.md): GPT-2 has no rope, Llama-4 chunks its attention, dynamic NTK
# and LongRoPE frequencies depend on the length.
SPLICING_ARCHS = [arch for arch in TINY_ARCHS if arch not in ("gpt2", "llama4", "dynamic_ntk", "longrope")]
DECODE = [5, 6, 7]
ANSWERS = {"a": [[8]], "b": [[9, 10, 11]]}
APE = AttentionRescale(0.9, 0.9)


def _ids(lm, count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, lm.model.config.get_text_config().vocab_size - 10, (count,), generator=generator).tolist()


def _composed(lm, seam=2):
    """Prefix, a block compiled elsewhere spliced after it (``seam`` tokens repaired), a second block, then a tail."""
    ids = _ids(lm, 48)
    first = Notebook.prefill(lm, ids[8:24], "skill:a", start_position=3).block("skill:a")
    second = Notebook.prefill(lm, ids[28:40], "skill:b", start_position=5).block("skill:b")
    return (
        Notebook.prefill(lm, ids[:8], "prefix")
        .splice(first, seam=seam)
        .append(ids[24:28], "between")
        .splice(second, seam=seam)
        .append(ids[40:], "tail")
    )


@pytest.mark.parametrize("arch", SPLICING_ARCHS)
def test_ape_at_temperature_and_scale_one_equals_plain_splice_exactly(arch):
    lm = tiny_model(arch)
    plain = _composed(lm)
    unit = plain.rescaled(AttentionRescale(1.0, 1.0))
    assert torch.equal(unit.read(DECODE, ANSWERS).next_token_logits, plain.read(DECODE, ANSWERS).next_token_logits)
    done, unit_done = plain.materialized(), unit.materialized()
    assert all(torch.equal(a, b) for a, b in zip(done.keys + done.values, unit_done.keys + unit_done.values))
    rescaled = plain.rescaled(APE).read(DECODE, ANSWERS).next_token_logits  # the path is live: APE moves the logits
    assert float((rescaled - plain.read(DECODE, ANSWERS).next_token_logits).abs().max()) > 1e-3


def test_the_bias_equals_apes_two_part_softmax_in_float64():
    """One attention by hand: APE's context part at temperature T with LSE_C, the other part with LSE_O, weighed by
    softmax([S·T·LSE_C, LSE_O]), equals one softmax with the plan's bias on the context columns."""
    generator = torch.Generator().manual_seed(3)
    heads, rows, stored = 4, 5, 9
    logits = torch.randn(1, heads, rows, stored + rows, generator=generator, dtype=torch.float64) * 3
    values = torch.randn(1, heads, stored + rows, 6, generator=generator, dtype=torch.float64)
    context = torch.tensor([False, False, True, True, True, False, True, True, False])
    visible = torch.ones(rows, stored + rows, dtype=torch.bool).tril(stored)[None, None]
    visible[..., 1, 3] = False  # a knocked-out context entry stays out of LSE_C
    temperature = torch.tensor([0.9, 0.5, 1.0, 0.9, 0.7], dtype=torch.float64)
    scale = torch.tensor([0.9, 1.5, 1.0, 0.8, 1.2], dtype=torch.float64)
    columns = torch.nonzero(context).flatten()
    plan = RescalePlan(torch.arange(rows), columns, temperature, scale)
    biased = logits.clone()
    biased[..., columns] += plan.bias(logits[..., columns], visible[..., columns])
    output = torch.where(visible, biased, float("-inf")).softmax(-1) @ values

    is_context = torch.cat([context, torch.zeros(rows, dtype=torch.bool)])
    in_context, other = visible & is_context, visible & ~is_context
    t, s = temperature[:, None], scale[:, None]
    tempered = torch.where(in_context, logits / t, float("-inf"))
    lse_c, lse_o = tempered.logsumexp(-1), torch.where(other, logits, float("-inf")).logsumexp(-1)
    out_c = tempered.softmax(-1) @ values
    out_o = torch.where(other, logits, float("-inf")).softmax(-1) @ values
    weights = torch.stack([s[:, 0] * t[:, 0] * lse_c, lse_o]).softmax(0)
    expected = weights[0][..., None] * out_c + weights[1][..., None] * out_o
    assert float((output - expected).abs().max()) < 1e-12


def test_only_rows_that_see_a_spliced_entry_are_rescaled():
    plan = RescalePlan(torch.tensor([0, 2, 3]), torch.tensor([1, 2]), torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.9, 1.0, 1.1]))
    allowed = torch.ones(4, 6, dtype=torch.bool).tril(2)  # row 0 sees entries 0–2, row 3 everything
    allowed[2, 1:3] = False  # row 2 sees no spliced entry
    kept = plan.restricted(allowed)
    assert kept.rows.tolist() == [0, 3] and kept.temperature.tolist() == pytest.approx([0.9, 0.7]) and kept.columns.tolist() == [1, 2]
    assert plan.restricted(torch.zeros(4, 6, dtype=torch.bool)) is None


def test_attention_logits_repeat_each_kv_head_for_its_group_and_cap():
    generator = torch.Generator().manual_seed(1)
    query, key = torch.randn(1, 6, 3, 8, generator=generator), torch.randn(1, 2, 5, 8, generator=generator)
    got = attention_logits(query, key, 0.5, softcap=2.0)
    for head in range(6):
        expected = torch.tanh((query[0, head] @ key[0, head // 3].T) * 0.5 / 2.0) * 2.0
        assert torch.allclose(got[0, head], expected, atol=1e-6)


def _ape_reference(context: torch.Tensor, positions: torch.Tensor, rescale: AttentionRescale):
    """An attention function computing APE as its paper defines it, in float64: the context keys (``context`` over the
    cache's entries) at temperature T, the other keys (causal by ``positions``) plainly, the two partial outputs weighed
    by softmax([S·T·LSE_C, LSE_O])."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        keys, values = (t.repeat_interleave(groups, dim=1).double() for t in (key, value))
        logits = (query.double() @ keys.transpose(-1, -2)) * scaling
        rows = len(positions)
        key_positions = torch.cat([torch.arange(key.shape[2] - rows), positions])  # cached entry i sits at position i
        columns = torch.cat([context, torch.zeros(rows, dtype=torch.bool)])
        causal = key_positions[None, :] <= positions[:, None]
        in_context, other = causal & columns, causal & ~columns
        tempered = torch.where(in_context, logits / rescale.temperature, float("-inf"))
        plain = torch.where(other, logits, float("-inf"))
        weights = torch.stack([rescale.scale * rescale.temperature * tempered.logsumexp(-1), plain.logsumexp(-1)]).softmax(0)
        output = weights[0][..., None] * (tempered.softmax(-1) @ values) + weights[1][..., None] * (plain.softmax(-1) @ values)
        return output.transpose(1, 2).to(query.dtype).contiguous(), None

    return attend


def test_a_tiny_forward_with_apes_definition_equals_the_rescaled_notebook():
    """The tail after a spliced block and the question, run by the model's own layers with APE's two-part attention
    over a cache of the prefix and the spliced block, give the logits of the notebook read with ``ape:0.9,0.9``."""
    lm = tiny_model("qwen2")
    ids = _ids(lm, 40)
    block = Notebook.prefill(lm, ids[10:30], "skill", start_position=3).block("skill")
    spliced = Notebook.prefill(lm, ids[:10], "prefix").splice(block).materialized()
    decision = spliced.append(ids[30:], "tail").rescaled(APE).read(DECODE, ANSWERS)

    AttentionInterface.register("ape_reference_test", _ape_reference(spliced.spliced, torch.arange(30, 43), APE))
    AttentionMaskInterface.register("ape_reference_test", eager_mask)
    model = copy.deepcopy(lm.model)
    model.set_attn_implementation("ape_reference_test")
    cache = DynamicCache(ddp_cache_data=list(zip(spliced.keys, spliced.values)))  # entries in reading order, position = index
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[30:] + DECODE]), position_ids=torch.arange(30, 43)[None], cache=cache).logits
    assert float((logits[0, -1].float() - decision.next_token_logits).abs().max()) < 1e-5  # plain attention: 0.56 off


def test_recomputed_and_appended_entries_are_not_spliced_and_patches_keep_the_donors_provenance():
    lm = tiny_model("qwen2")
    composed = _composed(lm, seam=2)
    order = composed.order
    expected = [False] * 8 + [False] * 2 + [True] * 14 + [False] * 4 + [False] * 2 + [True] * 10 + [False] * 8
    assert composed.spliced[order].tolist() == expected
    recomputed = composed.recompute([12, 13])
    assert recomputed.spliced[recomputed.order].tolist() == expected[:12] + [False, False] + expected[14:]
    prefilled = Notebook.prefill(lm, composed.visible_token_ids())
    assert not bool(composed.patch(prefilled, [12, 13]).spliced[composed.order][12:14].any())
    assert bool(composed.patch(composed, [12, 13]).spliced[composed.order][12:14].all())


def test_ape_is_refused_by_name_without_a_spliced_entry_and_for_bad_settings():
    lm = tiny_model("qwen2")
    with pytest.raises(NotebookError, match=r"ape:0.9,0.9.*this notebook has none"):
        Notebook.prefill(lm, _ids(lm, 12)).rescaled(APE)
    block = Notebook.prefill(lm, _ids(lm, 6), "skill").block("skill")
    whole_seam = Notebook.prefill(lm, _ids(lm, 4, seed=1)).splice(block, seam=len(block))  # every block token recomputed
    with pytest.raises(NotebookError, match="has none"):
        whole_seam.rescaled(APE)
    for temperature, scale, word in ((0.0, 1.0, "temperature T"), (1.0, -0.5, "scale S"), (float("nan"), 1.0, "temperature T")):
        with pytest.raises(NotebookError, match=f"APE's {word} must be a finite number > 0"):
            AttentionRescale(temperature, scale)


def test_forks_with_and_without_ape_read_together_as_apart():
    lm = tiny_model("qwen2")
    composed = _composed(lm).materialized()
    forks = [composed.append([11, 12], "more"), composed.append([11, 12], "more").rescaled(APE)]
    together = Notebook.read_many(forks, DECODE, ANSWERS)
    apart = [fork.read(DECODE, ANSWERS) for fork in forks]
    for fused, alone in zip(together, apart):
        assert torch.allclose(fused.next_token_logits, alone.next_token_logits, atol=2e-5)
    assert float((together[0].next_token_logits - together[1].next_token_logits).abs().max()) > 1e-3


def test_captured_attention_follows_the_rescale():
    lm = tiny_model("qwen2")
    composed = _composed(lm)
    plain = composed.read(DECODE, ANSWERS, capture_attention=True).attention
    unit = composed.rescaled(AttentionRescale(1.0, 1.0)).read(DECODE, ANSWERS, capture_attention=True).attention
    rescaled = composed.rescaled(APE).read(DECODE, ANSWERS, capture_attention=True).attention
    assert torch.equal(unit, plain) and torch.allclose(rescaled.sum(-1), torch.ones(rescaled.shape[:-1]), atol=1e-5)
    spliced = composed.latest().spliced
    mass = lambda attention: float(attention[..., : len(spliced)][..., spliced].sum(-1).mean())  # noqa: E731
    assert mass(rescaled) < mass(plain)  # S < 1 moves attention off the spliced entries
