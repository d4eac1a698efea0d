"""Tiny random-weight models and a trained-in-code tokenizer, for exact cache-math tests without downloads."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    BambaConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    PhiConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3Config,
    Qwen3NextConfig,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from kvscope.engine.cache.loaded import (
    LoadedModel,
    LoadedTokenizer,
    ModelFingerprint,
    ModelLoadError,
    SpliceGate,
    dtype_name,
)
from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.models.cpu_math import keep_output_rows_dense, tune_cpu_math

SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_VOCAB_SIZE = 600
# Qwen2's pre-tokenizer split, so that a saved qwen2 directory (which transformers always reloads through
# Qwen2Tokenizer, rebuilding the pipeline) tokenizes exactly like the in-memory tokenizer.
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_CORPUS = """\
system
You are a helpful assistant.
user
assistant
SESSION
order_id: 48213
order_status: pending
customer_tier: gold
access_level: guest
request_id: REQ-1042
POLICY
Refunds are approved only when the order status is pending.
If the order status is shipped or delivered, the refund is not approved.
Answer yes or no. Should the refund be approved? Yes. No. yes. no.
The customer asked about the order. The order was shipped on Monday and delivered on Friday.
A support agent must check the status before any refund, return, exchange or cancellation.
Access is granted only when the access level is admin. Guests cannot open the billing page.
Is access granted? Answer yes or no. The user is an admin. The user is a guest.
The request id is only a reference number; it never changes the decision.
Status: pending. Status: shipped. Status: delivered. Status: cancelled. Status: approved.
Ticket 7 says the package is late. Ticket 8 says the item arrived damaged and asks for a refund.
Please approve the refund when the policy allows it, and deny it otherwise.
You are a careful support agent. You follow the policy and answer with one word.
The policy applies to every order, every customer and every request in this session.
When the status changes, the decision must change too: pending means yes, shipped means no.
Note: the order status may be updated later in the conversation; always use the latest value.
Thank you for your patience! We will review your request and reply within two business days.
Questions? Contact support at help@example.com or call 555-0100 (Monday to Friday, 9:00-17:00).
The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.
"""


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    """Train the byte-level BPE once; deterministic for a fixed corpus and settings."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines * 3, trainer=trainer, length=len(lines) * 3)
    return tok.to_str()


