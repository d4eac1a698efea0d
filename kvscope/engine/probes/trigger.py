"""Trigger control: flip a rule word after the field (field byte-identical) and patch what follows it.

The flipped run's K/V of the notes after the trigger, patched into the original cache, should carry the flip
(≈ 1); the trigger tokens alone should not (≈ 0). Recovery runs from the original rule (0) to the flipped
rule (1). Options ``find`` and ``replace`` name the phrase and its flip (same token count, once in the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as dataclass_replace

from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.runs import ScenarioRun, render_for
from kvscope.engine.jsonable import attributes
from kvscope.engine.probes.common import Gap, ProbeError, Reading, patched_reading, probe_json, read
from kvscope.engine.progress import StepProgress, ticker
from kvscope.engine.words import counted


@dataclass
class TriggerResult:
    """A rule word flipped with the field byte-identical: 0 = original rule, 1 = flipped rule."""

    gap: Gap
    find: str
    replace: str
    trigger_positions: list[int]
    trigger_texts: list[tuple[str, str]]  # (original, flipped) token text
    note_positions: list[int]
    notes_patched: Reading  # the flipped run's K/V after the trigger (trigger excluded): ≈ 1 expected
    trigger_patched: Reading  # only the trigger tokens' K/V: ≈ 0 expected

    def headline(self) -> str:
        """What the probe found, in one sentence: the notes after the flipped words against the words alone."""
        return (
            f"Flipping {self.find!r} to {self.replace!r} (the field unchanged) takes the decision {self.gap.words()}; the "
            f"flipped run's {counted(len(self.note_positions), 'token')} after it, patched in, give {self.notes_patched.words()}, "
            f"the flipped words alone {self.trigger_patched.words()}."
        )

    def as_dict(self) -> dict:
        return probe_json(
            self,
            {
                **attributes(self, "find", "replace", "trigger_positions"),
                "trigger_texts": [list(pair) for pair in self.trigger_texts],
                "note_count": len(self.note_positions),
                **attributes(self, "notes_patched", "trigger_patched"),
            },
        )


def _flipped_run(experiment: EditExperiment, find: str | None, replace: str | None) -> tuple[ScenarioRun, list[int]]:
    """The scenario with ``find`` → ``replace`` in its context (same field values), and the changed positions."""
    if not find or not replace:
        raise ProbeError(
            "probe 'trigger' needs the options find=WORD and replace=WORD: a rule phrase in the context after "
            "the field and its flip with the same token count (e.g. find='only if', replace='unless')"
        )
    if any(brace in text for text in (find, replace) for brace in "{}"):
        raise ProbeError(f"trigger find={find!r} / replace={replace!r} must not contain braces")
    scenario, lm = experiment.scenario, experiment.lm
    count = scenario.context.count(find)
    if count != 1:
        raise ProbeError(f"trigger find={find!r} occurs {count} times in the scenario context; give a phrase that occurs exactly once")
    flipped = dataclass_replace(scenario, context=scenario.context.replace(find, replace))
    original = experiment.stale.prompt
    prompt = render_for(lm, flipped, original.values)
    if len(prompt.context_ids) != len(original.context_ids):
        raise ProbeError(
            f"replacing {find!r} by {replace!r} changes the context from {len(original.context_ids)} to "
            f"{len(prompt.context_ids)} tokens; the trigger probe patches position by position: use a replacement with the same token count"
        )
    changed = [i for i, (a, b) in enumerate(zip(original.context_ids, prompt.context_ids)) if a != b]
    if not changed:
        raise ProbeError(f"replacing {find!r} by {replace!r} changes no token")
    field_end = experiment.field_positions[-1]
    if changed[0] <= field_end:
        raise ProbeError(
            f"trigger {find!r} must come after field {experiment.field!r} (it changes position {changed[0]}, the field ends at {field_end})"
        )
    notebook = Notebook.from_prompt(lm, prompt)
    return ScenarioRun(flipped, prompt, notebook, read(experiment, notebook)), changed


def probe_trigger(
    experiment: EditExperiment, *, progress: StepProgress = None, find: str | None = None, replace: str | None = None
) -> TriggerResult:
    """Flip a rule word; patch the flipped run's notes after it (≈ 1) vs only the trigger tokens (≈ 0)."""
    flipped, changed = _flipped_run(experiment, find, replace)
    notes = [p for p in experiment.downstream_positions if p > changed[0] and p not in changed]
    if not notes:
        raise ProbeError(f"no tokens follow the trigger {find!r}: there are no notes to patch")
    original = experiment.stale.decision
    gap = Gap(
        original.margin,
        flipped.decision.margin,
        original.label,
        flipped.decision.label,
        experiment.min_gap,
        ("original", "flipped"),
    )
    tick = ticker(progress, 2)
    notes_patched = patched_reading(experiment, notes, donor=flipped.notebook, gap=gap)
    tick()
    trigger_patched = patched_reading(experiment, changed, donor=flipped.notebook, gap=gap)
    tick()
    decode = experiment.lm.tokenizer.decode
    texts = [(decode([experiment.stale.prompt.context_ids[p]]), decode([flipped.prompt.context_ids[p]])) for p in changed]
    return TriggerResult(gap, find, replace, changed, texts, notes, notes_patched, trigger_patched)
