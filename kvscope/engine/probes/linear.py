"""Probe 3, linear decodability: is the conclusion written into downstream tokens before the decision reads it?

For many values of the edited field, one clean forward of context + question gives every layer's residual
stream. Per layer and position group (the field, downstream *aggregators* — punctuation and newlines —,
the other downstream tokens, the decision token) an L2-regularized logistic regression, cross-validated,
decodes (a) the model's own conclusion for that sample and (b) which original value the sample is a
variant of. The *write* layer is the first where the aggregators decode the conclusion with accuracy
≥ 0.9; the *commit* layer is where the logit lens on the decision token settles on the final answer for
good — the first layer from which, at every later layer, most samples *of each conclusion* already show
their final label (per class, so a label the lens favours anyway does not count as committed). The paper
finds write ≈ 0.31–0.39 and commit ≈ 0.73–0.77 relative depth: written before read.

Samples: the field's scenario values (old and new first); when there are fewer than ``min_samples``,
surface variants of them are added round-robin, mildest first — casing (lower, Capitalized, UPPER), then
wrapping ("v", 'v', `v`, (v)), then a trailing period, then their combinations. A variant is dropped when
it repeats another sample's text or does not render (e.g. tokenizes to nothing). Labels come from the
model (a clean prefill and read per sample), not from the scenario's expectations, because a variant
may change what the model concludes.

Costs: per sample a prefill + read (its label) and one hidden-states forward; then
(layers + 1) × 4 groups × 2 targets × folds small logistic fits. Failure mode: when every sample leads to
the same conclusion there is nothing to decode; the result says so instead of reporting 100%.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import product

import torch

from kvscope.engine.cache.adapter import FINAL_NORMS, final_norm
from kvscope.engine.cache.generation import hidden_states
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.runs import render_for
from kvscope.engine.jsonable import JsonFields, attributes, rounded
from kvscope.engine.probes.common import ProbeError
from kvscope.engine.progress import StepProgress, Tick
from kvscope.engine.scenario import RenderedPrompt, ScenarioError, Span, is_aggregator
from kvscope.engine.timing import Stopwatch
from kvscope.engine.words import counted

GROUPS = ("field", "aggregators", "others", "decision")
WRITE_THRESHOLD = 0.9
_CASES: tuple[Callable[[str], str], ...] = (str, str.lower, str.capitalize, str.upper)
_WRAPS = ("{}", '"{}"', "'{}'", "`{}`", "({})")
_ENDINGS = ("", ".")


# ---------------------------------------------------------------------------- samples
def surface_variants(value: str) -> list[str]:
    """Surface forms of ``value`` (itself excluded), mildest first: casing, wrapping, trailing period, combinations."""
    combos = sorted(
        product(range(len(_ENDINGS)), range(len(_WRAPS)), range(len(_CASES))),
        key=lambda combo: (sum(part > 0 for part in combo), combo),
    )
    forms = (_WRAPS[wrap].format(_CASES[case](value)) + _ENDINGS[ending] for ending, wrap, case in combos)
    return [form for form in dict.fromkeys(forms) if form != value]


@dataclass(frozen=True)
class Sample(JsonFields):
    """One probe input: the field's text, the scenario value it varies, the model's conclusion."""

    text: str
    origin: str
    label: str


def render_value(experiment: EditExperiment, value: str) -> RenderedPrompt:
    """The experiment's scenario rendered with the edited field set to ``value``."""
    lm, scenario = experiment.lm, experiment.scenario
    values = scenario.values_with(**{experiment.field: value})
    return render_for(lm, scenario, values)


def _renderable(experiment: EditExperiment, forms: Sequence[str], seen: set[str]) -> Iterator[tuple[str, RenderedPrompt]]:
    """Forms not used yet that render, with their prompts (``seen`` is shared across values and updated)."""
    for form in forms:
        if form in seen:
            continue
        try:
            prompt = render_value(experiment, form)
        except ScenarioError:
            continue
        seen.add(form)
        yield form, prompt


def _round_robin(streams: list[tuple[str, Iterator]]) -> Iterator[tuple[str, tuple]]:
    """(origin, item) taking one item from each stream in turn until all are exhausted."""
    while streams:
        for entry in list(streams):
            item = next(entry[1], None)
            if item is None:
                streams.remove(entry)
            else:
                yield entry[0], item


