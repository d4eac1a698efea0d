"""Does a scenario's decision follow its field on this model, and do the notes carry it?

For every scenario and field: the clean-prefill decisions at the old and new value (stale vs oracle) and the
field_only edit's recovery, whose complement is the notes share. A *notes demo* flips under a clean prefill
while the field-only edit leaves the decision where it was (recovery ≤ ``NOTES_DEMO_MAX_RECOVERY``): the
paper's phenomenon, visible on this model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.jsonable import JsonFields, rounded
from kvscope.engine.progress import StepProgress
from kvscope.engine.scenario import Scenario, ScenarioError

FLIP_THRESHOLD = 1.0
NOTES_DEMO_MAX_RECOVERY = 0.4


@dataclass
class Calibration(JsonFields):
    """One scenario field: decisions for its old and new value under a clean prefill."""

    file: str
    scenario: str
    field: str
    old: str
    new: str
    old_label: str
    new_label: str
    old_margin: float
    new_margin: float
    delta_margin: float
    flips: bool  # labels differ and |Δmargin| ≥ threshold
    expected_flip: bool | None  # from [expect]; None when it does not say
    ok: bool | None  # the model does what [expect] says (None when it does not say)
    field_only_recovery: float | None  # None when undefined (tiny gap) or not applicable (length change)
    field_only_label: str | None
    notes_share: float | None  # 1 − field_only_recovery
    notes_demo: bool  # flips, and field_only keeps the old decision with recovery ≤ NOTES_DEMO_MAX_RECOVERY


def calibrate_scenario(lm: LoadedModel, path: Path, threshold: float = FLIP_THRESHOLD) -> list[Calibration]:
    """Stale vs oracle decisions and the field-only recovery for every field of one scenario file."""
    scenario = Scenario.load(path)
    results = []
    for field in scenario.fields.values():
        experiment = EditExperiment(lm, scenario, field.name)
        notes = experiment.report(["field_only"], fused=True).notes
        old, new = experiment.stale.decision, experiment.oracle.decision
        delta = new.margin - old.margin
        flips = old.label != new.label and abs(delta) >= threshold
        expect = scenario.expect
        expected_flip = expect[field.old] != expect[field.new] if field.old in expect and field.new in expect else None
        notes_demo = (
            flips
            and notes.field_only_label == old.label
            and notes.field_recovery is not None
            and notes.field_recovery <= NOTES_DEMO_MAX_RECOVERY
        )
        results.append(
            Calibration(
                file=str(path),
                scenario=scenario.name,
                field=field.name,
                old=field.old,
                new=field.new,
                old_label=old.label,
                new_label=new.label,
                old_margin=round(old.margin, 4),
                new_margin=round(new.margin, 4),
                delta_margin=round(delta, 4),
                flips=flips,
                expected_flip=expected_flip,
                ok=None if expected_flip is None else flips == expected_flip and (not flips or new.label == expect[field.new]),
                field_only_recovery=rounded(notes.field_recovery),
                field_only_label=notes.field_only_label,
                notes_share=rounded(notes.share),
                notes_demo=notes_demo,
            )
        )
    return results


def scenario_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand files and directories (their *.toml) into a sorted list of scenario files."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(path.glob("*.toml")))
        elif path.exists():
            files.append(path)
        else:
            raise ScenarioError(f"scenario path {path} does not exist: give a .toml file or a directory of them")
    return files


def calibrate(
    lm: LoadedModel, paths: Sequence[str | Path], threshold: float = FLIP_THRESHOLD, progress: StepProgress = None
) -> list[Calibration]:
    """Calibrate every scenario file under ``paths``."""
    files = scenario_files(paths)
    results: list[Calibration] = []
    for index, path in enumerate(files):
        results.extend(calibrate_scenario(lm, path, threshold))
        if progress:
            progress(index + 1, len(files))
    return results
