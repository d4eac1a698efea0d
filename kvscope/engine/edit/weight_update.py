"""What every weight edit shares: a private copy of the modules it touches, the decision-margin objective and the
optimiser loop that trains towards the oracle's margin (:mod:`kvscope.engine.edit.lora`, :mod:`kvscope.engine.edit.rome`).

The model is shared, so no method writes into it: an edit runs on a *private copy* of the touched modules (the module
tree is copied along the path to each touched module; every other parameter is shared, read-only), so an edit that
fails half-way leaves nothing behind.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvscope.engine.cache.adapter import decoder_layers_name, install_float32_readout
from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.cache.decision import answer_logprob, decision_margin, label_scores
from kvscope.engine.cache.loaded import LoadedModel, ModelFingerprint
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.errors import KVScopeError
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.scenario import RenderedPrompt


class WeightEditError(KVScopeError):
    """A weight edit that cannot apply to this model or these settings; the message says why."""


@dataclass
class WeightEdit:
    """An edited private model and what the edit cost."""

    method: str
    lm: LoadedModel
    edit_ms: float
    setup_ms: float
    memory_bytes: int
    details: dict = field(default_factory=dict)


def private_copy(model: torch.nn.Module, module_names: Sequence[str]) -> torch.nn.Module:
    """A model whose module tree is copied along the paths to ``module_names`` (children maps and hooks
    included); every parameter and every other module stays shared. Replacing a named module in the copy
    never touches ``model``."""

    def shallow(module: torch.nn.Module) -> torch.nn.Module:
        clone = copy.copy(module)
        for attribute in ("_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            setattr(clone, attribute, OrderedDict(getattr(module, attribute)))
        return clone

    root = shallow(model)
    copied = {"": root}
    for name in module_names:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            path = ".".join(parts[:depth])
            if path not in copied:
                parent = copied[".".join(parts[: depth - 1])]
                copied[path] = shallow(parent._modules[parts[depth - 1]])
                parent._modules[parts[depth - 1]] = copied[path]
    return root


def set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    model.get_submodule(parent_name)._modules[child] = module


def edited_lm(lm: LoadedModel, model: torch.nn.Module, tag: str) -> LoadedModel:
    """The loaded model with ``model`` in its place and a fingerprint of its own (no block mixes them)."""
    fingerprint = ModelFingerprint(name=f"{lm.fingerprint.name}+{tag}", config_hash=lm.fingerprint.config_hash, dtype=lm.fingerprint.dtype)
    return replace(lm, name=fingerprint.name, model=model, fingerprint=fingerprint)


def decision_margin_of(model: torch.nn.Module, prompt: RenderedPrompt) -> torch.Tensor:
    """The decision margin of ``prompt`` by a plain forward (differentiable when grad is on): every answer
    string is a row of one batch after the shared context and question; read in float32 as every decision is."""
    install_float32_readout(model)
    base = list(prompt.context_ids) + list(prompt.decode_ids)
    strings = [(label, list(ids)) for label, options in prompt.answer_ids.items() for ids in options]
    longest = max(len(ids) for _, ids in strings)
    device = next(model.parameters()).device
    batch = torch.tensor([base + ids + [ids[-1]] * (longest - len(ids)) for _, ids in strings], device=device)
    with compute_slot(len(base) + longest):
        logits = model(input_ids=batch, logits_to_keep=longest + 1).logits  # rows: last question token onwards
    per_string = [answer_logprob(logits[row], range(len(ids)), ids) for row, (_, ids) in enumerate(strings)]
    scores = [
        label_scores(torch.stack([per_string[i] for i, (label, _) in enumerate(strings) if label == name])) for name in prompt.answer_ids
    ]
    return decision_margin(torch.stack(scores))


def edit_direction(experiment: EditExperiment) -> float:
    gap = experiment.oracle.decision.margin - experiment.stale.decision.margin
    if abs(gap) < 1e-6:
        raise WeightEditError(f"the old and new values of {experiment.field!r} give the same margin: there is no decision to edit")
    return 1.0 if gap > 0 else -1.0


def train_until(
    model: torch.nn.Module,
    parameters: list[torch.Tensor],
    experiment: EditExperiment,
    steps: int,
    lr: float,
    progress: StepProgress,
    weight_decay: float = 0.0,
) -> dict:
    """Adam on ``parameters`` (of ``model``, a private copy) pushing the stale prompt's margin towards the oracle's,
    until it reaches it or ``steps`` run out."""
    direction, prompt, target = edit_direction(experiment), experiment.stale.prompt, experiment.oracle.decision.margin
    optimiser = torch.optim.Adam(parameters, lr=lr, weight_decay=weight_decay)
    tick = ticker(progress, steps)
    margins = []
    for _ in range(steps):
        with torch.enable_grad():
            margin = decision_margin_of(model, prompt)
            margins.append(float(margin.detach()))
            if direction * (margins[-1] - target) >= 0:
                break
            (-direction * margin).backward()
        optimiser.step()
        optimiser.zero_grad()
        tick()
    return {"steps": len(margins), "margins": [round(m, 4) for m in margins]}


def decoder_prefix(model: torch.nn.Module) -> str:
    """The module name of the text decoder's layer list (e.g. ``model.layers``)."""
    name = decoder_layers_name(model)
    if name is not None:
        return name
    raise WeightEditError(f"{type(model).__name__} has no decoder layer list to edit")
