"""Tiny random-weight models and the in-code tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvscope.engine.models import LoadedModel, tiny
from kvscope.engine.models.tiny import (
    HYBRID_ARCHS,
    TINY_ARCHS,
    tiny_model,
    tiny_tokenizer,
)
from tests.shared import make_tiny_model_dir

TEXT = "SESSION\norder_status: shipped\nPOLICY\nRefunds are approved only when order_status is pending. Yes or no?"


def _rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    return next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)


def _ids(tokenizer, n: int = 20) -> torch.Tensor:
    ids = tokenizer(TEXT * 3).input_ids[:n]
    assert len(ids) == n
    return torch.tensor([ids])


@pytest.mark.parametrize("arch", TINY_ARCHS + HYBRID_ARCHS)
def test_every_arch_builds_and_runs(arch: str) -> None:
    loaded = tiny_model(arch)
    assert isinstance(loaded, LoadedModel)
    assert loaded.name == f"tiny-{arch}" and loaded.fingerprint.name == loaded.name
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert len(loaded.fingerprint.config_hash) == 16
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.config.get_text_config().vocab_size == len(loaded.tokenizer)
    expected_attn = "eager" if arch in ("gemma2", "gemma3", "gpt_oss") else "sdpa"
    assert loaded.model.config._attn_implementation == expected_attn
    logits = loaded.model(_ids(loaded.tokenizer)).logits
    assert logits.shape == (1, 20, len(loaded.tokenizer))
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1
    assert (logits[0, -1].max() - logits[0, -1].min()) > 1.0


def test_same_seed_same_weights_other_seed_differs() -> None:
    a, b, c = tiny_model("llama"), tiny_model("llama"), tiny_model("llama", seed=1)
    ids = _ids(a.tokenizer)
    assert torch.equal(a.model(ids).logits, b.model(ids).logits)
    assert not torch.equal(a.model(ids).logits, c.model(ids).logits)
    assert a.fingerprint == b.fingerprint and a.fingerprint.config_hash != c.fingerprint.config_hash


def test_dtype() -> None:
    loaded = tiny_model("qwen2", dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16 and loaded.fingerprint.dtype == "bfloat16"
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_unknown_arch_lists_choices() -> None:
    with pytest.raises(ValueError, match="llama.*gpt2"):
        tiny_model("bert")


def test_yarn_attention_scaling_is_exercised() -> None:
    rotary = _rotary(tiny_model("yarn").model)
    assert rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1.0)
    assert rotary.attention_scaling != 1.0
    assert _rotary(tiny_model("llama").model).attention_scaling == 1.0


def test_llama3_scaling_changes_frequencies() -> None:
    plain = _rotary(tiny_model("llama").model).inv_freq
    scaled = _rotary(tiny_model("llama3_scaling").model).inv_freq
    assert torch.equal(plain[:1], scaled[:1]) and not torch.allclose(plain, scaled)


def test_gpt2_has_no_rotary_embedding() -> None:
    assert _rotary(tiny_model("gpt2").model) is None


@pytest.mark.parametrize("arch, factor", [("gpt_neox", 0.25), ("phi", 0.5)])
def test_partial_rotary(arch: str, factor: float) -> None:
    model = tiny_model(arch).model
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    rotary_dim = 2 * _rotary(model).inv_freq.numel()
    assert rotary_dim == int(head_dim * factor) < head_dim


def test_window_and_softcap_settings() -> None:
    assert tiny_model("mistral").model.config.sliding_window == 24
    config = tiny_model("gemma2").model.config
    assert config.sliding_window == 16
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    assert config.attn_logit_softcapping and config.final_logit_softcapping


def test_gqa_where_supported() -> None:
    for arch in ("llama", "qwen2", "qwen3", "mistral", "gemma2"):
        config = tiny_model(arch).model.config
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)


def test_tokenizer_deterministic_and_multichar() -> None:
    fresh = tiny.Tokenizer.from_str(tiny._trained_tokenizer_json.__wrapped__())
    cached = tiny_tokenizer()
    assert fresh.encode(TEXT).ids == cached(TEXT, add_special_tokens=False).input_ids
    assert tiny_tokenizer()(TEXT).input_ids == cached(TEXT).input_ids
    assert 550 <= len(cached) <= 650
    pieces = [cached.decode([i]) for i in cached(TEXT, add_special_tokens=False).input_ids]
    for word in (" shipped", " pending", " approved"):
        assert word in pieces
    for special in tiny.SPECIAL_TOKENS:
        assert len(cached(special, add_special_tokens=False).input_ids) == 1


def test_tokenizer_offsets_and_round_trip() -> None:
    tokenizer = tiny_tokenizer()
    text = TEXT + "\n\n  Ticket #7: 12.5% off!"
    encoded = tokenizer(text, return_offsets_mapping=True)
    assert encoded.input_ids[0] == tokenizer.bos_token_id and encoded.offset_mapping[0] == (0, 0)
    assert "".join(text[s:e] for s, e in encoded.offset_mapping[1:]) == text
    assert tokenizer.decode(encoded.input_ids, skip_special_tokens=True) == text
    unicode = "café – naïve 😀"
    assert tokenizer.decode(tokenizer(unicode).input_ids, skip_special_tokens=True) == unicode


def test_chat_template_switch() -> None:
    assert tiny_tokenizer(chat_template=False).chat_template is None
    text = tiny_tokenizer().apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|bos|><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_model("llama", chat_template=False).tokenizer.chat_template is None


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_model_dir_round_trip(arch: str, tmp_path) -> None:
    path = make_tiny_model_dir(arch, tmp_path / arch)
    assert (path / "model.safetensors").exists()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    reference = tiny_model(arch)
    assert len(tokenizer) == len(reference.tokenizer)
    assert tokenizer(TEXT).input_ids == reference.tokenizer(TEXT).input_ids
    assert tokenizer.chat_template == reference.tokenizer.chat_template
    ids = _ids(tokenizer)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference.model(ids).logits)
