"""LoRA beside the erratum: a rank-r adapter (``peft``) on the named linear modules of the text decoder of a private
copy, trained on the old-value context with the new decision as target (loss: −margin towards the oracle), stopping
once the margin reaches the oracle's or the steps run out."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from peft import LoraConfig, inject_adapter_in_model

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.weight_update import (
    WeightEdit,
    WeightEditError,
    decoder_prefix,
    edited_lm,
    private_copy,
    train_until,
)
from kvscope.engine.progress import StepProgress
from kvscope.engine.timing import Stopwatch


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter: rank, optimisation steps, learning rate, and the linear modules it wraps (by name)."""

    rank: int = 8
    steps: int = 30
    lr: float = 5e-4
    modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")


def lora_edit(
    lm: LoadedModel, experiment: EditExperiment, settings: LoraSettings = LoraSettings(), progress: StepProgress = None
) -> WeightEdit:
    """Train a LoRA adapter on a private copy until the old-value context gets the new decision."""
    watch = Stopwatch()
    layers = decoder_prefix(lm.model)
    targets = [
        name
        for name, module in lm.model.named_modules()
        if name.startswith(layers) and name.rsplit(".", 1)[-1] in settings.modules and isinstance(module, torch.nn.Linear)
    ]
    if not targets:
        raise WeightEditError(f"no linear module named {', '.join(settings.modules)} in {type(lm.model).__name__}'s decoder")
    if settings.rank < 1 or settings.steps < 1 or settings.lr <= 0:
        raise WeightEditError(f"LoRA needs rank ≥ 1, steps ≥ 1 and lr > 0 (got {settings.rank}, {settings.steps}, {settings.lr})")
    private = private_copy(lm.model, targets)
    config = LoraConfig(r=settings.rank, lora_alpha=2 * settings.rank, lora_dropout=0.0, target_modules=targets, bias="none")
    inject_adapter_in_model(config, private)
    adapter = [p for name, p in private.named_parameters() if "lora_" in name]
    for parameter in adapter:
        parameter.requires_grad_(True)
    trace = train_until(private, adapter, experiment, settings.steps, settings.lr, progress)
    for parameter in adapter:
        parameter.requires_grad_(False)
    return WeightEdit(
        method="lora",
        lm=edited_lm(lm, private, "lora"),
        edit_ms=round(watch.ms, 1),
        setup_ms=0.0,
        memory_bytes=sum(p.numel() * p.element_size() for p in adapter),
        details={**asdict(settings), **trace, "wrapped_modules": len(targets)},
    )
