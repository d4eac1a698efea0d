"""Read heads: which (layer, head) pairs read the top notes, and does knocking out their access matter?

Heads are ranked by the last decision token's attention mass on the top notes in the oracle cache; the top
heads' access to the notes is knocked out, against as many random heads (``seeds`` draws) and against every
head (the position knockout, as reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.cache.notebook import Knockout
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.probes.common import (
    Gap,
    ProbeError,
    RandomControl,
    Reading,
    hidden_reading,
    probe_json,
    random_control,
    ranked_notes,
    read,
    require_aligned,
    rounded,
)
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.words import counted


@dataclass
class HeadsResult:
    """Attention mass on the top notes per (layer, head) in the oracle cache, and head knockouts."""

    gap: Gap
    notes: list[int]
    mass_last: list[list[float]]  # (layers, heads): last decision token → notes
    mass_mean: list[list[float]]  # (layers, heads): mean over decision tokens
    top_heads: list[tuple[int, int]]  # (layer, head), most mass (last token) first
    top: Reading  # top heads' access to the notes knocked out
    random: RandomControl  # as many random heads
    all_heads: Reading  # every head's access to the notes knocked out (reference)

    def headline(self) -> str:
        """What the probe found, in one sentence: the top heads' knockout against random heads and every head."""
        return (
            f"Hiding the top {counted(len(self.notes), 'note')} from the {counted(len(self.top_heads), 'head')} that attend to them "
            f"most gives {self.top.words()}; from as many random heads, {self.random.words()}; from every head, "
            f"{self.all_heads.words()}; nothing hidden, the new value gives {self.gap.oracle_label} {self.gap.oracle:+.2f}."
        )

    def as_dict(self) -> dict:
        def drop(knocked: Reading | RandomControl) -> float | None:
            return None if knocked.recovery is None else rounded(1 - knocked.recovery)

        knockouts = {"top": self.top, "random": self.random, "all_heads": self.all_heads}
        return probe_json(
            self,
            {
                "notes": self.notes,
                "mass_last": [[rounded(v) for v in row] for row in self.mass_last],
                "mass_mean": [[rounded(v) for v in row] for row in self.mass_mean],
                "top_heads": [list(pair) for pair in self.top_heads],
                **{name: {**knocked.as_dict(), "recovery_drop": drop(knocked)} for name, knocked in knockouts.items()},
            },
        )


def _head_knockouts(pairs: Sequence[tuple[int, int]], positions: Sequence[int]) -> list[Knockout]:
    """One knockout per layer hiding ``positions`` from that layer's chosen query heads."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)
    return [Knockout(tuple(positions), (layer,), tuple(sorted(heads))) for layer, heads in sorted(by_layer.items())]


def probe_heads(
    experiment: EditExperiment, *, progress: StepProgress = None, heads: int = 12, notes: int = 8, seeds: int = 3
) -> HeadsResult:
    """Read heads: rank (layer, head) by the last decision token's attention to the top notes; knock them out."""
    require_aligned(experiment, "heads")
    ranked = ranked_notes(experiment)
    if not 1 <= notes <= len(ranked):
        raise ProbeError(f"notes={notes} must be between 1 and the {len(ranked)} downstream tokens")
    if heads < 1:
        raise ProbeError(f"heads={heads} must be ≥ 1")
    gap, oracle, chosen = Gap.of(experiment), experiment.oracle.notebook, ranked[:notes]
    tick = ticker(progress, 3 + seeds)
    attention = read(experiment, oracle, capture_attention=True).attention  # (layers, heads, decode, entries + decode)
    tick()
    on_notes = attention[..., oracle.entries_at(chosen)].sum(-1)  # (layers, heads, decode)
    mass_last, mass_mean = on_notes[..., -1], on_notes.mean(-1)
    layer_count, head_count = mass_last.shape
    count = min(heads, layer_count * head_count)
    flat = mass_last.flatten().topk(count).indices.tolist()
    top_heads = [(i // head_count, i % head_count) for i in flat]

    def knocked(pairs: Sequence[tuple[int, int]]) -> Reading:
        result = hidden_reading(experiment, _head_knockouts(pairs, chosen), gap)
        tick()
        return result

    top = knocked(top_heads)
    pool = [(layer, head) for layer in range(layer_count) for head in range(head_count)]
    control = random_control(pool, count, seeds, gap, lambda draw: knocked(draw).margin)
    all_heads = hidden_reading(experiment, Knockout(tuple(chosen)), gap)
    tick()
    return HeadsResult(gap, chosen, mass_last.tolist(), mass_mean.tolist(), top_heads, top, control, all_heads)
