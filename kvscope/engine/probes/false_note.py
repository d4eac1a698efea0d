"""False note: inject the new value's top-K downstream K/V (not the field) into the stale cache.

The field keeps its old value; if the decision follows the injected notes rather than the live field
(paper: it does, recovery ≈ 1.0), the notes, not the field, carry the decision. Every downstream note
injected at once is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.jsonable import attributes
from kvscope.engine.probes.common import (
    Gap,
    ProbeError,
    Reading,
    patched_reading,
    probe_json,
    ranked_notes,
    require_aligned,
)
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.words import counted


@dataclass
class FalseNoteResult:
    """The stale cache (old field) with the new value's top-K notes injected: does the decision follow them?"""

    gap: Gap
    field_value: str
    note_value: str
    positions: list[int]
    injected: Reading
    all_downstream: Reading  # every downstream note injected (reference)

    def follows(self, reading: Reading) -> bool | None:
        """Whether a reading takes the note's (oracle) label; None when stale and oracle agree anyway."""
        return None if self.gap.stale_label == self.gap.oracle_label else reading.label == self.gap.oracle_label

    def headline(self) -> str:
        """What the probe found, in one sentence: does the decision follow the injected notes or the live field?"""
        follows = self.follows(self.injected)
        verdict = {True: "the decision follows the notes, not the field", False: "the decision follows the field"}
        said = (
            f"With the field still {self.field_value!r}, injecting the K/V of the top {counted(len(self.positions), 'note')} "
            f"computed with {self.note_value!r} gives {self.injected.words()}; every downstream note, {self.all_downstream.words()}"
        )
        return said + (f": {verdict[follows]}." if follows is not None else " (stale and new value agree on the decision anyway).")

    def as_dict(self) -> dict:
        return probe_json(
            self,
            {
                **attributes(self, "field_value", "note_value"),
                "k": len(self.positions),
                **attributes(self, "positions", "injected"),
                "follows_note": self.follows(self.injected),
                "all_downstream": self.all_downstream.as_dict(),
                "all_downstream_follows_note": self.follows(self.all_downstream),
            },
        )


def probe_false_note(experiment: EditExperiment, *, progress: StepProgress = None, k: int = 8) -> FalseNoteResult:
    """Inject the new value's top-K downstream K/V (not the field) into the stale cache (paper: follows, ≈ 1.0)."""
    require_aligned(experiment, "false_note")
    ranked = ranked_notes(experiment)
    if not 1 <= k <= len(ranked):
        raise ProbeError(f"k={k} must be between 1 and the {len(ranked)} downstream tokens")
    tick = ticker(progress, 2)
    injected = patched_reading(experiment, ranked[:k])
    tick()
    everything = patched_reading(experiment, experiment.downstream_positions)
    tick()
    return FalseNoteResult(Gap.of(experiment), experiment.old, experiment.new, ranked[:k], injected, everything)
