"""Does a scenario's decision follow its field on this model? Stale vs oracle for every scenario and field."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.models import LoadedModel
from engine.runs import run_scenario
from engine.scenario import Scenario

FLIP_THRESHOLD = 1.0


@dataclass
class Calibration:
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

    def as_dict(self) -> dict:
        return asdict(self)


def calibrate_scenario(lm: LoadedModel, path: Path, threshold: float = FLIP_THRESHOLD) -> list[Calibration]:
    """Stale vs oracle decisions for every field of one scenario file."""
    scenario = Scenario.load(path)
    results = []
    for field in scenario.fields.values():
        old = run_scenario(lm, scenario, {field.name: field.old}).decision
        new = run_scenario(lm, scenario, {field.name: field.new}).decision
        delta = new.margin - old.margin
        flips = old.label != new.label and abs(delta) >= threshold
        expect = scenario.expect
        expected_flip = expect[field.old] != expect[field.new] if field.old in expect and field.new in expect else None
        results.append(
            Calibration(
                file=str(path), scenario=scenario.name, field=field.name, old=field.old, new=field.new,
                old_label=old.label, new_label=new.label, old_margin=round(old.margin, 4), new_margin=round(new.margin, 4),
                delta_margin=round(delta, 4), flips=flips, expected_flip=expected_flip,
                ok=None if expected_flip is None else flips == expected_flip and (not flips or new.label == expect[field.new]),
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
            raise FileNotFoundError(f"scenario path {path} does not exist")
    return files


def calibrate(lm: LoadedModel, paths: Sequence[str | Path], threshold: float = FLIP_THRESHOLD, progress: Callable[[int, int], None] | None = None) -> list[Calibration]:
    """Calibrate every scenario file under ``paths``."""
    files = scenario_files(paths)
    results: list[Calibration] = []
    for index, path in enumerate(files):
        results.extend(calibrate_scenario(lm, path, threshold))
        if progress:
            progress(index + 1, len(files))
    return results