def tiny_tokenizer(chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE tokenizer (vocab ~600) that prepends `<|bos|>`; ChatML template unless disabled."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        add_bos_token=True,
        add_eos_token=False,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


_SHAPE = {  # every decoder's size: 3 layers, hidden 64, 4 heads of 16 dims, 2 KV heads where supported
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 16384,
}
_THREE_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
_SOFT_CAPPED = {  # Gemma's sliding layers with soft-capped attention and final logits
    "sliding_window": 16,
    "layer_types": _THREE_TYPES,
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": 4.0,
    "final_logit_softcapping": 3.0,
}
_LATENT = {  # DeepSeek's multi-head latent attention with a few routed experts
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "num_key_value_heads": 4,
    "kv_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
_LLAMA4 = {  # Llama-4's MoE with NoPE layers (chunked attention and temperature tuning set per entry)
    "intermediate_size_mlp": 128,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2,
    "no_rope_layers": [1, 1, 0],
    "floor_scale": 8,
}
_QWEN2_VL_TOWER = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "spatial_merge_size": 2}
_QWEN2_5_VL_TOWER = {  # windowed vision attention with one full-attention block, as the real tower
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "window_size": 56,
    "fullatt_block_indexes": [1],
    "spatial_merge_size": 2,
}


def _without(settings: dict, *keys: str) -> dict:
    """``settings`` less the ``keys`` a family's config does not take."""
    return {key: value for key, value in settings.items() if key not in keys}


def _vision(config_class: type[PretrainedConfig], tower: dict) -> Callable[[dict, dict], PretrainedConfig]:
    """A Qwen2-VL-style model: its text decoder with M-RoPE, a small vision tower, and image tokens at the vocabulary's end."""
    return lambda decoder, rope: config_class(
        text_config={
            **_without(decoder, "initializer_range", "tie_word_embeddings", "head_dim"),
            "rope_parameters": {**rope, "mrope_section": [2, 3, 3]},
        },
        vision_config=copy.deepcopy(tower),
        image_token_id=decoder["vocab_size"] - 1,
        video_token_id=decoder["vocab_size"] - 2,
        vision_start_token_id=decoder["vocab_size"] - 3,
        vision_end_token_id=decoder["vocab_size"] - 4,
        initializer_range=0.08,
        tie_word_embeddings=False,
    )


@dataclass(frozen=True)
class TinyArch:
    """One tiny architecture: the real family it stands in for (support matrix, Model card) and its config, made as
    ``config_class(**decoder less drop, **settings, rope_parameters=the default rope updated by rope)`` unless ``build``
    makes it."""

    family: str
    config_class: type[PretrainedConfig] | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    rope: Mapping[str, Any] | None = field(default_factory=dict)  # how its rope differs from the default; None: no rope parameters
    drop: tuple[str, ...] = ()  # decoder settings its config does not take
    build: Callable[[dict, dict], PretrainedConfig] | None = None  # (decoder settings, default rope) -> a config off the pattern
    kind: str = "text"  # "vision": built with its vision tower and image processor; "hybrid": recurrent layers, built to be refused
    eager: bool = False  # soft-capping and sinks live in its eager attention

    def config(self, decoder: dict, rope: dict) -> PretrainedConfig:
        if self.build is not None:
            return self.build(decoder, rope)
        parameters = {} if self.rope is None else {"rope_parameters": {**rope, **self.rope}}
        return self.config_class(**_without(decoder, *self.drop), **copy.deepcopy(self.settings), **parameters)


ARCHS: dict[str, TinyArch] = {  # in the support matrix's order
    "llama": TinyArch("Llama 2/3", LlamaConfig),
    "qwen2": TinyArch("Qwen2 / Qwen2.5", Qwen2Config),
    "qwen3": TinyArch("Qwen3 (qk-norm)", Qwen3Config),
    "mistral": TinyArch("Mistral (sliding window)", MistralConfig, {"sliding_window": 24}),
    "gemma2": TinyArch("Gemma-2 (sliding window, soft-capping)", Gemma2Config, _SOFT_CAPPED, eager=True),
    "gpt_neox": TinyArch(
        "GPT-NeoX / Pythia (partial rotary)", GPTNeoXConfig, rope={"partial_rotary_factor": 0.25}, drop=("num_key_value_heads", "head_dim")
    ),
    "phi": TinyArch("Phi-1/2 (partial rotary)", PhiConfig, rope={"partial_rotary_factor": 0.5}, drop=("head_dim",)),
    "llama3_scaling": TinyArch(
        "Llama 3.1 rope scaling",
        LlamaConfig,
        rope={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "yarn": TinyArch("YaRN scaling", Qwen2Config, rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "gpt2": TinyArch(
        "GPT-2 (learned positions)",
        GPT2Config,
        {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_inner": 128, "n_positions": 4096},
        rope=None,
        drop=tuple(_SHAPE),
    ),
    "deepseek_v3": TinyArch(
        "DeepSeek-V3 (MLA, interleaved rope)",
        DeepseekV3Config,
        {**_LATENT, "q_lora_rank": 32, "n_group": 1, "topk_group": 1, "rope_interleave": True},
        drop=("head_dim", "num_key_value_heads"),
    ),
    "deepseek_v2": TinyArch(
        "DeepSeek-V2 (MLA, complex rope)", DeepseekV2Config, {**_LATENT, "q_lora_rank": None}, drop=("head_dim", "num_key_value_heads")
    ),
    "gemma3": TinyArch(
        "Gemma-3 (per-layer-type rope, sliding, qk-norm)",
        build=lambda decoder, rope: Gemma3TextConfig(
            **decoder,
            **copy.deepcopy(_SOFT_CAPPED),
            rope_parameters={"sliding_attention": rope, "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
        ),
        eager=True,
    ),
    "gpt_oss": TinyArch(
        "GPT-OSS (sinks, sliding window, YaRN)",
        GptOssConfig,
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "layer_types": _THREE_TYPES},
        rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0},
        eager=True,
    ),
    "llama4": TinyArch(
        "Llama-4 (chunked attention, NoPE layers)",
        Llama4TextConfig,
        {**_LLAMA4, "attention_chunk_size": 16, "attn_temperature_tuning": True},
    ),
    "llama4_nope": TinyArch(
        "Llama-4-style NoPE layers, no chunking",
        Llama4TextConfig,
        {**_LLAMA4, "attention_chunk_size": None, "attn_temperature_tuning": False},
    ),
    "dynamic_ntk": TinyArch("dynamic NTK scaling", LlamaConfig, rope={"rope_type": "dynamic", "factor": 2.0}),
    "longrope": TinyArch(
        "LongRoPE (Phi-3)",
        LlamaConfig,
        rope={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 64},
    ),
    "qwen2_vl": TinyArch("Qwen2-VL (M-RoPE, text and images)", build=_vision(Qwen2VLConfig, _QWEN2_VL_TOWER), kind="vision"),
    "qwen2_5_vl": TinyArch(
        "Qwen2.5-VL (M-RoPE, window-attention vision tower)", build=_vision(Qwen2_5_VLConfig, _QWEN2_5_VL_TOWER), kind="vision"
    ),
    "bamba": TinyArch(
        "Bamba (Mamba-2 hybrid)",
        BambaConfig,
        {
            "attn_layer_indices": [1],
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 16,
        },
        rope=None,
        drop=("head_dim",),
        kind="hybrid",
    ),
    "qwen3_next": TinyArch(
        "Qwen3-Next (gated DeltaNet hybrid)",
        Qwen3NextConfig,
        {
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        rope={"partial_rotary_factor": 0.5},
        kind="hybrid",
    ),
}
FAMILIES: dict[str, str] = {name: arch.family for name, arch in ARCHS.items()}
HYBRID_ARCHS: tuple[str, ...] = tuple(name for name, arch in ARCHS.items() if arch.kind == "hybrid")
VISION_ARCHS: tuple[str, ...] = tuple(name for name, arch in ARCHS.items() if arch.kind == "vision")
TINY_ARCHS: tuple[str, ...] = tuple(name for name in ARCHS if name not in HYBRID_ARCHS)  # the families whose K/V are exact


def _tiny_config(arch: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The config of one tiny architecture, its vocabulary the tokenizer's."""
    if arch not in ARCHS:
        raise _unknown(arch)
    common = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "initializer_range": 0.08,
        "tie_word_embeddings": False,
    }
    return ARCHS[arch].config({**common, **_SHAPE}, {"rope_type": "default", "rope_theta": 10000.0})


def _unknown(arch: str) -> ModelLoadError:
    return ModelLoadError(f"unknown tiny architecture {arch!r}; choose one of: {', '.join(FAMILIES)}")


def tiny_family(model_type: str) -> str | None:
    """The family label of the first tiny stand-in whose text decoder has this ``model_type`` (None: unknown family)."""
    tokenizer = tiny_tokenizer()
    return next(
        (arch.family for name, arch in ARCHS.items() if _tiny_config(name, tokenizer).get_text_config().model_type == model_type),
        None,
    )


def _config_hash(config: PretrainedConfig, seed: int) -> str:
    """First 16 hex digits of sha256 over the config JSON (sorted keys) and the seed."""
    payload = json.dumps(config.to_dict(), sort_keys=True, default=str) + f"\nseed={seed}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_tokenizer_only(arch: str, *, chat_template: bool = True) -> LoadedTokenizer:
    """The tokenizer and config of ``tiny-<arch>``, without building its weights."""
    if arch not in ARCHS:
        raise _unknown(arch)
    tokenizer = tiny_tokenizer(chat_template=chat_template)
    return LoadedTokenizer(
        f"tiny-{arch}", tokenizer, _tiny_config(arch, tokenizer), "random weights (kvscope.engine.models.tiny), not built"
    )


def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, chat_template: bool = True) -> LoadedModel:
    """Build a tiny random-weight causal LM of `arch` (one of TINY_ARCHS) on CPU, eval mode, no grad."""
    tune_cpu_math()
    if arch not in ARCHS:
        raise _unknown(arch)
    tokenizer = tiny_tokenizer(chat_template=chat_template)
    config = _tiny_config(arch, tokenizer)
    config_hash = _config_hash(config, seed)
    attn = "eager" if ARCHS[arch].eager else "sdpa"
    torch.manual_seed(seed)
    auto_class = AutoModelForImageTextToText if ARCHS[arch].kind == "vision" else AutoModelForCausalLM
    model = auto_class.from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.to(dtype).eval().requires_grad_(False)
    keep_output_rows_dense(model)
    name = f"tiny-{arch}"
    # Qwen2-VL's own processor with its defaults (14-pixel patches, 2×2 merge), capped so a picture stays a few tokens
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112) if ARCHS[arch].kind == "vision" else None
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        dtype=dtype,
        source="random weights (kvscope.engine.models.tiny)",
        fingerprint=ModelFingerprint(name=name, config_hash=config_hash, dtype=dtype_name(dtype)),
        image_processor=processor,
        splice_gate=SpliceGate(run_selftest),
    )
