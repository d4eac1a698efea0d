"""The decision readout runs in float32 whatever the model's dtype: the final norm and the LM head read the (model-dtype)
last hidden state in float32, so margins are not rounded to the dtype's steps."""

import pytest
import torch

from kvscope.engine.cache import adapter
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.models.tiny import tiny_model

ARCHS = ("qwen2", "llama", "gemma2", "gpt2", "gpt_neox")  # RMSNorm, Gemma's (1 + w) norm with soft-capping, LayerNorm
BF16_STEP = 0.125  # bfloat16's spacing between 16 and 32


def _loud(lm, scale: float = 400.0):
    """The tiny model with its LM head scaled so logits sit near ±16–32, where bfloat16's step is 0.125 (not where the
    logits are soft-capped: they would saturate)."""
    if getattr(lm.model.config, "final_logit_softcapping", None):
        return lm
    head = lm.model.get_output_embeddings()
    head.weight.data = (head.weight.data.float() * scale).to(head.weight.dtype)
    return lm


def _prefill(lm, ids: torch.Tensor) -> adapter.ForwardResult:
    """A causal prefill of ``ids`` through the engine's forward, every row's logits kept."""
    count = len(ids)
    allowed = torch.ones(count, count, dtype=torch.bool).tril()
    return adapter.forward(lm.model, [], [], torch.arange(0), ids, torch.arange(count), allowed, logit_rows=torch.arange(count))


def _reference(lm, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the engine's logits, a float32 readout of the same last hidden state in the model's dtype), for every row."""
    captured = []
    norm = adapter.final_norm(lm.model)
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        result = _prefill(lm, ids)
    finally:
        handle.remove()
    hidden = captured[-1]
    float_norm = type(norm)(*_norm_args(norm)).float()
    float_norm.load_state_dict({name: value.float() for name, value in norm.state_dict().items()})
    head = lm.model.get_output_embeddings()
    logits = torch.nn.functional.linear(float_norm(hidden.float()), head.weight.float(), None if head.bias is None else head.bias.float())
    softcap = getattr(lm.model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return result.logits, logits[0]


def _norm_args(norm: torch.nn.Module) -> tuple:
    if isinstance(norm, torch.nn.LayerNorm):
        return norm.normalized_shape, norm.eps
    return (norm.weight.shape[0], getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_bfloat16_models_logits_are_a_float32_readout_of_its_own_hidden_state(arch):
    lm = _loud(tiny_model(arch, dtype=torch.bfloat16))
    ids = torch.tensor(lm.tokenizer.encode("the account tier is gold and the answer is yes")[:12])
    engine, reference = _reference(lm, ids)
    assert engine.dtype == torch.float32
    assert torch.allclose(engine, reference, atol=2e-4, rtol=1e-5)
    assert (engine != engine.bfloat16().float()).float().mean() > 0.5  # not rounded to bfloat16's steps


def test_a_float32_model_reads_as_it_did_bit_for_bit():
    lm = tiny_model("qwen2")
    ids = torch.tensor(lm.tokenizer.encode("the account tier is gold")[:8])
    plain = lm.model(input_ids=ids[None]).logits[0]  # the model's own forward before the readout is installed
    engine = _prefill(lm, ids).logits
    assert torch.allclose(engine, plain, atol=1e-5)
    assert torch.equal(lm.model(input_ids=ids[None]).logits[0], plain)  # the installed readout leaves float32 untouched


def test_a_bfloat16_decision_margin_leaves_the_0125_grid_and_is_the_float32_readout_of_its_hidden_state():
    """On a scaled tiny model the bfloat16 margin was a multiple of 0.125 (its logits were); it is now the margin a
    float32 norm and head give on the same bfloat16 hidden state."""
    lm = _loud(tiny_model("qwen2", dtype=torch.bfloat16), scale=100.0)
    context = lm.tokenizer.encode("refunds need a receipt . receipt : yes . status : open . ")
    question = lm.tokenizer.encode("approve ?")
    yes, no = context[2], context[5]  # two distinct tokens as the answers
    captured = []
    norm = adapter.final_norm(lm.model)
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0].detach()))
    try:
        margin = Notebook.empty(lm).append(context).read(question, {"yes": [[yes]], "no": [[no]]}).margin
    finally:
        handle.remove()
    hidden = captured[-1][0, len(context) + len(question) - 1].float()  # the question's last token, in bfloat16's values
    head = lm.model.get_output_embeddings().weight.float()
    normed = hidden * torch.rsqrt(hidden.pow(2).mean() + lm.model.config.rms_norm_eps) * norm.weight.float()
    steps = torch.log_softmax(head @ normed, -1)
    assert abs(margin) > 4 and abs(margin / BF16_STEP - round(margin / BF16_STEP)) > 1e-3
    assert margin == pytest.approx(float(steps[yes] - steps[no]), abs=1e-3)


def test_the_head_copies_its_weight_again_when_the_weight_changes():
    lm = tiny_model("qwen2", dtype=torch.bfloat16)
    ids = torch.tensor(lm.tokenizer.encode("a b c")[:3])
    first = _reference(lm, ids)[0]
    head = lm.model.get_output_embeddings()
    with torch.no_grad():
        head.weight.mul_(2)  # an in-place edit bumps the weight's version
    second, reference = _reference(lm, ids)
    assert torch.allclose(second, reference, atol=1e-4) and not torch.allclose(first, second)
