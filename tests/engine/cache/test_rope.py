"""RoPE re-rotation: layouts, partial rotary, scaling, refusals, and the per-model self-test."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvscope.engine.cache.rope import RopeUnsupported, Rotary, RotaryTable
from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.models.tiny import tiny_model
from tests.engine.cache.test_notebook import NOTEBOOK_ARCHS


class _InterleavedRotary(torch.nn.Module):
    """A GPT-J-style rotary table: each frequency repeated on adjacent channel pairs."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.attention_scaling = 1.0

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = freqs.repeat_interleave(2, dim=-1)
        return emb.cos(), emb.sin()


def _complex_rotation(keys: torch.Tensor, deltas: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Ground truth: rotate channel pairs as complex numbers by angle delta·freq."""
    half = keys.shape[-1] // 2
    if interleaved:
        pairs = torch.complex(keys[..., 0::2], keys[..., 1::2])
    else:
        pairs = torch.complex(keys[..., :half], keys[..., half:])
    rotated = pairs * torch.polar(torch.ones(()), deltas[:, None].float() * inv_freq)
    if interleaved:
        return torch.stack((rotated.real, rotated.imag), -1).flatten(-2)
    return torch.cat((rotated.real, rotated.imag), -1)


class _ComplexRotary(_InterleavedRotary):
    """A DeepSeek-V2/Llama-4-style table: complex ``freqs_cis`` with one entry per channel pair, scaled."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        return torch.polar(torch.ones_like(freqs), freqs) * 1.3


class _PerPairRotary(_InterleavedRotary):
    """A GPT-OSS-style table: real cos/sin with one entry per pair, applied to the two halves."""

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        return freqs.cos(), freqs.sin()


@pytest.mark.parametrize(
    "module, interleaved",
    [(None, False), (_InterleavedRotary(16), True), (_ComplexRotary(16), True), (_PerPairRotary(16), False)],
    ids=["llama", "interleaved", "complex", "per-pair"],
)
def test_rotation_matches_complex_multiplication(module, interleaved):
    table = Rotary.for_model(tiny_model("llama").model).tables[0] if module is None else RotaryTable.read(module)
    assert table.interleaved == interleaved and table.rotary_dim == 16
    keys = torch.randn(1, 2, 5, 16)
    deltas = torch.tensor([0, 1, -3, 17, 250])
    expected = _complex_rotation(keys, deltas, table.module.inv_freq, interleaved)
    assert torch.allclose(table.rotate(keys, deltas), expected, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt_neox", "phi"])
def test_partial_rotary_leaves_pass_through_channels(arch):
    table = Rotary.for_model(tiny_model(arch).model).tables[0]
    head_dim = 16
    assert table.rotary_dim < head_dim
    keys = torch.randn(1, 2, 4, head_dim)
    moved = table.rotate(keys, torch.tensor([5, 6, 7, 8]))
    assert torch.equal(moved[..., table.rotary_dim :], keys[..., table.rotary_dim :])
    assert not torch.allclose(moved[..., : table.rotary_dim], keys[..., : table.rotary_dim])


@pytest.mark.parametrize("arch", ["yarn", "gpt_oss"])
def test_yarn_rotation_uses_unscaled_angles(arch):
    table = Rotary.for_model(tiny_model(arch).model).tables[0]
    assert table.module.attention_scaling != 1.0
    keys = torch.randn(1, 2, 6, 16)
    moved = table.rotate(keys, torch.full((6,), 40))
    assert torch.allclose(moved.norm(dim=-1), keys.norm(dim=-1), atol=1e-5)  # a pure rotation keeps norms


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_scaling_is_refused(rope_type):
    parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    if rope_type == "longrope":
        parameters.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=64)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters=parameters,
    )
    with pytest.raises(RopeUnsupported, match=rope_type):
        Rotary.for_model(LlamaForCausalLM(config))


def test_model_without_rope_is_refused():
    with pytest.raises(RopeUnsupported, match="no rotary position embedding"):
        Rotary.for_model(tiny_model("gpt2").model)


@pytest.mark.parametrize("arch", NOTEBOOK_ARCHS)
def test_selftest_passes_on_every_tiny_arch(arch):
    report = run_selftest(tiny_model(arch))
    assert report.ok
    assert report.chunked_prefill_max_err < 1e-5
    if arch == "gpt2":
        assert not report.rope_supported and "no rotary" in report.rope_reason
        assert report.splice_identity_max_logit_err is None
    else:
        assert report.rope_roundtrip_max_err < 1e-6
        assert report.reposition_vs_prefill_max_err < 1e-5
        assert report.splice_identity_max_logit_err < 1e-5
        assert report.splice_full_seam_max_logit_err < 1e-4
