"""The one place that touches transformers' cache objects, forward keywords and attention dispatch.

Every forward of the engine runs through :func:`forward`: the stored K/V (any order, with positions)
becomes a ``DynamicCache``, and a registered attention function (``"kvscope"``) replaces the model's
mask by the caller's query × key visibility (so unrelated branches can share one forward), adds
per-layer/per-head knockouts, rescales the attention over spliced entries where asked (APE, :class:`AttentionRescale`),
and captures attention probabilities when asked. Sliding-window and chunked-attention layers get their window or chunk
from positions too, so caches never drop entries.
"""

from __future__ import annotations

import copy
import importlib
import math
import types
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask
from transformers.models.llama.modeling_llama import (
    eager_attention_forward as llama_eager_attention,
)

from kvscope.engine.errors import KVScopeError, NotebookError

ATTENTION_NAME = "kvscope"


@dataclass(frozen=True)
class AttentionRescale:
    """APE's attention over spliced (context) entries (arXiv 2502.05431): their logits at temperature ``temperature``
    and their summed weight scaled by ``scale`` against the other keys, per query and head.

    APE computes the context part as softmax(l/T) with log-sum-exp LSE_C and the rest (shared prefix, the query's
    own tokens) as softmax(l) with LSE_O, then weighs the two partial outputs by softmax([S·T·LSE_C, LSE_O]). That
    equals one softmax over every key with the bias l·(1/T − 1) + (S·T − 1)·LSE_C added to the context logits
    (:meth:`RescalePlan.bias`); T = S = 1 adds exactly 0. Only the rows that see a context entry pay for it.
    """

    temperature: float
    scale: float

    def __post_init__(self) -> None:
        for name, value in (("temperature T", self.temperature), ("scale S", self.scale)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise NotebookError(f"APE's {name} must be a finite number > 0, got {value!r}")

    @property
    def name(self) -> str:
        """The remedy part that reads back as this rescale: ``ape:T,S``."""
        return f"ape:{self.temperature:g},{self.scale:g}"


@dataclass(frozen=True)
class RescalePlan:
    """The block of one forward's attention read through APE: its rescaled query rows, the stored entries they read
    that way (spliced K/V never recomputed), and each row's setting. Every other row and column is plain."""

    rows: torch.Tensor  # (R,) long: query rows whose notebook rescales
    columns: torch.Tensor  # (C,) long: stored entries (key columns) read through the rescale
    temperature: torch.Tensor  # (R,) float32
    scale: torch.Tensor  # (R,) float32

    def restricted(self, allowed: torch.Tensor) -> RescalePlan | None:
        """Only the rows that see some of the columns in ``allowed`` (Q, K); None where no row does (e.g. a prefix)."""
        device = allowed.device
        rows, columns = self.rows.to(device), self.columns.to(device)
        sees = allowed[rows][:, columns].any(-1) if len(rows) and len(columns) else torch.zeros(len(rows), dtype=torch.bool, device=device)
        if not bool(sees.any()):
            return None
        return RescalePlan(rows[sees], columns, self.temperature.to(device)[sees], self.scale.to(device)[sees])

    def bias(self, logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The additive term (1, H, R, C) on the block's attention ``logits`` (1, H, R, C) float32 (after soft-capping),
        ``visible`` (1, H or 1, R, C) saying which of its keys each row sees: l·(1/T − 1) + (S·T − 1)·LSE_C(T)."""
        temperature = self.temperature.to(logits.dtype)[:, None]
        scale = self.scale.to(logits.dtype)[:, None]
        lse = torch.where(visible, logits / temperature, float("-inf")).logsumexp(dim=-1, keepdim=True)
        lse = torch.where(visible.any(-1, keepdim=True), lse, 0.0)  # a row whose context keys are all windowed or knocked out
        bias = logits * (1.0 / temperature - 1.0) + (scale * temperature - 1.0) * lse
        return torch.where(visible, bias, 0.0)

    def rows_mask(
        self,
        mask: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        visible: torch.Tensor,
        scaling: float | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """The rescaled rows' additive mask (1, H, R, K): their rows of ``mask`` (1, H or 1, Q, K), per query head, with
        the bias added on the block's columns."""
        rows, columns = self.rows, self.columns
        logits = attention_logits(query[:, :, rows], key[:, :, columns], scaling, softcap)
        block = self.bias(logits, visible[:, :, rows][:, :, :, columns])
        rescaled = mask[:, :, rows].expand(1, query.shape[1], len(rows), mask.shape[-1]).clone()
        rescaled[:, :, :, columns] += block.to(mask.dtype)
        return rescaled


@dataclass(frozen=True)
class RowMasks:
    """One layer's additive masks by query row: the shared mask (1, H or 1, Q, K), and APE's per-head mask (1, H, R, K)
    of its rescaled rows where a forward rescales (only those rows pay for a per-head mask)."""

    shared: torch.Tensor
    rows: torch.Tensor | None = None  # (R,) ascending
    rescaled: torch.Tensor | None = None

    def of(self, subset: torch.Tensor) -> torch.Tensor:
        """The mask of the query rows ``subset`` (1, H or 1, len(subset), K)."""
        if self.rows is None:
            return self.shared[:, :, subset]
        index = torch.full((self.shared.shape[2],), -1, dtype=torch.long, device=subset.device)
        index[self.rows] = torch.arange(len(self.rows), device=subset.device)
        chosen = index[subset]
        inside = chosen >= 0
        mask = self.shared[:, :, subset].expand(1, self.rescaled.shape[1], len(subset), self.shared.shape[-1]).clone()
        mask[:, :, inside] = self.rescaled[:, :, chosen[inside]]
        return mask

    def attend(self, attend, module, query, key, value, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attend`` (SDPA or an eager attention) over every row: plain rows with the shared mask, rescaled rows with
        theirs, in two calls (no attention weights then); output (1, Q, H, head_dim)."""
        if self.rows is None:
            return attend(module, query, key, value, self.shared, **kwargs)
        count = query.shape[2]
        rescaled, _ = attend(module, query[:, :, self.rows], key, value, self.rescaled, **kwargs)
        if len(self.rows) == count:
            return rescaled, None
        plain = torch.ones(count, dtype=torch.bool, device=query.device)
        plain[self.rows] = False
        plain = torch.nonzero(plain).flatten()
        shared, _ = attend(module, query[:, :, plain], key, value, self.shared[:, :, plain], **kwargs)
        output = rescaled.new_empty(rescaled.shape[0], count, *rescaled.shape[2:])
        output[:, self.rows], output[:, plain] = rescaled, shared
        return output, None


@dataclass
class ForwardPlan:
    """Per-forward attention settings, read by the registered attention function."""

    allowed: torch.Tensor  # (Q, K) bool: which keys each query sees (causal), without any window
    query_positions: torch.Tensor  # (Q,)
    key_positions: torch.Tensor  # (K,)
    blocked: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (H or 1, Q, K) bool
    capture_rows: torch.Tensor | None = None  # query rows whose attention probabilities are kept
    use_sdpa: bool = True
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (H, rows, K) probabilities
    stop_layer: int | None = None  # the forward ends once this layer has cached its K/V
    rescale: RescalePlan | None = None  # APE's attention over spliced entries, where a notebook asks for it

    def visible_for(self, layer: int, sliding_window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Which keys each query sees in one layer (1, H or 1, Q, K): visibility, window or attention chunk, knockouts."""
        allowed = self.allowed
        if sliding_window:
            distance = self.query_positions[:, None] - self.key_positions[None, :]
            allowed = allowed & (distance < sliding_window)
        if chunk:
            allowed = allowed & (self.query_positions[:, None] // chunk == self.key_positions[None, :] // chunk)
        allowed = allowed[None]  # (1, Q, K)
        if layer in self.blocked:
            allowed = allowed & ~self.blocked[layer]
        return allowed[None]

    @cached_property
    def causal_after(self) -> int | None:
        """How many stored entries this forward's tokens follow when every token sees all of them and the tokens before
        it among its own (a prefill continuing a cache), else None."""
        count, keys = self.allowed.shape
        stored = keys - count
        causal = torch.ones(count, keys, dtype=torch.bool, device=self.allowed.device).tril(stored)
        return stored if torch.equal(self.allowed, causal) else None

    def mask_for(self, layer: int, sliding_window: int | None, dtype: torch.dtype, chunk: int | None = None) -> torch.Tensor:
        """Additive mask (1, H or 1, Q, K) for one layer: 0 where :meth:`visible_for` sees, the dtype's minimum elsewhere."""
        allowed = self.visible_for(layer, sliding_window, chunk)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


_ACTIVE_PLAN: ContextVar[ForwardPlan | None] = ContextVar("kvscope_plan", default=None)
_ORIGINAL_IMPLEMENTATION = "_kvscope_original_attn_implementation"


def _eager_for(module: torch.nn.Module):
    """The eager attention of the module's own modeling file (soft-capping, sinks...), else Llama's."""
    modeling = importlib.import_module(type(module).__module__)
    return getattr(modeling, "eager_attention_forward", llama_eager_attention)


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk size of a chunked-attention layer (Llama-4: tokens see only their own fixed chunk), else None."""
    layer_types = getattr(module.config, "layer_types", None) or []
    if module.layer_idx < len(layer_types) and layer_types[module.layer_idx] == "chunked_attention":
        return module.config.attention_chunk_size
    return None


def _temperature(module: torch.nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """Llama-4's query scale on NoPE layers at these positions (attention-temperature tuning)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def _retuned_query(module: torch.nn.Module, query: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
    """Queries scaled for their true positions where the model scaled them by storage index.

    Llama-4 tunes the temperature of NoPE layers from the cache length (stored entries + index), which
    equals the position only for a plain left-to-right cache; stored forks and hidden entries break that.
    """
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    count = len(plan.query_positions)
    stored = len(plan.key_positions) - count
    indices = torch.arange(stored, stored + count, device=query.device)
    ratio = _temperature(module, plan.query_positions.to(query.device)) / _temperature(module, indices)
    return (query.float() * ratio[:, None]).to(query.dtype)


def attention_logits(query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap: float | None = None) -> torch.Tensor:
    """The attention logits (1, H, Q, K) float32 the model's eager attention adds its mask to: q·k·scaling per query head
    (each KV head repeated for its group, as ``repeat_kv`` does), soft-capped where the family caps them."""
    (_, heads, rows, dim), key_heads = query.shape, key.shape[1]
    grouped = query.float().reshape(1, key_heads, heads // key_heads * rows, dim)  # query heads of one KV head side by side
    logits = torch.matmul(grouped, key.float().transpose(-1, -2)).reshape(1, heads, rows, key.shape[2])
    logits *= query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.tanh(logits / softcap) * softcap if softcap else logits


class _StoppedEarly(Exception):
    """Ends a forward whose plan asks for the K/V of its first layers only."""


def _kvscope_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    plan = _ACTIVE_PLAN.get()
    if plan is not None and plan.stop_layer == module.layer_idx:
        raise _StoppedEarly  # this layer's K/V are already in the cache
    use_sdpa = plan.use_sdpa if plan is not None else module.config._kvscope_use_sdpa
    if plan is not None:
        query = _retuned_query(module, query, plan)
        sliding_window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
        stored = _causal_padding(module, plan, query, sliding_window, kwargs.get("softcap"))
        if stored is not None:
            return _padded_causal_attention(module, query, key, value, stored, scaling)
        attention_mask = plan.mask_for(module.layer_idx, sliding_window, query.dtype, _attention_chunk(module))
    masks = RowMasks(attention_mask)
    if plan is not None and plan.rescale is not None:
        visible = plan.visible_for(module.layer_idx, sliding_window, _attention_chunk(module))
        rescaled = plan.rescale.rows_mask(attention_mask, query, key, visible, scaling, kwargs.get("softcap"))
        masks = RowMasks(attention_mask, plan.rescale.rows, rescaled)
    attend = sdpa_attention_forward if use_sdpa else _eager_for(module)
    output, weights = masks.attend(attend, module, query, key, value, scaling=scaling, dropout=dropout, **kwargs)
    if plan is not None and plan.capture_rows is not None:
        rows = plan.capture_rows  # probabilities for these queries only, by the model's own eager attention
        _, kept = _eager_for(module)(module, query[:, :, rows], key, value, masks.of(rows), scaling=scaling, dropout=0.0, **kwargs)
        plan.attentions[module.layer_idx] = kept[0].float()
    return output, weights


def _causal_padding(module, plan: ForwardPlan, query: torch.Tensor, sliding_window: int | None, softcap) -> int | None:
    """The stored entries to pad the queries by when this layer's attention is plain causal SDPA in disguise: the
    plan's visibility is a prefill continuing its stored entries (:attr:`ForwardPlan.causal_after`), nothing narrows it
    in this layer (window, attention chunk, knockout, APE's rescale) or reads its weights, and the new tokens outnumber
    the stored ones (padding costs their rows; below that the mask costs less). Else None."""
    if not plan.use_sdpa or plan.rescale is not None or plan.capture_rows is not None or softcap is not None:
        return None
    if sliding_window or _attention_chunk(module) or module.layer_idx in plan.blocked:
        return None
    count = query.shape[2]
    stored = plan.causal_after
    return stored if stored is not None and count > 1 and stored < count else None


def _padded_causal_attention(module, query, key, value, stored: int, scaling: float | None) -> tuple[torch.Tensor, None]:
    """SDPA with ``is_causal`` over every key: the queries padded in front by ``stored`` zero rows (their outputs
    dropped), so the causal diagonal falls where the mask's would. The same numbers, bit for bit, as the masked call
    (tested), without computing the masked half: a 1,024-token prefill chunk's attention 33 → 21 ms a layer in
    bfloat16 on these CPUs."""
    if stored:
        query = torch.cat([query.new_zeros(*query.shape[:2], stored, query.shape[3]), query], dim=2)
    output, _ = sdpa_attention_forward(module, query, key, value, None, scaling=scaling, dropout=0.0, is_causal=True)
    return output[:, stored:], None


def _register_attention() -> None:
    """Register KVScope's attention function with transformers (on the first install, not at import)."""
    if ATTENTION_NAME in AttentionInterface._global_mapping:
        return
    AttentionInterface.register(ATTENTION_NAME, _kvscope_attention)
    # Outside engine forwards (e.g. captum calling the model) the model builds its own masks: additive
    # float masks work for both the SDPA and the eager path of the function above.
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


def cache_entry_shapes(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, dim) of one token's cached key and value: per-KV-head K/V, or under multi-head latent
    attention (DeepSeek-V2/V3) the latent shared by every head and its decoupled rope key."""
    config = config.get_text_config()
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_rope_head_dim", None):
        return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return (kv_heads, head_dim), (kv_heads, head_dim)


def cache_layout(config) -> str:
    """What one token's cache entry holds per layer, in words (for a model card)."""
    (key_heads, key_dim), (value_heads, value_dim) = cache_entry_shapes(config)
    if getattr(config.get_text_config(), "kv_lora_rank", None):
        return f"latent {key_dim} (key slot, shared by every head) + rope key {value_dim} (value slot): multi-head latent attention"
    return f"key {key_heads}×{key_dim} + value {value_heads}×{value_dim}"


FINAL_NORMS = ("norm", "final_layer_norm", "ln_f", "final_layernorm")  # Llama-like, NeoX, GPT-2, Phi


def text_decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The language model's decoder (a vision-language model's vision tower is not part of the cache)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def decoder_layers_name(model: PreTrainedModel) -> str | None:
    """The module name of the text decoder's layer list (e.g. ``model.layers``), or None."""
    layers = getattr(text_decoder(model), "layers", None)
    return next((name for name, module in model.named_modules() if module is layers), None) if layers is not None else None


def final_norm(model: PreTrainedModel) -> torch.nn.Module | None:
    """The base model's final norm before the LM head, or None."""
    base = getattr(model, "base_model", model)
    found = (getattr(base, name, None) for name in FINAL_NORMS)
    return next((module for module in found if isinstance(module, torch.nn.Module)), None)


FLOAT32_READOUT = "_kvscope_float32_readout"  # the LM head's attribute: its float32 weight, keyed by the weight it copies


def install_float32_readout(model: PreTrainedModel) -> None:
    """Make the final norm and the LM head read every decision in float32 whatever dtype the model runs in (idempotent).

    The layers keep the model's dtype; the last hidden state (in that dtype) goes through the final norm and the head in
    float32, so logits and log-probs are not rounded to the dtype's steps (in bfloat16 a logit near 20 moves in steps of
    0.125, and every margin with it). The head keeps a float32 copy of its weight (4 bytes a parameter, made on first use
    and again whenever the weight changes); a float32 model runs exactly as before.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or FLOAT32_READOUT in head.__dict__:
        return
    norm = final_norm(model)
    if norm is not None:
        norm.forward = types.MethodType(_float32_norm_forward, norm)
    head.forward = types.MethodType(_float32_head_forward, head)
    head.__dict__[FLOAT32_READOUT] = None


def _float32_norm_forward(norm: torch.nn.Module, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The norm's own forward on float32 copies of its input and parameters (a float32 norm runs unchanged)."""
    if hidden.dtype == torch.float32 and all(p.dtype == torch.float32 for p in norm.parameters(recurse=False)):
        return type(norm).forward(norm, hidden, *args, **kwargs)
    shadow = copy.copy(norm)  # shares everything but the parameter dict, which holds float32 copies
    shadow._parameters = {name: None if p is None else p.float() for name, p in norm._parameters.items()}
    return type(norm).forward(shadow, hidden.float(), *args, **kwargs)


def _float32_head_forward(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """Logits (..., vocab) float32 of the hidden state in float32, through a float32 copy of the head's weight."""
    weight = head.weight
    if weight.dtype == torch.float32:
        return torch.nn.Linear.forward(head, hidden.float())
    key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
    kept = head.__dict__[FLOAT32_READOUT]
    if kept is None or kept[0] != key:
        kept = head.__dict__[FLOAT32_READOUT] = (key, weight.detach().float())
    bias = None if head.bias is None else head.bias.float()
    return torch.nn.functional.linear(hidden.float(), kept[1], bias)


class CacheUnsupported(KVScopeError):
    """The model's cache is not a per-token K/V in every layer, so entries cannot be read or rewritten."""


def recurrent_layers(model: PreTrainedModel) -> list[int]:
    """Layers whose cache is a running state (Mamba, linear attention) rather than per-token K/V."""
    layers = DynamicCache(config=model.config.get_text_config()).layers
    return [index for index, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def check_per_token_cache(model: PreTrainedModel) -> None:
    """Raise :class:`CacheUnsupported`, naming the layers, for a hybrid with recurrent layers."""
    recurrent = recurrent_layers(model)
    if recurrent:
        raise CacheUnsupported(
            f"{type(model).__name__} is a hybrid: layers {recurrent} keep a recurrent (Mamba / linear-attention) "
            "state that sums up every earlier token at once instead of one K/V entry per token, so no entry of its "
            "cache can be edited, patched, knocked out or moved; reads, appends and the erratum run exactly on its "
            "own cache instead (kvscope.engine.edit.hybrid: decide and edit)"
        )


def recurrent_forward(model: PreTrainedModel, cache: DynamicCache, input_ids: torch.Tensor, start: int) -> torch.Tensor:
    """Run ``input_ids`` at positions ``start``, ``start + 1``… after a hybrid's own ``cache`` (advanced in place,
    recurrent states included) with the model's own causal attention; next-token logits (T, vocab) float32."""
    install_float32_readout(model)
    positions = torch.arange(start, start + len(input_ids), device=input_ids.device)
    with torch.no_grad():
        output = model(input_ids=input_ids[None], position_ids=positions[None], cache=cache, use_cache=True)
    return output.logits[0].float()


def recurrent_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache of the model's own layer kinds (running states for recurrent layers, K/V for attention)."""
    return DynamicCache(config=model.config.get_text_config())


def install(model: PreTrainedModel) -> None:
    """Route the model's attention through KVScope's function and read its decisions in float32
    (:func:`install_float32_readout`); idempotent; keeps SDPA where it was used."""
    if model.config._attn_implementation == ATTENTION_NAME:
        return
    check_per_token_cache(model)
    install_float32_readout(model)
    _register_attention()
    original = model.config._attn_implementation or "eager"
    sub_configs = (getattr(model.config, name, None) for name in getattr(model.config, "sub_configs", {}))
    for config in (model.config, *(sub for sub in sub_configs if sub is not None)):
        config._kvscope_use_sdpa = original == "sdpa"  # every sub-model (text, vision) reads its own config
        setattr(config, _ORIGINAL_IMPLEMENTATION, original)
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        raise RuntimeError(f"{type(model).__name__} cannot route attention through a custom function")


def _token_inputs(
    input_ids: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor | None, inputs_embeds: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The model's token and position keywords for one sequence: ids or embeddings (pictures), 1-D or M-RoPE positions."""
    tokens = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
    return tokens | {"position_ids": positions[None] if rope_positions is None else rope_positions[:, None]}


def dynamic_cache(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` holding per-layer keys and values (1, kv_heads, N, head_dim), entry i at position i."""
    return DynamicCache(ddp_cache_data=list(zip(keys, values)))


@dataclass
class ForwardResult:
    """What one forward produced: logits kept, the new tokens' K/V per layer, captured attentions."""

    logits: torch.Tensor  # (T_kept, vocab) float32
    new_keys: list[torch.Tensor]  # per layer (1, kv_heads, Q, head_dim)
    new_values: list[torch.Tensor]
    attentions: dict[int, torch.Tensor]  # layer -> (heads, Q, K_total)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per layer (Q, hidden), when asked


def forward(
    model: PreTrainedModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    key_positions: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    allowed: torch.Tensor,
    *,
    blocked: dict[int, torch.Tensor] | None = None,
    capture_rows: torch.Tensor | None = None,
    logit_rows: torch.Tensor | None = None,
    hidden_states: bool = False,
    grad: bool = False,
    rope_positions: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    rescale: RescalePlan | None = None,
) -> ForwardResult:
    """Run ``input_ids`` at ``positions`` over stored K/V; ``allowed`` (Q, N + Q) says which stored entries
    and which of the new tokens each query sees (the caller makes it causal).

    ``blocked[layer]`` is a (H or 1, Q, N + Q) bool tensor of extra keys hidden from the queries in that
    layer (knockouts); it never touches the stored tensors. Logits are kept for ``logit_rows`` only (none
    when not given), attention probabilities for ``capture_rows``. Nothing passed in is modified. With ``grad``
    the forward is differentiable (e.g. with respect to stored K/V that require grad). M-RoPE models take (3, Q)
    ``rope_positions`` (the mask still follows ``positions``); ``inputs_embeds`` (Q, hidden) replaces the token
    embeddings where images are fed. ``rescale`` reads its columns (stored entries) through APE's attention in its rows.
    """
    install(model)
    device = input_ids.device
    plan = ForwardPlan(
        allowed=allowed,
        query_positions=positions,
        key_positions=torch.cat([key_positions, positions]),
        blocked=dict(blocked or {}),
        capture_rows=capture_rows,
        use_sdpa=model.config._kvscope_use_sdpa,
        rescale=rescale.restricted(allowed) if rescale is not None else None,
    )
    cache = dynamic_cache(keys, values) if len(key_positions) else DynamicCache()
    kept = logit_rows if logit_rows is not None else torch.zeros(0, dtype=torch.long, device=device)
    token = _ACTIVE_PLAN.set(plan)
    try:
        with torch.set_grad_enabled(grad):
            output = model(
                **_token_inputs(input_ids, positions, rope_positions, inputs_embeds),
                attention_mask=plan.mask_for(-1, None, model.dtype),
                cache=cache,
                use_cache=True,
                logits_to_keep=kept,
                output_hidden_states=hidden_states,
            )
    finally:
        _ACTIVE_PLAN.reset(token)
    stored = len(key_positions)
    return ForwardResult(
        logits=output.logits[0].float(),
        new_keys=[layer.keys[:, :, stored:] for layer in cache.layers],
        new_values=[layer.values[:, :, stored:] for layer in cache.layers],
        attentions=plan.attentions,
        hidden_states=tuple(h[0] for h in output.hidden_states) if hidden_states else None,
    )


def prefill_layer_kv(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    layer: int,
    rope_positions: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (RoPE applied) and values that a causal prefill of ``input_ids`` at ``positions`` caches at
    ``layer``, (1, kv_heads, T, head_dim) each, running only the layers up to it (CacheBlend's cheap check of
    which reused entries deviate from a fresh prefill); ``rope_positions`` and ``inputs_embeds`` as in :func:`forward`."""
    layers = model.config.get_text_config().num_hidden_layers
    if not 0 <= layer < layers:
        raise KVScopeError(f"layer {layer} is outside the model's {layers} layers")
    install(model)
    count = len(input_ids)
    plan = ForwardPlan(
        allowed=torch.ones(count, count, dtype=torch.bool, device=input_ids.device).tril(),
        query_positions=positions,
        key_positions=positions,
        use_sdpa=model.config._kvscope_use_sdpa,
        stop_layer=layer,
    )
    cache = DynamicCache()
    token = _ACTIVE_PLAN.set(plan)
    try:
        with torch.no_grad():
            model(
                **_token_inputs(input_ids, positions, rope_positions, inputs_embeds),
                attention_mask=plan.mask_for(-1, None, model.dtype),
                cache=cache,
                use_cache=True,
                logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
            )
    except _StoppedEarly:
        return cache.layers[layer].keys, cache.layers[layer].values
    finally:
        _ACTIVE_PLAN.reset(token)
    raise KVScopeError(f"{type(model).__name__} never reached layer {layer}'s attention")