def probe_inputs(experiment: EditExperiment, min_samples: int) -> list[tuple[str, str, RenderedPrompt]]:
    """(text, origin value, prompt) per sample: every scenario value, then variants round-robin up to ``min_samples``."""
    origins = list(dict.fromkeys([experiment.old, experiment.new, *experiment.scenario.field(experiment.field).values]))
    chosen = [(origin, origin, render_value(experiment, origin)) for origin in origins]
    seen = set(origins)
    streams = [(origin, _renderable(experiment, surface_variants(origin), seen)) for origin in origins]
    for origin, (text, prompt) in _round_robin(streams):
        if len(chosen) >= min_samples:
            break
        chosen.append((text, origin, prompt))
    return chosen


def _conclusion(experiment: EditExperiment, text: str, prompt: RenderedPrompt) -> str:
    """The model's decision label from a clean prefill (the experiment's own runs for old and new)."""
    known = {experiment.old: experiment.stale, experiment.new: experiment.oracle}
    if text in known:
        return known[text].decision.label
    return Notebook.from_prompt(experiment.lm, prompt).read_prompt(prompt, answer_texts=experiment.scenario.answers).label


# ---------------------------------------------------------------------------- positions and features
def position_groups(token_texts: Sequence[str], field_span: Span) -> dict[str, list[int]]:
    """Context positions of the field, of downstream aggregators and of the other downstream tokens."""
    downstream = range(field_span.end, len(token_texts))
    return {
        "field": list(range(field_span.start, field_span.end)),
        "aggregators": [p for p in downstream if is_aggregator(token_texts[p])],
        "others": [p for p in downstream if not is_aggregator(token_texts[p])],
    }


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The base model's final norm (Llama-like ``norm``, NeoX ``final_layer_norm``, GPT-2 ``ln_f``, Phi ``final_layernorm``)."""
    norm = final_norm(model)
    if norm is not None:
        return norm
    raise ProbeError(
        f"cannot find the final norm of {type(model).__name__} (looked for base_model.{', '.join(FINAL_NORMS)}); the logit lens needs it"
    )


def lens_labels(lm: LoadedModel, states: torch.Tensor, answer_ids: dict[str, tuple[tuple[int, ...], ...]]) -> list[str]:
    """Logit-lens label per layer for one token's states (layers + 1, hidden): the label whose first answer tokens score highest.

    transformers returns the last hidden state already normed, so only the earlier ones pass the final norm.
    """
    head = lm.model.get_output_embeddings()
    if head is None:
        raise ProbeError(f"{type(lm.model).__name__} has no output embeddings; the logit lens needs them")
    norm = _final_norm(lm.model)
    dtype = head.weight.dtype
    with torch.no_grad():
        states = states.to(dtype)
        logits = head(torch.cat([norm(states[:-1]), states[-1:]])).float()  # (layers + 1, vocab)
    labels = list(answer_ids)
    firsts = [sorted({ids[0] for ids in answer_ids[label]}) for label in labels]
    scores = torch.stack([logits[:, ids].max(-1).values for ids in firsts], -1)  # (layers + 1, labels)
    return [labels[i] for i in scores.argmax(-1).tolist()]


def commit_layer(labels: Sequence) -> int:
    """First layer from which the label equals the last layer's label at every later layer."""
    layer = len(labels) - 1
    while layer > 0 and labels[layer - 1] == labels[-1]:
        layer -= 1
    return layer


def lens_agreement(lens: Sequence[Sequence[str]], classes: Sequence[str]) -> dict[str, list[float]]:
    """Per conclusion class, per layer: the fraction of its samples whose lens label is already their last layer's."""
    agreement = {}
    for cls in sorted(set(classes)):
        rows = [[label == labels[-1] for label in labels] for labels, c in zip(lens, classes, strict=True) if c == cls]
        agreement[cls] = [sum(column) / len(rows) for column in zip(*rows)]
    return agreement


def balanced_commit_layer(lens: Sequence[Sequence[str]], classes: Sequence[str]) -> int:
    """First layer from which, at every later layer, a majority of each class's samples show their final lens label."""
    agreement = lens_agreement(lens, classes)
    return commit_layer([all(row[layer] > 0.5 for row in agreement.values()) for layer in range(len(lens[0]))])


def _sample_features(lm: LoadedModel, prompt: RenderedPrompt, field_name: str) -> tuple[dict[str, torch.Tensor | None], list[str]]:
    """Per group the mean residual stream (layers + 1, hidden), and the decision token's lens labels."""
    states = hidden_states(Notebook.empty(lm), [*prompt.context_ids, *prompt.decode_ids])  # (layers + 1, T, hidden)
    texts = [lm.tokenizer.decode([token]) for token in prompt.context_ids]
    groups = position_groups(texts, prompt.field_spans[field_name])
    features: dict[str, torch.Tensor | None] = {
        name: states[:, positions].mean(1).cpu() if positions else None for name, positions in groups.items()
    }
    features["decision"] = states[:, -1].cpu()
    return features, lens_labels(lm, states[:, -1], prompt.answer_ids)


