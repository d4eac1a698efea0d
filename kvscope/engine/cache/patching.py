"""Effects of patching one run's K/V into another, per (layer, position): exact and by attribution.

Exact patching copies the donor's K/V at some (layer, position) entries into the base notebook and re-reads
the decision: one read per entry set. Attribution patching estimates every entry at once from a single
backward pass — effect ≈ (kv_donor − kv_base) · ∂score/∂kv at the base cache — which is exact where the
score is linear in the patched K/V and usually ranks the large entries right. CacheBlend-style *deviation*
(‖kv_donor − kv_base‖) is the cheap alternative ranking that ignores what the decision reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.cache.notebook import Notebook, NotebookError
from kvscope.engine.cache.reading import decision_score, with_grad
from kvscope.engine.scenario import RenderedPrompt


@dataclass
class EffectMap:
    """Patch effects on the decision margin, (layers, positions), for the listed positions."""

    effects: torch.Tensor  # (layers, P) Δmargin if donor K/V were patched at (layer, position)
    positions: list[int]
    base_margin: float
    method: str  # "attribution" | "exact" | "deviation"

    def per_position(self) -> torch.Tensor:
        """Effect of patching all layers of each position (sum over layers)."""
        return self.effects.sum(0)

    def top_positions(self, k: int, direction: float = 1.0) -> list[int]:
        """The k positions whose patch moves the margin most in ``direction``'s sign."""
        if k > len(self.positions):
            raise NotebookError(f"K={k} is larger than the {len(self.positions)} candidate positions")
        scores = self.per_position() * (1.0 if direction >= 0 else -1.0)
        return [self.positions[i] for i in scores.topk(k).indices.tolist()]

    def top_entries(self, k: int, direction: float = 1.0) -> list[tuple[int, int]]:
        """The k (layer, position) entries with the largest effect in ``direction``'s sign."""
        scores = (self.effects * (1.0 if direction >= 0 else -1.0)).flatten()
        width = len(self.positions)
        return [(i // width, self.positions[i % width]) for i in scores.topk(min(k, scores.numel())).indices.tolist()]


def _aligned(base: Notebook, donor: Notebook, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    if donor.lm.fingerprint != base.lm.fingerprint:
        raise NotebookError("the donor notebook comes from another model or dtype")
    return base.entries_at(positions).to(base.lm.device), donor.entries_at(positions).to(base.lm.device)


@dataclass(frozen=True)
class DecisionGradients:
    """∂margin/∂K and ∂margin/∂V at every entry of one notebook (one backward pass; reusable for any donor)."""

    margin: float
    keys: tuple[torch.Tensor, ...]  # per layer, like the notebook's keys
    values: tuple[torch.Tensor, ...]


def decision_gradients(base: Notebook, prompt: RenderedPrompt) -> DecisionGradients:
    """Gradients of the decision margin with respect to the base notebook's K/V."""
    leaf = with_grad(base)
    score = decision_score(leaf, prompt.decode_ids, prompt.answer_ids)
    with compute_slot():
        score.backward()
    return DecisionGradients(float(score.detach()), tuple(k.grad for k in leaf.keys), tuple(v.grad for v in leaf.values))


def attribution_effects(
    base: Notebook, donor: Notebook, prompt: RenderedPrompt, positions: Sequence[int], gradients: DecisionGradients | None = None
) -> EffectMap:
    """Estimate every (layer, position) patch effect with one backward pass (attribution patching);
    ``gradients`` of the base notebook, when already computed, make it free."""
    mine, theirs = _aligned(base, donor, positions)
    gradients = gradients or decision_gradients(base, prompt)
    if gradients.keys[0].shape[2] != len(base.positions):
        raise NotebookError(
            f"the gradients cover {gradients.keys[0].shape[2]} entries, the base notebook {len(base.positions)}: "
            "they were computed for another notebook"
        )
    effects = []
    for key, value, key_grad, value_grad, donor_key, donor_value in zip(
        base.keys, base.values, gradients.keys, gradients.values, donor.keys, donor.values
    ):
        delta_key = donor_key.index_select(2, theirs).float() - key.index_select(2, mine).float()
        delta_value = donor_value.index_select(2, theirs).float() - value.index_select(2, mine).float()
        effect = delta_key * key_grad.index_select(2, mine).float() + delta_value * value_grad.index_select(2, mine).float()
        effects.append(effect.sum(dim=(0, 1, 3)))  # (P,)
    return EffectMap(torch.stack(effects).detach().cpu(), list(positions), gradients.margin, "attribution")


def exact_effects(
    base: Notebook, donor: Notebook, prompt: RenderedPrompt, positions: Sequence[int], per_layer: bool = False, progress=None
) -> EffectMap:
    """Exact patch effects: all layers per position, or each (layer, position) when ``per_layer``."""
    _aligned(base, donor, positions)
    base_margin = base.read_prompt(prompt).margin
    layers = range(len(base.keys)) if per_layer else [None]
    effects = torch.zeros(len(base.keys) if per_layer else 1, len(positions))
    total, done = len(layers) * len(positions), 0
    for row, layer in enumerate(layers):
        for column, position in enumerate(positions):
            patched = base.patch(donor, [position], None if layer is None else [layer])
            effects[row, column] = patched.read_prompt(prompt).margin - base_margin
            done += 1
            if progress:
                progress(done, total)
    return EffectMap(effects, list(positions), base_margin, "exact")


@dataclass(frozen=True)
class KVDistance:
    """Per layer (kv heads, positions): ‖Δk‖ + ‖Δv‖ between two notebooks' entries at the same positions, and
    ‖k‖ + ‖v‖ of each side."""

    delta: tuple[torch.Tensor, ...]
    base_norm: tuple[torch.Tensor, ...]
    other_norm: tuple[torch.Tensor, ...]


def entry_distance(keys: torch.Tensor, values: torch.Tensor, other_keys: torch.Tensor, other_values: torch.Tensor) -> torch.Tensor:
    """The one K/V distance: ‖Δk‖ + ‖Δv‖ per head and entry (float32) between two (heads, N, head_dim) sets."""
    return (other_keys.float() - keys.float()).norm(dim=-1) + (other_values.float() - values.float()).norm(dim=-1)


def kv_distance(base: Notebook, other: Notebook, positions: Sequence[int]) -> KVDistance:
    """The one K/V comparison of two notebooks: per-head distances and norms at ``positions`` (float32)."""
    mine, theirs = _aligned(base, other, positions)
    delta, base_norm, other_norm = [], [], []
    for key, value, other_key, other_value in zip(base.keys, base.values, other.keys, other.values):
        own_key, own_value = key.index_select(2, mine).float()[0], value.index_select(2, mine).float()[0]
        far_key, far_value = other_key.index_select(2, theirs).float()[0], other_value.index_select(2, theirs).float()[0]
        delta.append(entry_distance(own_key, own_value, far_key, far_value))
        base_norm.append(own_key.norm(dim=-1) + own_value.norm(dim=-1))
        other_norm.append(far_key.norm(dim=-1) + far_value.norm(dim=-1))
    return KVDistance(tuple(delta), tuple(base_norm), tuple(other_norm))


def kv_deviation(base: Notebook, donor: Notebook, positions: Sequence[int]) -> EffectMap:
    """CacheBlend-style ‖kv_donor − kv_base‖ per (layer, position), each layer scaled by its mean norm."""
    distance = kv_distance(base, donor, positions)
    rows = [delta.sum(0) / norm.mean().clamp_min(1e-6) for delta, norm in zip(distance.delta, distance.base_norm)]
    return EffectMap(torch.stack(rows).cpu(), list(positions), float("nan"), "deviation")


def kv_relative_deviation(notebook: Notebook, reference: Notebook) -> torch.Tensor:
    """(layers, context tokens) ‖Δk‖+‖Δv‖ over ‖k‖+‖v‖ of the reference, averaged over heads, in reading order."""
    distance = kv_distance(notebook, reference, reference.visible_positions())
    rows = [(delta / norm.clamp_min(1e-6)).mean(0) for delta, norm in zip(distance.delta, distance.other_norm)]
    return torch.stack(rows).cpu()
