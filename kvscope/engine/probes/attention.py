"""Attention: where the last decision token looks over the context, in the stale and the oracle cache.

Per layer and head, in reading order (whatever the storage order), with the mass on the field, on the
downstream tokens and on the rest (prefix and question tokens) per layer, mean over heads. In JSON a map keeps
every head up to ``MAX_JSON_VALUES`` numbers; past that (e.g. a 0.5B model's 24 × 14 heads over 4k tokens, 1.4M
numbers) it keeps the mean over heads, and ``attention_heads`` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.runs import ScenarioRun
from kvscope.engine.jsonable import attributes
from kvscope.engine.probes.common import Gap, probe_json, read, rounded
from kvscope.engine.progress import StepProgress, ticker

MAX_JSON_VALUES = 250_000  # numbers per map in JSON (~2 MB); larger maps keep the mean over heads


@dataclass
class AttentionMap:
    """One run's last-decision-token attention over its context, in reading order."""

    label: str
    positions: list[int]
    token_texts: list[str]
    segments: list[str]
    attention: list  # (layers, heads, context tokens)
    mass: dict[str, list[float]]  # field / downstream / rest (prefix and question tokens) per layer, mean over heads

    def as_dict(self) -> dict:
        values = np.asarray(self.attention, dtype=np.float64)
        every_head = values.size <= MAX_JSON_VALUES
        return {
            **attributes(self, "label", "positions", "token_texts", "segments"),
            "attention_heads": "all" if every_head else "mean",
            "attention": self.attention if every_head else np.round(values.mean(1), 4).tolist(),  # (layers, heads or —, tokens)
            "mass": {name: [rounded(v) for v in values] for name, values in self.mass.items()},
        }


@dataclass
class AttentionResult:
    """Where the decision looks in the stale and the oracle cache."""

    gap: Gap
    stale: AttentionMap
    oracle: AttentionMap

    def headline(self) -> str:
        """Where the decision looks, in one sentence: its attention on the field and on the tokens after it."""

        def share(run: AttentionMap, name: str) -> str:
            values = run.mass.get(name) or [0.0]
            return f"{sum(values) / len(values):.0%}"

        return (
            f"Averaged over layers, the last decision token puts {share(self.stale, 'field')} of its attention on the field and "
            f"{share(self.stale, 'downstream')} on the tokens after it in the stale cache, {share(self.oracle, 'field')} and "
            f"{share(self.oracle, 'downstream')} with the new value."
        )

    def as_dict(self) -> dict:
        return probe_json(self, attributes(self, "stale", "oracle"))


def _nested(tensor: torch.Tensor, digits: int = 4) -> list:
    """A tensor as nested lists of rounded floats."""
    return np.round(tensor.detach().cpu().double().numpy(), digits).tolist()


def _attention_map(experiment: EditExperiment, run: ScenarioRun) -> AttentionMap:
    notebook = run.notebook
    decision = run.decision if run.decision.attention is not None else read(experiment, notebook, capture_attention=True)
    last = decision.attention[:, :, -1, notebook.order]  # (layers, heads, context) in reading order
    positions = notebook.visible_positions()
    span = run.prompt.field_spans[experiment.field]
    in_field = torch.tensor([span.start <= p < span.end for p in positions])
    downstream = torch.tensor([p >= span.end for p in positions])
    field_mass, downstream_mass = (last[..., mask].sum(-1).mean(1) for mask in (in_field, downstream))
    mass = {"field": field_mass.tolist(), "downstream": downstream_mass.tolist(), "rest": (1 - field_mass - downstream_mass).tolist()}
    return AttentionMap(decision.label, positions, notebook.token_texts(), notebook.visible_segments(), _nested(last), mass)


def probe_attention(experiment: EditExperiment, *, progress: StepProgress = None) -> AttentionResult:
    """Attention of the last decision token to every context token, per layer and head, stale and oracle."""
    tick = ticker(progress, 2)
    maps = []
    for run in (experiment.stale, experiment.oracle):
        maps.append(_attention_map(experiment, run))
        tick()
    return AttentionResult(Gap.of(experiment), *maps)
