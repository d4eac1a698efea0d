"""Tiny random-weight models and a trained-in-code tokenizer, for exact cache-math tests without downloads."""

from __future__ import annotations

import functools
import hashlib
import json

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

# Hybrids whose recurrent layers keep a running state instead of per-token K/V: built to be refused.
HYBRID_ARCHS: tuple[str, ...] = ("bamba", "qwen3_next")
# Every tiny architecture, in the support matrix's order, and the real family it stands in for (the Model card).
FAMILIES: dict[str, str] = {
    "llama": "Llama 2/3",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3 (qk-norm)",
    "mistral": "Mistral (sliding window)",
    "gemma2": "Gemma-2 (sliding window, soft-capping)",
    "gpt_neox": "GPT-NeoX / Pythia (partial rotary)",
    "phi": "Phi-1/2 (partial rotary)",
    "llama3_scaling": "Llama 3.1 rope scaling",
    "yarn": "YaRN scaling",
    "gpt2": "GPT-2 (learned positions)",
    "deepseek_v3": "DeepSeek-V3 (MLA, interleaved rope)",
    "deepseek_v2": "DeepSeek-V2 (MLA, complex rope)",
    "gemma3": "Gemma-3 (per-layer-type rope, sliding, qk-norm)",
    "gpt_oss": "GPT-OSS (sinks, sliding window, YaRN)",
    "llama4": "Llama-4 (chunked attention, NoPE layers)",
    "llama4_nope": "Llama-4-style NoPE layers, no chunking",
    "dynamic_ntk": "dynamic NTK scaling",
    "longrope": "LongRoPE (Phi-3)",
    "qwen2_vl": "Qwen2-VL (M-RoPE, text and images)",
    "qwen2_5_vl": "Qwen2.5-VL (M-RoPE, window-attention vision tower)",
    "bamba": "Bamba (Mamba-2 hybrid)",
    "qwen3_next": "Qwen3-Next (gated DeltaNet hybrid)",
}
TINY_ARCHS: tuple[str, ...] = tuple(arch for arch in FAMILIES if arch not in HYBRID_ARCHS)  # the families whose K/V are exact

SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_VOCAB_SIZE = 600
VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl")  # built with their vision tower and image processor
_EAGER_ARCHS = frozenset({"gemma2", "gemma3", "gpt_oss"})  # soft-capping and sinks live in their eager attention
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


_PLAIN_DECODERS = {  # arch: its config class and how its rope differs from the default
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {}),
    "llama3_scaling": (
        LlamaConfig,
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "yarn": (Qwen2Config, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
}


def _tiny_config(arch: str, tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """The config for one tiny architecture: 3 layers, hidden 64, 4 heads of 16 dims, 2 KV heads where supported."""
    common = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "initializer_range": 0.08,
        "tie_word_embeddings": False,
    }
    decoder = {
        **common,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 16384,
    }
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch in _PLAIN_DECODERS:
        config_class, rope_scaling = _PLAIN_DECODERS[arch]
        return config_class(**decoder, rope_parameters={**rope, **rope_scaling})
    if arch == "mistral":
        return MistralConfig(**decoder, rope_parameters=rope, sliding_window=24)
    if arch == "gemma2":
        return Gemma2Config(
            **decoder,
            rope_parameters=rope,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
        )
    if arch == "gpt_neox":
        neox = {k: v for k, v in decoder.items() if k not in ("num_key_value_heads", "head_dim")}
        return GPTNeoXConfig(**neox, rope_parameters={**rope, "partial_rotary_factor": 0.25})
    if arch == "phi":
        phi = {k: v for k, v in decoder.items() if k != "head_dim"}
        return PhiConfig(**phi, rope_parameters={**rope, "partial_rotary_factor": 0.5})
    if arch == "gpt2":
        return GPT2Config(**common, n_embd=64, n_layer=3, n_head=4, n_inner=128, n_positions=4096)
    return _newer_family_config(arch, decoder, rope)


def _newer_family_config(arch: str, decoder: dict, rope: dict) -> PretrainedConfig:
    """Configs of the families added for reach: latent attention, per-layer rope, sinks, NoPE, hybrids."""
    three_types = ["sliding_attention", "full_attention", "sliding_attention"]
    if arch in ("deepseek_v3", "deepseek_v2"):
        latent = {k: v for k, v in decoder.items() if k not in ("head_dim", "num_key_value_heads")}
        experts = {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
        }
        mla = {"num_key_value_heads": 4, "kv_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
        if arch == "deepseek_v3":
            return DeepseekV3Config(
                **latent, **experts, **mla, q_lora_rank=32, n_group=1, topk_group=1, rope_interleave=True, rope_parameters=rope
            )
        return DeepseekV2Config(**latent, **experts, **mla, q_lora_rank=None, rope_parameters=rope)
    if arch == "gemma3":
        local, full = {**rope}, {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}
        return Gemma3TextConfig(
            **decoder,
            sliding_window=16,
            layer_types=three_types,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=3.0,
            rope_parameters={"sliding_attention": local, "full_attention": full},
        )
    if arch == "gpt_oss":
        yarn = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        }
        return GptOssConfig(
            **decoder, num_local_experts=4, num_experts_per_tok=2, sliding_window=16, layer_types=three_types, rope_parameters=yarn
        )
    if arch in ("llama4", "llama4_nope"):
        chunked = arch == "llama4"
        return Llama4TextConfig(
            **decoder,
            intermediate_size_mlp=128,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 1, 0],
            attention_chunk_size=16 if chunked else None,
            attn_temperature_tuning=chunked,
            floor_scale=8,
            rope_parameters=rope,
        )
    if arch in ("dynamic_ntk", "longrope"):
        if arch == "dynamic_ntk":
            scaled = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        else:
            scaled = {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            }
        return LlamaConfig(**decoder, rope_parameters=scaled)
    if arch in VISION_ARCHS:
        text = {k: v for k, v in decoder.items() if k not in ("initializer_range", "tie_word_embeddings", "head_dim")}
        config_class, vision = (
            Qwen2VLConfig,
            {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "spatial_merge_size": 2},
        )
        if arch == "qwen2_5_vl":  # windowed vision attention with one full-attention block, as the real tower
            vision = {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "window_size": 56,
                "fullatt_block_indexes": [1],
                "spatial_merge_size": 2,
            }
            config_class = Qwen2_5_VLConfig
        return config_class(
            text_config={**text, "rope_parameters": {**rope, "mrope_section": [2, 3, 3]}},
            vision_config=vision,
            image_token_id=decoder["vocab_size"] - 1,
            video_token_id=decoder["vocab_size"] - 2,
            vision_start_token_id=decoder["vocab_size"] - 3,
            vision_end_token_id=decoder["vocab_size"] - 4,
            initializer_range=0.08,
            tie_word_embeddings=False,
        )
    if arch == "bamba":
        hybrid = {k: v for k, v in decoder.items() if k != "head_dim"}
        return BambaConfig(
            **hybrid, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16
        )
    if arch == "qwen3_next":
        return Qwen3NextConfig(
            **decoder,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            rope_parameters={**rope, "partial_rotary_factor": 0.5},
        )
    raise _unknown(arch)


