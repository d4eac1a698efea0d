"""ROME-style rank-one update of one MLP down-projection, beside the erratum.

The key k* is the projection's input at the field's last token; a value shift δ at that token is optimised until the
decision flips; then W' = W + δ · (C⁻¹k*)ᵀ / (k*ᵀC⁻¹k*), with C the second moment of the projection's inputs over a
bundled corpus (``demos/corpus/rome_keys.txt``, a few thousand tokens: a small corpus makes C approximate, so it is
ridge-regularised). The layer is the MLP just before the notes map's strongest layer for the field (its K/V there
are written from that MLP's output), or the user's. The update lands in a private copy (:mod:`kvscope.engine.edit.weight_update`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.weight_update import (
    WeightEdit,
    WeightEditError,
    decoder_prefix,
    edit_direction,
    edited_lm,
    private_copy,
    set_module,
    train_until,
)
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.scenario import DEMOS
from kvscope.engine.timing import Stopwatch

CORPUS = DEMOS / "corpus" / "rome_keys.txt"


@dataclass(frozen=True)
class RomeSettings:
    """ROME: the MLP layer (None: from the notes map), δ optimisation steps and rate, ridge of C, corpus size."""

    layer: int | None = None
    steps: int = 25
    lr: float = 0.5
    weight_decay: float = 1e-3
    ridge: float = 1e-2
    corpus_tokens: int = 3072


class _ShiftedProjection(torch.nn.Module):
    """A down-projection that records its input at one row and adds a trainable shift to its output there."""

    def __init__(self, projection: torch.nn.Linear, row: int) -> None:
        super().__init__()
        self.projection, self.row = projection, row
        self.shift = torch.nn.Parameter(torch.zeros(projection.out_features, dtype=torch.float32, device=projection.weight.device))
        self.key: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.projection(x)
        if x.shape[-2] <= self.row:
            return out
        self.key = x[..., self.row, :].detach().float().mean(0) if x.dim() == 3 else x[self.row].detach().float()
        bump = torch.zeros_like(out)
        bump[..., self.row, :] = self.shift.to(out.dtype)
        return out + bump


class _KeyRecorder(torch.nn.Module):
    """A down-projection that accumulates Σ k kᵀ over every input row it sees."""

    def __init__(self, projection: torch.nn.Linear) -> None:
        super().__init__()
        self.projection = projection
        self.moment = torch.zeros(projection.in_features, projection.in_features, dtype=torch.float32, device=projection.weight.device)
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = x.reshape(-1, x.shape[-1]).float()
        self.moment += keys.T @ keys
        self.count += keys.shape[0]
        return self.projection(x)


def down_projection(lm: LoadedModel, layer: int) -> str:
    """The name of layer ``layer``'s MLP down-projection (a dense Linear from the MLP width to the hidden size)."""
    prefix = decoder_prefix(lm.model)
    count = len(lm.model.get_submodule(prefix))
    if not 0 <= layer < count:
        raise WeightEditError(f"layer {layer} does not exist (the decoder has {count} layers)")
    hidden = lm.model.config.get_text_config().hidden_size
    candidates = [
        name
        for name, module in lm.model.get_submodule(f"{prefix}.{layer}").named_modules()
        if isinstance(module, torch.nn.Linear) and module.out_features == hidden and module.in_features > hidden and "mlp" in name
    ]
    if len(candidates) != 1:
        raise WeightEditError(
            f"layer {layer} has no single dense MLP down-projection (found {candidates or 'none'}): ROME needs a dense MLP"
        )
    return f"{prefix}.{layer}.{candidates[0]}"


def strongest_layer(experiment: EditExperiment) -> int:
    """The MLP layer ROME edits: the one just before the layer whose field K/V move the decision most
    towards the oracle (notes map attribution); a third of the way in when the values differ in length."""
    layers = experiment.lm.model.config.get_text_config().num_hidden_layers
    effects = experiment.notes_effects()
    if effects is None:
        return layers // 3
    columns = [effects.positions.index(p) for p in experiment.field_positions]
    per_layer = effects.effects[:, columns].sum(1) * edit_direction(experiment)
    return max(int(per_layer.argmax()) - 1, 0)


_COVARIANCES: OrderedDict[tuple[str, str, int], tuple[torch.Tensor, float, int]] = OrderedDict()
KEPT_COVARIANCES = 2  # each is in_features² floats (95 MB for the embedded model): the latest ones only


