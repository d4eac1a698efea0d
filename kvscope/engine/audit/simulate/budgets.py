"""KV budgets as servers size them: a server's memory (``ServerSize``) and its model's KV shape (``ModelKV``) give each
simulated engine the budget its server would have, so eviction happens where the server's would. Each engine's own
formula is its cache class's ``budget`` (``PrefixCache.budget``), which answers a ``Budget``: the limit used and where it
came from (a flag, the server's size, or none: unbounded).

- vLLM (``BlockCache``): ``determine_available_memory`` (GPU: memory × ``gpu_memory_utilization`` less what is not KV;
  here the weights alone, so the count is an upper bound; CPU: ``VLLM_CPU_KVCACHE_SPACE`` GiB, all of it KV) divided by
  the bytes of one block over every layer (the KV cache spec's ``page_size_bytes``: block × kv heads × (K + V head dim)
  × dtype bytes, summed over the layers): ``num_gpu_blocks``, of which the block pool keeps one as its null block.
- SGLang (``RadixCache``): ``profile_max_num_token``: the memory free after the weights less memory × (1 −
  ``mem_fraction_static``), over the cell size (kv heads × head dim × layers × 2 × dtype bytes): ``max_total_num_tokens``.
- llama.cpp (``SlotCache``): ``-c`` tokens, split evenly across ``-np`` slots (``n_ctx_seq = n_ctx / n_seq_max``);
  without ``-np`` the server's 4 slots share one unified KV cache, so each may hold all ``-c`` tokens. Its RAM prompt
  cache (``ServerSlots``) holds ``--cache-ram`` MiB (8 GiB by default) of saved slot states, each its tokens' f16 KV
  (``server_prompt_cache::update``): ``prompt_ram_tokens``.
Text only: no torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import computed_field

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.report.records import Record

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}  # a server's --dtype (or --kv-cache-dtype) in bytes
SERVED_FROM_FLOAT32 = "bfloat16"  # vLLM's and SGLang's "auto" dtype serves a float32 checkpoint in half precision
SGLANG_MEM_FRACTION = 0.88  # assumed where not given: SGLang picks it from the GPU's size (``--mem-fraction-static``)
VLLM_GPU_UTILIZATION = 0.9  # vLLM's default ``gpu_memory_utilization``
LLAMA_AUTO_SLOTS = 4  # llama-server's -np auto: 4 slots on one unified KV cache
LLAMA_CACHE_RAM_MIB = 8192  # llama-server's --cache-ram default (MiB; 0: no RAM prompt cache, -1: no limit)
LLAMA_KV_DTYPE = "float16"  # llama-server's -ctk / -ctv default: the KV a saved slot state holds
MIB = 1 << 20


@dataclass(frozen=True)
class ModelKV(Record):
    """A model's shape as a server sizes its KV cache: its layers, KV heads and head dim, its parameter count (for its
    weights' bytes) and the dtype its checkpoint names, read from its ``config.json`` (``of_config``)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    parameters: int
    dtype: str

    @classmethod
    def of_config(cls, config: Mapping[str, Any], name: str) -> ModelKV:
        """The shape of a decoder-only transformer's config (``config.json`` as a dict): the head dim where it names
        none is hidden / heads; KV heads default to the heads; the parameters counted as a Llama/Qwen2 layout has them
        (embeddings, attention with Qwen2's biases, a gated MLP, the norms, an untied head)."""
        text = config.get("text_config") or config
        try:
            layers, heads, hidden = int(text["num_hidden_layers"]), int(text["num_attention_heads"]), int(text["hidden_size"])
            kv_heads = int(text.get("num_key_value_heads") or heads)
            head_dim = int(text.get("head_dim") or hidden // heads)
            vocab, inner = int(text["vocab_size"]), int(text["intermediate_size"])
        except (KeyError, TypeError, ValueError) as error:
            raise RequestLogError(f"{name}'s config does not give its KV shape ({error}): a server's size needs a decoder's") from None
        bias = text.get("attention_bias")
        bias = text.get("model_type") == "qwen2" if bias is None else bool(bias)
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + (heads + 2 * kv_heads) * head_dim * bias
        per_layer = attention + 3 * hidden * inner + 2 * hidden
        head = 0 if text.get("tie_word_embeddings", config.get("tie_word_embeddings", True)) else vocab * hidden
        parameters = vocab * hidden + layers * per_layer + hidden + head
        dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32").removeprefix("torch.")
        return cls(name, layers, kv_heads, head_dim, parameters, dtype)

    @classmethod
    def of_loaded(cls, lm: Any) -> ModelKV:
        """The shape of a loaded model (``LoadedModel``: its model's config) or of a tokenizer-only load
        (``LoadedTokenizer``: its config), read without torch."""
        config = lm.config if hasattr(lm, "config") else lm.model.config
        return cls.of_config(config.to_dict(), lm.name)

    @classmethod
    def known(cls, lm: Any) -> ModelKV | None:
        """``of_loaded``, or None where the config gives no KV shape (a byte budget then runs unbounded, and says so)."""
        try:
            return cls.of_loaded(lm)
        except RequestLogError:
            return None

    def served_dtype(self, dtype: str | None) -> str:
        """The dtype a server holds the model and its KV in: ``dtype`` where given, else its "auto" (the checkpoint's,
        a float32 one in bfloat16: ``SERVED_FROM_FLOAT32``)."""
        if dtype is not None:
            return dtype
        return SERVED_FROM_FLOAT32 if self.dtype == "float32" else self.dtype

    def kv_bytes_per_token(self, dtype: str) -> int:
        """The KV bytes of one token over every layer: 2 (K and V) × layers × KV heads × head dim × dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def weight_bytes(self, dtype: str) -> int:
        """The weights' bytes at ``dtype``."""
        return self.parameters * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ServerSize(Record):
    """A server's size, as its own settings name it, for ``model``: one GPU's memory (``gpu_gib``) with vLLM's
    ``gpu_memory_utilization`` and SGLang's ``mem_fraction_static`` (None: ``SGLANG_MEM_FRACTION`` assumed), vLLM's CPU
    backend's ``VLLM_CPU_KVCACHE_SPACE`` (``cpu_kvcache_gib``, GiB; it replaces the GPU's memory for vLLM), llama.cpp's
    ``-c`` (``context``) and ``-np`` (``parallel``; None: auto) and the dtype served (None: the servers' "auto").
    Checked in its constructor, each setting named by its flag."""

    model: ModelKV
    gpu_gib: float | None = None
    gpu_memory_utilization: float = VLLM_GPU_UTILIZATION
    mem_fraction_static: float | None = None
    cpu_kvcache_gib: float | None = None
    context: int | None = None
    parallel: int | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        positive = {"--gpu-memory-gib": self.gpu_gib, "--vllm-cpu-kvcache-space": self.cpu_kvcache_gib}
        for flag, value in positive.items():
            if value is not None and not value > 0:
                raise RequestLogError(f"{flag} is a memory size in GiB above 0, got {value}")
        fractions = {"--gpu-memory-utilization": self.gpu_memory_utilization, "--mem-fraction-static": self.mem_fraction_static}
        for flag, value in fractions.items():
            if value is not None and not 0 < value <= 1:
                raise RequestLogError(f"{flag} is a share of the GPU's memory, above 0 and at most 1, got {value}")
        for flag, count in {"--llama-ctx-size": self.context, "--llama-parallel": self.parallel}.items():
            if count is not None and count < 1:
                raise RequestLogError(f"{flag} is at least 1, got {count}")
        if self.parallel is not None and self.context is None:
            raise RequestLogError("--llama-parallel splits llama.cpp's context across its slots: add --llama-ctx-size")
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise RequestLogError(f"--server-dtype is one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.gpu_gib is None and self.cpu_kvcache_gib is None and self.context is None:
            raise RequestLogError("a server's size names its memory: --gpu-memory-gib, --vllm-cpu-kvcache-space or --llama-ctx-size")

    @property
    def served(self) -> str:
        """The dtype the model and its KV are served in."""
        return self.model.served_dtype(self.dtype)

    def weights_words(self) -> str:
        """The model's weights as the formulas subtract them, in words."""
        model = self.model
        return f"{model.weight_bytes(self.served) / GIB:.2f} GiB of {model.name}'s weights ({model.parameters:,} × {self.served})"

    def kv_words(self) -> str:
        """The model's KV bytes per token, in words."""
        model = self.model
        shape = f"2 × {model.layers} layers × {model.kv_heads} KV heads × {model.head_dim} × {self.served}"
        return f"{model.kv_bytes_per_token(self.served):,} B of KV a token ({shape})"


@dataclass(frozen=True)
class Budget(Record):
    """The budget an engine's simulated cache ran with: ``limit`` ``unit`` (blocks, tokens or slots; None: unbounded),
    the tokens it holds in all (``tokens``; None: no bound), the tokens each slot holds (``each``, llama.cpp) and where
    it came from (``source``: a flag, the server's size with its formula, or why it is unbounded)."""

    engine: str
    unit: str
    limit: int | None
    tokens: int | None
    source: str
    each: int | None = None
    ram_tokens: int | None = None  # llama.cpp's RAM prompt cache: the tokens its saved prompts may hold (None: no limit)

    @computed_field
    @property
    def unbounded(self) -> bool:
        """Whether the cache held every block it ever saw (no limit), which no real server does."""
        return self.limit is None

    def words(self) -> str:
        """The budget in words: "12,345 blocks (197,520 tokens): <source>", or "unbounded: <why>"."""
        if self.limit is None:
            return f"unbounded ({self.source})"
        held = f" ({self.tokens:,} tokens)" if self.tokens is not None and self.unit != "tokens" else ""
        return f"{self.limit:,} {self.unit}{held}: {self.source}"


def kv_memory(memory: float, what: str) -> int:
    """``memory`` bytes for KV (``what``: its formula in words), refused where the server's memory leaves none."""
    if memory <= 0:
        raise RequestLogError(f"{what} leaves no memory for KV ({memory / GIB:.2f} GiB): give the server more memory")
    return int(memory)


def prompt_ram_tokens(cache_ram_mib: int, model: ModelKV | None) -> tuple[int | None, str]:
    """llama-server's RAM prompt cache limit in tokens (None: no limit) and where it comes from: ``--cache-ram`` MiB over
    the f16 KV bytes a token of ``model`` (the state a slot saves; the server drops the oldest entries past it)."""
    if cache_ram_mib < 0:
        return None, "RAM prompt cache without a limit (--llama-cache-ram -1)"
    if cache_ram_mib == 0:
        return 0, "no RAM prompt cache (--llama-cache-ram 0)"
    if model is None:
        return None, "RAM prompt cache unbounded: the model's KV shape is not known"
    per_token = model.kv_bytes_per_token(LLAMA_KV_DTYPE)
    tokens = cache_ram_mib * MIB // per_token
    per = f"{per_token:,} B of {LLAMA_KV_DTYPE} KV a token"
    return tokens, f"RAM prompt cache {tokens:,} tokens: --llama-cache-ram {cache_ram_mib:,} MiB / {per}"
