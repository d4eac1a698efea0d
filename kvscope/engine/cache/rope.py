"""Re-rotating cached keys to new positions with the model's own rotary module.

HF caches keys *after* RoPE. A rotation is additive in angle, so moving a key from position s to t is one
more rotation by (t − s) — what carries no position never changes. This module finds, per layer:

- **which cache slot carries position**: the key slot in most models; in multi-head latent attention
  (DeepSeek-V2/V3) the cache holds the compressed latent (position-free) in the key slot and the decoupled
  rope key in the value slot, so only that slot rotates;
- **which table rotates it**: one shared rotary module, or the module called with the layer's type where
  bases differ per layer type (Gemma-3: local base on sliding layers, global base with scaling on full
  layers); no table on NoPE layers (``use_rope`` false), whose keys carry no position;
- **the channel layout** (half-split as in Llama/NeoX, or interleaved pairs as in GPT-J and the complex
  ``freqs_cis`` tables of DeepSeek-V2/Llama-4) and the rotary width (partial rotary), read from the tables;
- rotation runs in float32 with *unscaled* angles: YaRN-style tables multiply cos/sin by an attention
  scale, and rotating with those would scale keys by it.

It refuses, by name, what a delta rotation gets wrong: no RoPE at all, length-dependent frequencies (dynamic
NTK, LongRoPE), several rotary modules, and absolute-position effects (chunked attention, attention-temperature
tuning): there a block's K/V depend on where it sits, not only on relative distances.
Whether it is right for a given model is checked numerically by ``kvscope.engine.cache.selftest`` and ``kvscope.engine.checks.support``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from kvscope.engine.cache.adapter import text_decoder
from kvscope.engine.errors import KVScopeError

_LENGTH_DEPENDENT = {"dynamic", "longrope"}
KEYS, VALUES = "keys", "values"


class RopeUnsupported(KVScopeError):
    """Keys of this model cannot be moved to other positions by a delta rotation."""


def _rope_types(model: PreTrainedModel) -> set[str]:
    params = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    tables = nested or [params]
    return {str(t.get("rope_type", t.get("type", "default"))) for t in tables if isinstance(t, dict)}


def _rotary_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """Modules of the text decoder holding inverse frequencies (``inv_freq`` or per layer type ``<type>_inv_freq``)."""
    return [
        module
        for module in text_decoder(model).modules()
        if callable(getattr(module, "forward", None))
        and any(
            name == "inv_freq" or name.endswith("_inv_freq") and "original" not in name for name, _ in module.named_buffers(recurse=False)
        )
    ]


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """One attention module per decoder layer, in layer order."""
    found = {}
    for module in text_decoder(model).modules():
        index = getattr(module, "layer_idx", None)
        if (
            index is not None
            and hasattr(module, "config")
            and index not in found
            and any(hasattr(module, p) for p in ("q_proj", "q_a_proj", "query_key_value", "qkv_proj", "Wqkv"))
        ):
            found[index] = module
    return [found[i] for i in sorted(found)]


def _absolute_position_effects(model: PreTrainedModel) -> str | None:
    """Why this model's K/V depend on absolute positions (so moving a block changes it), or None."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    if "chunked_attention" in layer_types:
        return f"chunked attention (chunks of {config.attention_chunk_size} tokens at fixed absolute boundaries)"
    if getattr(config, "attn_temperature_tuning", False) and not all(getattr(config, "no_rope_layers", None) or [1]):
        return "attention-temperature tuning on NoPE layers (query scale grows with the absolute position)"
    return None