def key_moment(lm: LoadedModel, name: str, tokens: int, progress: StepProgress = None) -> tuple[torch.Tensor, float, int]:
    """E[k kᵀ] of the projection's inputs over the bundled corpus (computed once per model, layer and size; the
    latest ``KEPT_COVARIANCES`` kept); returns (moment, ms, tokens used)."""
    key = (lm.fingerprint.name + lm.fingerprint.config_hash + lm.fingerprint.dtype, name, tokens)
    if key in _COVARIANCES:
        _COVARIANCES.move_to_end(key)
        return _COVARIANCES[key]
    watch = Stopwatch()
    ids = lm.tokenizer(CORPUS.read_text(), add_special_tokens=False).input_ids[:tokens]
    recorder = _KeyRecorder(lm.model.get_submodule(name))
    private = private_copy(lm.model, [name])
    set_module(private, name, recorder)
    chunks = [ids[i : i + 512] for i in range(0, len(ids), 512)]
    tick = ticker(progress, len(chunks))
    for chunk in chunks:
        with torch.no_grad(), compute_slot(len(chunk)):
            private(input_ids=torch.tensor([chunk], device=lm.device), logits_to_keep=1)
        tick()
    result = (recorder.moment / max(recorder.count, 1), round(watch.ms, 1), recorder.count)
    _COVARIANCES[key] = result
    while len(_COVARIANCES) > KEPT_COVARIANCES:
        _COVARIANCES.popitem(last=False)
    return result


def rank_one_insert(weight: torch.Tensor, key: torch.Tensor, shift: torch.Tensor, moment: torch.Tensor, ridge: float) -> torch.Tensor:
    """ROME's closed form: W + shift · (C⁻¹k)ᵀ / (kᵀC⁻¹k), so that W'k = Wk + shift while keys that C says
    are typical move least; C is ridge-regularised (``ridge`` × its mean diagonal). Returns a new weight."""
    regularised = moment + ridge * moment.diagonal().mean() * torch.eye(moment.shape[0], device=moment.device)
    solved = torch.linalg.solve(regularised, key.float())
    return (weight.float() + torch.outer(shift.float(), solved / (key.float() @ solved))).to(weight.dtype)


def rome_edit(
    lm: LoadedModel, experiment: EditExperiment, settings: RomeSettings = RomeSettings(), progress: StepProgress = None
) -> WeightEdit:
    """Insert a rank-one update into one MLP down-projection of a private copy (module docstring)."""
    layer = strongest_layer(experiment) if settings.layer is None else settings.layer
    name = down_projection(lm, layer)
    if settings.steps < 1 or settings.lr <= 0 or settings.ridge < 0:
        raise WeightEditError(f"ROME needs steps ≥ 1, lr > 0 and ridge ≥ 0 (got {settings.steps}, {settings.lr}, {settings.ridge})")
    moment, setup_ms, corpus_tokens = key_moment(lm, name, settings.corpus_tokens)
    watch = Stopwatch()
    original: torch.nn.Linear = lm.model.get_submodule(name)
    row = experiment.field_positions[-1]  # a clean prefill stores the context in order: position = row
    shifted = _ShiftedProjection(original, row)
    private = private_copy(lm.model, [name])
    set_module(private, name, shifted)
    trace = train_until(private, [shifted.shift], experiment, settings.steps, settings.lr, progress, settings.weight_decay)
    delta = shifted.shift.detach()
    weight = rank_one_insert(original.weight, shifted.key, delta, moment, settings.ridge)
    update = weight.float() - original.weight.float()
    edited = torch.nn.Linear(
        original.in_features,
        original.out_features,
        bias=original.bias is not None,
        device=original.weight.device,
        dtype=original.weight.dtype,
    )
    edited.weight = torch.nn.Parameter(weight, requires_grad=False)
    if original.bias is not None:
        edited.bias = original.bias
    set_module(private, name, edited)
    return WeightEdit(
        method="rome",
        lm=edited_lm(lm, private, f"rome@{layer}"),
        edit_ms=round(watch.ms, 1),
        setup_ms=setup_ms,
        memory_bytes=edited.weight.numel() * edited.weight.element_size(),
        details={
            **asdict(settings),
            **trace,
            "layer": layer,
            "module": name,
            "corpus_tokens": corpus_tokens,
            "shift_norm": round(float(delta.norm()), 4),
            "update_norm": round(float(update.norm()), 4),
            "covariance_bytes": moment.numel() * moment.element_size(),
        },
    )