# ---------------------------------------------------------------------------- logistic regression
def stratified_folds(labels: Sequence[int], folds: int, seed: int = 0) -> list[int]:
    """Fold index per sample: each class shuffled (seeded) and dealt round-robin, continuing across classes."""
    generator = torch.Generator().manual_seed(seed)
    assignment, turn = [0] * len(labels), 0
    for cls in sorted(set(labels)):
        members = [i for i, label in enumerate(labels) if label == cls]
        for index in torch.randperm(len(members), generator=generator).tolist():
            assignment[members[index]] = turn % folds
            turn += 1
    return assignment


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, classes: int, l2: float = 1e-2) -> Callable[[torch.Tensor], torch.Tensor]:
    """Fit a standardized, L2-regularized softmax regression with LBFGS; returns a predictor of class indices."""
    mean, std = features.mean(0), features.std(0, unbiased=False)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    x = (features - mean) / std  # (n, d)
    weight = torch.zeros(x.shape[1], classes, dtype=x.dtype, requires_grad=True)
    bias = torch.zeros(classes, dtype=x.dtype, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight + bias, labels) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    weight, bias = weight.detach(), bias.detach()
    return lambda new: (((new - mean) / std) @ weight + bias).argmax(-1)


def cv_accuracy(features: torch.Tensor, labels: Sequence, folds: int = 4, seed: int = 0, l2: float = 1e-2) -> float:
    """Cross-validated accuracy of the logistic regression decoding ``labels`` from ``features`` (n, d)."""
    names = sorted(set(labels), key=str)
    if len(labels) != len(features):
        raise ProbeError(f"{len(labels)} labels for {len(features)} feature rows")
    if not 2 <= folds <= len(labels):
        raise ProbeError(f"folds must be between 2 and the number of samples ({len(labels)}), got {folds}")
    target = torch.tensor([names.index(label) for label in labels])
    fold_of = torch.tensor(stratified_folds(target.tolist(), folds, seed))
    x = features.double()
    correct = 0
    for fold in range(folds):
        test, train = fold_of == fold, fold_of != fold
        if not bool(test.any()):
            continue
        predict = fit_logistic(x[train], target[train], len(names), l2)
        correct += int((predict(x[test]) == target[test]).sum())
    return correct / len(labels)


# ---------------------------------------------------------------------------- the probe
@dataclass
class LinearProbeResult:
    """Per-layer decodability of the conclusion and of the value, with the write and commit layers."""

    model: str
    scenario: str
    field: str
    num_layers: int
    samples: list[Sample]
    conclusion: dict[str, list[float] | None]  # group -> accuracy per hidden state (layers + 1), None if not decodable
    value: dict[str, list[float] | None]
    conclusion_decodable: bool
    reason: str | None
    write_layer: int | None
    lens: list[list[str]]  # per sample, the decision token's logit-lens label per hidden state
    ms: float
    notes: dict[str, str] = field(default_factory=dict)  # group -> why it has no accuracies

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    @property
    def class_counts(self) -> dict[str, int]:
        return dict(Counter(sample.label for sample in self.samples))

    @property
    def commit_layer(self) -> int:
        """Where the decision token commits: class-balanced majority over samples (see the module docstring)."""
        return balanced_commit_layer(self.lens, [sample.label for sample in self.samples])

    @property
    def commit_layers(self) -> list[int]:
        """Each sample's own commit layer."""
        return [commit_layer(labels) for labels in self.lens]

    def depth(self, layer: int | None) -> float | None:
        """Relative depth layer / num_layers (hidden state 0 is the embeddings)."""
        return None if layer is None else layer / self.num_layers

    @property
    def written_before_read(self) -> bool | None:
        return None if self.write_layer is None else self.write_layer < self.commit_layer

    def headline(self) -> str:
        """What the probe found, in one sentence: where the conclusion is written, and where the decision commits."""
        commit = f"the decision token commits (logit lens) at layer {self.commit_layer} of {self.num_layers}"
        if not self.conclusion_decodable:
            return f"Nothing to decode: {self.reason}; {commit}."
        if self.write_layer is None:
            return (
                f"No layer of the punctuation and newlines after the field decodes the conclusion to {WRITE_THRESHOLD:.0%} accuracy "
                f"({counted(self.n_samples, 'sample')}); {commit}."
            )
        order = "before" if self.written_before_read else "not before"
        return (
            f"A linear probe reads the conclusion from the punctuation and newlines after the field from layer {self.write_layer} "
            f"({WRITE_THRESHOLD:.0%} accuracy, {counted(self.n_samples, 'sample')}); {commit}: written {order} it is read."
        )

    def as_dict(self) -> dict:
        def by_group(table: dict[str, list[float] | None]) -> dict[str, list[float] | None]:
            return {group: None if row is None else [round(v, 3) for v in row] for group, row in table.items()}

        write_depth, commit_depth = self.depth(self.write_layer), self.depth(self.commit_layer)
        return {
            **attributes(self, "model", "scenario", "field"),
            "headline": self.headline(),
            **attributes(self, "num_layers", "n_samples", "class_counts"),
            "value_counts": dict(Counter(sample.origin for sample in self.samples)),
            "chance": round(max(self.class_counts.values()) / self.n_samples, 3),
            **attributes(self, "samples", "conclusion_decodable", "reason"),
            "accuracy": {"conclusion": by_group(self.conclusion), "value": by_group(self.value)},
            "group_notes": self.notes or None,
            "write_threshold": WRITE_THRESHOLD,
            "write_layer": self.write_layer,
            "write_depth": rounded(write_depth, 3),
            "commit_layer": self.commit_layer,
            "commit_depth": round(commit_depth, 3),
            "commit_layer_mean": round(sum(self.commit_layers) / self.n_samples, 2),
            "lens_agreement": {
                cls: [round(v, 3) for v in row] for cls, row in lens_agreement(self.lens, [s.label for s in self.samples]).items()
            },
            "written_before_read": self.written_before_read,
            "ms": round(self.ms, 1),
        }


