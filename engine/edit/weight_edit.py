"""Weight editing beside cache editing: ROME and LoRA against the erratum, on one field change.

Each weight method makes the model give the *new-value* decision for the scenario's *old-value* context:

- **LoRA** (``peft``): a rank-r adapter on the named linear modules of the text decoder, trained on the
  old-value context with the new decision as target (loss: −margin towards the oracle), stopping once the
  margin reaches the oracle's or the steps run out.
- **ROME-style** rank-one update of one MLP down-projection: the key k* is the projection's input at the
  field's last token; a value shift δ at that token is optimised until the decision flips; then
  W' = W + δ · (C⁻¹k*)ᵀ / (k*ᵀC⁻¹k*), with C the second moment of the projection's inputs over a bundled
  corpus (``demos/corpus/rome_keys.txt``, a few thousand tokens: a small corpus makes C approximate, so it is
  ridge-regularised). The layer is the MLP just before the notes map's strongest layer for the field (its K/V
  there are written from that MLP's output), or the user's.

The model is shared, so no method writes into it: an edit runs on a *private copy* of the touched modules
(the module tree is copied along the path to each touched module; every other parameter is shared, read-only),
so an edit that fails half-way leaves nothing behind. :func:`compare_edits` measures, in one run, each method's
efficacy (recovery on the edited request), contamination (other requests that carry the old value — the same
case for other customers — now decided the new way), collateral (other bundled scenarios whose decision or
margin moves), latency and memory; ``field_erratum`` is measured the same way (its erratum lives only in the
edited request's cache).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
from peft import LoraConfig, inject_adapter_in_model

from engine.cache.adapter import cache_entry_shapes, decoder_layers_name
from engine.cache.budget import compute_slot
from engine.cache.decision import (
    answer_logprob,
    decision_margin,
    label_scores,
    recovery,
)
from engine.cache.loaded import LoadedModel, ModelFingerprint
from engine.edit.experiment import EditExperiment
from engine.edit.runs import run_scenario
from engine.errors import KVScopeError
from engine.progress import StepProgress, ticker
from engine.scenario import DEMOS, RenderedPrompt, Scenario
from engine.timing import Stopwatch

CORPUS = DEMOS / "corpus" / "rome_keys.txt"
METHODS: tuple[str, ...] = ("rome", "lora", "field_erratum")
# Other customers of the same case: the contamination probes prefix the context with one of these lines.
CASE_LINES: tuple[str, ...] = (
    "Case reference: C-2291 (account of Maria Lopez)",
    "Case reference: C-4410 (account of Kenji Sato)",
    "Case reference: C-7813 (account of Amara Okafor)",
)


class WeightEditError(KVScopeError):
    """A weight edit that cannot apply to this model or these settings; the message says why."""


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapter: rank, optimisation steps, learning rate, and the linear modules it wraps (by name)."""

    rank: int = 8
    steps: int = 30
    lr: float = 5e-4
    modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")


@dataclass(frozen=True)
class RomeSettings:
    """ROME: the MLP layer (None: from the notes map), δ optimisation steps and rate, ridge of C, corpus size."""

    layer: int | None = None
    steps: int = 25
    lr: float = 0.5
    weight_decay: float = 1e-3
    ridge: float = 1e-2
    corpus_tokens: int = 3072


@dataclass
class WeightEdit:
    """An edited private model and what the edit cost."""

    method: str
    lm: LoadedModel
    edit_ms: float
    setup_ms: float
    memory_bytes: int
    details: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ private copies
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


def _set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    model.get_submodule(parent_name)._modules[child] = module


def _edited_lm(lm: LoadedModel, model: torch.nn.Module, tag: str) -> LoadedModel:
    """The loaded model with ``model`` in its place and a fingerprint of its own (no block mixes them)."""
    fingerprint = ModelFingerprint(name=f"{lm.fingerprint.name}+{tag}", config_hash=lm.fingerprint.config_hash, dtype=lm.fingerprint.dtype)
    return replace(lm, name=fingerprint.name, model=model, fingerprint=fingerprint)


# ------------------------------------------------------------------------------------------ the objective
def decision_margin_of(model: torch.nn.Module, prompt: RenderedPrompt) -> torch.Tensor:
    """The decision margin of ``prompt`` by a plain forward (differentiable when grad is on): every answer
    string is a row of one batch after the shared context and question."""
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


def _direction(experiment: EditExperiment) -> float:
    gap = experiment.oracle.decision.margin - experiment.stale.decision.margin
    if abs(gap) < 1e-6:
        raise WeightEditError(f"the old and new values of {experiment.field!r} give the same margin: there is no decision to edit")
    return 1.0 if gap > 0 else -1.0