def _unknown(arch: str) -> ModelLoadError:
    return ModelLoadError(f"unknown tiny architecture {arch!r}; choose one of: {', '.join(FAMILIES)}")


def tiny_family(model_type: str) -> str | None:
    """The family label of the first tiny stand-in whose text decoder has this ``model_type`` (None: unknown family)."""
    tokenizer = tiny_tokenizer()
    return next(
        (FAMILIES[arch] for arch in FAMILIES if _tiny_config(arch, tokenizer).get_text_config().model_type == model_type),
        None,
    )


def _config_hash(config: PretrainedConfig, seed: int) -> str:
    """First 16 hex digits of sha256 over the config JSON (sorted keys) and the seed."""
    payload = json.dumps(config.to_dict(), sort_keys=True, default=str) + f"\nseed={seed}"
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_tokenizer_only(arch: str, *, chat_template: bool = True) -> LoadedTokenizer:
    """The tokenizer and config of ``tiny-<arch>``, without building its weights."""
    if arch not in FAMILIES:
        raise _unknown(arch)
    tokenizer = tiny_tokenizer(chat_template=chat_template)
    return LoadedTokenizer(
        f"tiny-{arch}", tokenizer, _tiny_config(arch, tokenizer), "random weights (kvscope.engine.models.tiny), not built"
    )


def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, chat_template: bool = True) -> LoadedModel:
    """Build a tiny random-weight causal LM of `arch` (one of TINY_ARCHS) on CPU, eval mode, no grad."""
    tune_cpu_math()
    if arch not in FAMILIES:
        raise _unknown(arch)
    tokenizer = tiny_tokenizer(chat_template=chat_template)
    config = _tiny_config(arch, tokenizer)
    config_hash = _config_hash(config, seed)
    attn = "eager" if arch in _EAGER_ARCHS else "sdpa"
    torch.manual_seed(seed)
    auto_class = AutoModelForImageTextToText if arch in VISION_ARCHS else AutoModelForCausalLM
    model = auto_class.from_config(config, attn_implementation=attn, dtype=torch.float32)
    model.to(dtype).eval().requires_grad_(False)
    keep_output_rows_dense(model)
    name = f"tiny-{arch}"
    # Qwen2-VL's own processor with its defaults (14-pixel patches, 2×2 merge), capped so a picture stays a few tokens
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112) if arch in VISION_ARCHS else None
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