def _accuracy_rows(stacks: dict[str, torch.Tensor], labels: Sequence, folds: int, tick: Tick) -> dict[str, list[float]]:
    """Group -> CV accuracy per hidden state, for features (n, layers + 1, hidden) per group."""
    rows = {}
    for group, stack in stacks.items():
        rows[group] = []
        for layer in range(stack.shape[1]):
            rows[group].append(cv_accuracy(stack[:, layer], labels, folds))
            tick()
    return rows


def probe_linear(
    experiment: EditExperiment,
    *,
    min_samples: int = 16,
    folds: int = 4,
    progress: StepProgress = None,
) -> LinearProbeResult:
    """Write before read: per-layer linear decodability of the conclusion at each position group, and the commit layer."""
    watch = Stopwatch()
    lm, name = experiment.lm, experiment.field
    inputs = probe_inputs(experiment, min_samples)
    if len(inputs) < folds:
        raise ProbeError(f"only {len(inputs)} samples render for field {name!r}; need at least folds={folds}")
    layers = lm.model.config.get_text_config().num_hidden_layers
    fits = 2 * len(GROUPS) * (layers + 1)
    total, done = len(inputs) + fits, 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    samples, per_group, lenses = [], {group: [] for group in GROUPS}, []
    for text, origin, prompt in inputs:
        samples.append(Sample(text, origin, _conclusion(experiment, text, prompt)))
        features, lens = _sample_features(lm, prompt, name)
        for group in GROUPS:
            per_group[group].append(features[group])
        lenses.append(lens)
        tick()

    notes = {group: "no such tokens downstream of the field" for group, rows in per_group.items() if any(r is None for r in rows)}
    stacks = {group: torch.stack(rows) for group, rows in per_group.items() if group not in notes}  # (n, layers + 1, hidden)
    value = _accuracy_rows(stacks, [s.origin for s in samples], folds, tick)
    labels = [s.label for s in samples]
    decodable = len(set(labels)) > 1
    reason = None if decodable else f"all {len(labels)} samples lead to {labels[0]!r}: only one conclusion class, nothing to decode"
    conclusion = _accuracy_rows(stacks, labels, folds, tick) if decodable else {}
    aggregators = conclusion.get("aggregators")
    write = next((layer for layer, acc in enumerate(aggregators) if acc >= WRITE_THRESHOLD), None) if aggregators else None
    if progress and done < total:
        progress(total, total)
    return LinearProbeResult(
        model=lm.fingerprint.name,
        scenario=experiment.scenario.name,
        field=name,
        num_layers=layers,
        samples=samples,
        conclusion={group: conclusion.get(group) for group in GROUPS},
        value={group: value.get(group) for group in GROUPS},
        conclusion_decodable=decodable,
        reason=reason,
        write_layer=write,
        lens=lenses,
        ms=watch.ms,
        notes=notes,
    )