def _train(
    parameters: list[torch.Tensor],
    loss_and_margin,
    steps: int,
    lr: float,
    target: float,
    direction: float,
    progress: StepProgress,
    weight_decay: float = 0.0,
) -> dict:
    """Adam on ``parameters`` until the margin reaches ``target`` (in ``direction``) or ``steps`` run out."""
    optimiser = torch.optim.Adam(parameters, lr=lr, weight_decay=weight_decay)
    tick = ticker(progress, steps)
    margins = []
    for _ in range(steps):
        with torch.enable_grad():
            loss, margin = loss_and_margin()
            margins.append(float(margin))
            if direction * (margins[-1] - target) >= 0:
                break
            loss.backward()
        optimiser.step()
        optimiser.zero_grad()
        tick()
    return {"steps": len(margins), "margins": [round(m, 4) for m in margins]}


# ------------------------------------------------------------------------------------------ LoRA
def lora_edit(
    lm: LoadedModel, experiment: EditExperiment, settings: LoraSettings = LoraSettings(), progress: StepProgress = None
) -> WeightEdit:
    """Train a LoRA adapter on a private copy until the old-value context gets the new decision."""
    watch = Stopwatch()
    decoder_prefix = _decoder_prefix(lm.model)
    targets = [
        name
        for name, module in lm.model.named_modules()
        if name.startswith(decoder_prefix) and name.rsplit(".", 1)[-1] in settings.modules and isinstance(module, torch.nn.Linear)
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
    direction, prompt = _direction(experiment), experiment.stale.prompt

    def objective() -> tuple[torch.Tensor, torch.Tensor]:
        margin = decision_margin_of(private, prompt)
        return -direction * margin, margin.detach()

    trace = _train(adapter, objective, settings.steps, settings.lr, experiment.oracle.decision.margin, direction, progress)
    for parameter in adapter:
        parameter.requires_grad_(False)
    return WeightEdit(
        method="lora",
        lm=_edited_lm(lm, private, "lora"),
        edit_ms=round(watch.ms, 1),
        setup_ms=0.0,
        memory_bytes=sum(p.numel() * p.element_size() for p in adapter),
        details={**asdict(settings), **trace, "wrapped_modules": len(targets)},
    )


# ------------------------------------------------------------------------------------------ ROME
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


def _decoder_prefix(model: torch.nn.Module) -> str:
    """The module name of the text decoder's layer list (e.g. ``model.layers``)."""
    name = decoder_layers_name(model)
    if name is not None:
        return name
    raise WeightEditError(f"{type(model).__name__} has no decoder layer list to edit")


def down_projection(lm: LoadedModel, layer: int) -> str:
    """The name of layer ``layer``'s MLP down-projection (a dense Linear from the MLP width to the hidden size)."""
    prefix = _decoder_prefix(lm.model)
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
    per_layer = effects.effects[:, columns].sum(1) * _direction(experiment)
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
    _set_module(private, name, recorder)
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
    _set_module(private, name, shifted)
    direction, prompt = _direction(experiment), experiment.stale.prompt

    def objective() -> tuple[torch.Tensor, torch.Tensor]:
        margin = decision_margin_of(private, prompt)
        return -direction * margin, margin.detach()

    trace = _train(
        [shifted.shift],
        objective,
        settings.steps,
        settings.lr,
        experiment.oracle.decision.margin,
        direction,
        progress,
        weight_decay=settings.weight_decay,
    )
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
    _set_module(private, name, edited)
    return WeightEdit(
        method="rome",
        lm=_edited_lm(lm, private, f"rome@{layer}"),
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


# ------------------------------------------------------------------------------------------ comparison
@dataclass(frozen=True)
class MethodOutcome:
    """One method on one edit: efficacy, contamination, collateral, cost."""

    efficacy: float | None
    decision: str
    contamination: float
    contaminated: list[str]
    collateral: float
    collateral_mean_abs_delta: float
    edit_ms: float
    setup_ms: float
    memory_bytes: int
    details: dict


@dataclass(frozen=True)
class WeightEditReport:
    """Every method on one field change of one scenario, measured in one run."""

    model: str
    scenario: str
    field: str
    old: str
    new: str
    stale: dict
    oracle: dict
    probes: dict
    methods: dict[str, MethodOutcome]

    def as_dict(self) -> dict:
        return asdict(self)


def case_variants(scenario: Scenario) -> list[Scenario]:
    """The same case for other customers: the context prefixed by another case line (old values kept)."""
    return [replace(scenario, name=f"{scenario.name} ({line})", context=f"{line}\n{scenario.context}") for line in CASE_LINES]


def _reads(lm: LoadedModel, scenarios: Sequence[Scenario]) -> list[tuple[str, float]]:
    """(label, margin) of each scenario at its old values."""
    return [(run.decision.label, run.decision.margin) for run in (run_scenario(lm, s) for s in scenarios)]


def _measure(
    experiment: EditExperiment,
    lm: LoadedModel,
    variants: Sequence[Scenario],
    others: Sequence[Scenario],
    baseline_variants: list,
    baseline_others: list,
) -> dict:
    """Efficacy, contamination and collateral of reading with ``lm`` (the shared model for the erratum)."""
    state = run_scenario(lm, experiment.scenario).decision if lm is not experiment.lm else None
    edited = _reads(lm, variants)
    new_label = experiment.oracle.decision.label
    contaminated = [v.name for v, (label, _), (before, _) in zip(variants, edited, baseline_variants) if label == new_label != before]
    after = _reads(lm, others)
    changed = [o.name for o, (label, _), (before, _) in zip(others, after, baseline_others) if label != before]
    deltas = [abs(margin - before) for (_, margin), (_, before) in zip(after, baseline_others)]
    return {
        "state": state,
        "contamination": len(contaminated) / max(len(variants), 1),
        "contaminated": contaminated,
        "collateral": len(changed) / max(len(others), 1),
        "collateral_mean_abs_delta": sum(deltas) / max(len(deltas), 1),
        "collateral_changed": changed,
    }


def compare_edits(
    lm: LoadedModel,
    scenario: Scenario,
    others: Sequence[Scenario],
    field_name: str | None = None,
    new: str | None = None,
    methods: Sequence[str] = METHODS,
    lora: LoraSettings = LoraSettings(),
    rome: RomeSettings = RomeSettings(),
    progress: StepProgress = None,
) -> WeightEditReport:
    """Edit one field's decision with each method and measure all of them the same way (module docstring).
    ``others`` are unrelated scenarios for collateral (the edited one is left out by name)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise WeightEditError(f"unknown method {unknown[0] if unknown else '(none)'!r}; choose from: {', '.join(METHODS)}")
    experiment = EditExperiment(lm, scenario, field_name, new)
    _direction(experiment)
    others = [o for o in others if o.name != scenario.name]
    variants = case_variants(scenario)
    baseline_variants, baseline_others = _reads(lm, variants), _reads(lm, others)
    outcomes: dict[str, MethodOutcome] = {}
    stale, oracle = experiment.stale.decision.margin, experiment.oracle.decision.margin
    for method in methods:
        if method == "field_erratum":
            result = experiment.run("field_erratum")
            measured = _measure(experiment, lm, variants, others, baseline_variants, baseline_others)
            entry = (
                sum(h * d for h, d in cache_entry_shapes(lm.model.config))
                * lm.dtype.itemsize
                * lm.model.config.get_text_config().num_hidden_layers
            )
            efficacy = result.recovery.value if result.recovery else None
            label = result.decision.label if result.decision else experiment.stale.decision.label
            cost = {
                "edit_ms": round(result.ms, 1),
                "setup_ms": 0.0,
                "memory_bytes": result.tokens_recomputed * entry,
                "details": {"tokens_computed": result.tokens_recomputed},
            }
        else:
            edit = (rome_edit if method == "rome" else lora_edit)(lm, experiment, rome if method == "rome" else lora, progress)
            measured = _measure(experiment, edit.lm, variants, others, baseline_variants, baseline_others)
            efficacy = recovery(measured["state"].margin, stale, oracle).value
            label = measured["state"].label
            cost = {"edit_ms": edit.edit_ms, "setup_ms": edit.setup_ms, "memory_bytes": edit.memory_bytes, "details": edit.details}
        details = {**cost.pop("details"), "collateral_changed": measured["collateral_changed"]}
        outcomes[method] = MethodOutcome(
            efficacy=None if efficacy is None else round(efficacy, 4),
            decision=label,
            contamination=measured["contamination"],
            contaminated=measured["contaminated"],
            collateral=round(measured["collateral"], 4),
            collateral_mean_abs_delta=round(measured["collateral_mean_abs_delta"], 4),
            details=details,
            **cost,
        )
    return WeightEditReport(
        model=lm.fingerprint.name,
        scenario=scenario.name,
        field=experiment.field,
        old=experiment.old,
        new=experiment.new,
        stale={"decision": experiment.stale.decision.label, "margin": round(stale, 4)},
        oracle={"decision": experiment.oracle.decision.label, "margin": round(oracle, 4)},
        probes={
            "variants": [v.name for v in variants],
            "variants_before": [label for label, _ in baseline_variants],
            "others": [o.name for o in others],
        },
        methods=outcomes,
    )