@dataclass(frozen=True)
class RotaryTable:
    """One rotary table: the module (called with ``layer_type`` where bases differ), width and layout."""

    module: torch.nn.Module
    rotary_dim: int
    interleaved: bool
    layer_type: str | None = None

    @classmethod
    def read(cls, module: torch.nn.Module, layer_type: str | None = None) -> "RotaryTable":
        """Inspect a table at position 1: its width, and whether pairs are adjacent or half-split."""
        cos, _ = _unscaled_tables(module, torch.tensor([1]), layer_type)
        cos = cos[0]
        half = cos.shape[-1] // 2
        interleaved = not torch.allclose(cos[:half], cos[half:]) and torch.allclose(cos[0::2], cos[1::2])
        return cls(module=module, rotary_dim=int(cos.shape[-1]), interleaved=bool(interleaved), layer_type=layer_type)

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)

    def rotate(self, x: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Move a positional slot (B, heads, N, dim) by per-token position deltas (N,); returns a new tensor."""
        cos, sin = _unscaled_tables(self.module, deltas.to(x.device), self.layer_type)
        rotated, passthrough = x.float().split((self.rotary_dim, x.shape[-1] - self.rotary_dim), dim=-1)
        rotated = rotated * cos + self._rotate_half(rotated) * sin
        return torch.cat((rotated, passthrough), dim=-1).to(x.dtype)


def _unscaled_tables(module: torch.nn.Module, positions: torch.Tensor, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (N, rotary_dim) in float32 at integer positions, any attention scaling divided out.

    Tables with one entry per channel pair are widened to one per channel: complex ``freqs_cis`` (DeepSeek-V2,
    Llama-4) pair adjacent channels, real per-pair tables (GPT-OSS) pair the two halves.
    """
    buffers = dict(module.named_buffers(recurse=False))
    inv_freq = buffers.get(f"{layer_type}_inv_freq", buffers.get("inv_freq"))
    probe = torch.ones(1, dtype=torch.float32, device=inv_freq.device)
    extra = {"layer_type": layer_type} if layer_type is not None else {}
    table = module(probe, positions.to(inv_freq.device)[None], **extra)
    if torch.is_tensor(table) and table.is_complex():
        table = table[0]
        cos, sin = table.real.repeat_interleave(2, dim=-1), table.imag.repeat_interleave(2, dim=-1)
    else:
        cos, sin = (t[0].float() for t in table)
        if cos.shape[-1] == inv_freq.numel():
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    scale = torch.hypot(cos, sin)  # the attention scaling, whatever the rope type put there
    return cos / scale, sin / scale


@dataclass(frozen=True)
class Rotary:
    """Where each layer's cache carries position, and the table that moves it (module docstring)."""

    tables: tuple[RotaryTable | None, ...]  # per layer; None: a NoPE layer, nothing there carries position
    slot: str = KEYS  # the cache slot holding rotated keys: "keys", or "values" for multi-head latent attention

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> "Rotary":
        """Inspect the model; raise :class:`RopeUnsupported` with the reason when a delta rotation is wrong."""
        name = type(model).__name__
        length_dependent = _rope_types(model) & _LENGTH_DEPENDENT
        if length_dependent:
            raise RopeUnsupported(
                f"{name} uses {sorted(length_dependent)[0]} RoPE scaling, whose frequencies depend on the "
                "sequence length: a fixed delta rotation would be wrong, so re-rotation is refused"
            )
        absolute = _absolute_position_effects(model)
        if absolute:
            raise RopeUnsupported(f"{name} uses {absolute}: a block's K/V depend on where it sits, so moving it is refused")
        modules = _rotary_modules(model)
        if not modules:
            raise RopeUnsupported(
                f"{name} has no rotary position embedding (positions are learned or absolute): "
                "its keys cannot be re-rotated, so splicing and length-changing edits are refused"
            )
        if len(modules) > 1:
            raise RopeUnsupported(f"{name} has {len(modules)} rotary modules; re-rotation supports one (per-layer types included)")
        module = modules[0]
        attention = _attention_modules(model)
        if not attention:
            raise RopeUnsupported(f"{name}: no attention layers found, so there is no K/V to re-rotate")
        layer_types = getattr(model.config.get_text_config(), "layer_types", None)
        per_type = "layer_type" in inspect.signature(module.forward).parameters
        tables: list[RotaryTable | None] = []
        for layer in attention:
            if not getattr(layer, "use_rope", True):
                tables.append(None)
                continue
            layer_type = layer_types[layer.layer_idx] if per_type else None
            tables.append(RotaryTable.read(module, layer_type))
        latent = hasattr(attention[0], "kv_a_proj_with_mqa")
        return cls(tables=tuple(tables), slot=VALUES if latent else KEYS)

    def rotate(self, tensor: torch.Tensor, deltas: torch.Tensor, layer: int) -> torch.Tensor:
        """Move one layer's positional slot by per-token deltas (returned as is on a NoPE layer)."""
        table = self.tables[layer]
        return tensor if table is None else table.rotate(tensor, deltas)

    def position_free(self, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The per-layer tensors that never change when a token moves (the values, or the latents)."""
        return keys if self.slot == VALUES else values

    def move(
        self,
        keys: tuple[torch.Tensor, ...],
        values: tuple[torch.Tensor, ...],
        deltas: torch.Tensor,
        entries: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per-layer keys and values with ``entries`` (default all) moved by ``deltas``; inputs untouched."""

        def moved(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            if entries is None:
                return tuple(self.rotate(t, deltas, layer) for layer, t in enumerate(tensors))
            return tuple(
                t.index_copy(2, entries, self.rotate(t.index_select(2, entries), deltas, layer)) for layer, t in enumerate(tensors)
            )

        if self.slot == VALUES:
            return keys, moved(values)
        return moved(keys), values
