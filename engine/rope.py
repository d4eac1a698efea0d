"""Re-rotating cached keys to new positions with the model's own rotary module.

HF caches keys *after* RoPE. A rotation is additive in angle, so moving a key from position s to t is one
more rotation by (t − s) — values carry no position and never change. This module:

- finds the model's rotary module and *refuses* what a plain delta rotation gets wrong (no RoPE at all,
  length-dependent frequencies such as dynamic NTK / LongRoPE, multi-axis M-RoPE, per-layer-type bases);
- reads the channel layout (half-split as in Llama/NeoX, or interleaved as in GPT-J) and the rotary
  width (partial rotary) from the model's own cos/sin tables;
- rotates in float32 with *unscaled* angles: YaRN multiplies cos/sin by ``attention_scaling``, and
  un-rotating/re-rotating with those tables would scale keys by its square.

Whether it is right for a given model is checked numerically by ``engine.selftest``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.errors import KVScopeError

_LENGTH_DEPENDENT = {"dynamic", "longrope"}


class RopeUnsupported(KVScopeError):
    """Keys of this model cannot be moved to other positions by a delta rotation."""


def _rotary_module(model: PreTrainedModel) -> torch.nn.Module:
    """The model's single rotary embedding module, or a refusal that says why."""
    name = type(model).__name__
    rotaries = [m for m in model.modules() if hasattr(m, "inv_freq") and callable(getattr(m, "forward", None))]
    if not rotaries:
        raise RopeUnsupported(
            f"{name} has no rotary position embedding (positions are learned or absolute): "
            "its keys cannot be re-rotated, so splicing and length-changing edits are refused"
        )
    if len({id(m) for m in rotaries}) > 1 or "layer_type" in inspect.signature(rotaries[0].forward).parameters:
        raise RopeUnsupported(f"{name} uses several rotary bases (per layer type); re-rotation is not supported")
    return rotaries[0]


def _rope_types(model: PreTrainedModel) -> set[str]:
    params = getattr(model.config, "rope_parameters", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    tables = nested or [params]
    return {str(t.get("rope_type", t.get("type", "default"))) for t in tables if isinstance(t, dict)}


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding, ready to rotate cached keys by position deltas."""

    module: torch.nn.Module
    rotary_dim: int
    interleaved: bool
    attention_scaling: float

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
        params = getattr(model.config, "rope_parameters", None) or {}
        if isinstance(params, dict) and "mrope_section" in params:
            raise RopeUnsupported(f"{name} uses multi-axis M-RoPE positions; re-rotation is not supported")
        module = _rotary_module(model)
        probe = torch.ones(1, dtype=torch.float32, device=module.inv_freq.device)
        cos, _ = module(probe, torch.tensor([[1]], device=probe.device))
        cos = cos[0, 0].float()
        half = cos.shape[-1] // 2
        interleaved = not torch.allclose(cos[:half], cos[half:]) and torch.allclose(cos[0::2], cos[1::2])
        return cls(
            module=module,
            rotary_dim=int(cos.shape[-1]),
            interleaved=bool(interleaved),
            attention_scaling=float(getattr(module, "attention_scaling", 1.0)),
        )

    def _cos_sin(self, deltas: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Unscaled cos/sin tables (N, rotary_dim) in float32 for integer position deltas."""
        probe = torch.ones(1, dtype=torch.float32, device=device)
        cos, sin = self.module(probe, deltas.to(device)[None])
        return cos[0].float() / self.attention_scaling, sin[0].float() / self.attention_scaling

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        """Move keys (B, kv_heads, N, head_dim) by per-token position deltas (N,); returns a new tensor."""
        cos, sin = self._cos_sin(deltas, keys.device)  # (N, rotary_dim)
        rotated, passthrough = keys.float().split((self.rotary_dim, keys.shape[-1] - self.rotary_dim), dim=-1)
        rotated = rotated * cos + self._rotate_half(rotated) * sin
        return torch.cat((rotated, passthrough), dim=-1).to(keys.dtype)
