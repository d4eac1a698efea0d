"""What every tab's handlers share: the user-facing error, numeric UI values, the editor's scenario and exports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import plotly.graph_objects as go

from kvscope.app.hosting import HostingProfile
from kvscope.app.state import ExportFolder
from kvscope.engine import (
    Cancelled,
    KVScopeError,
    Recipe,
    Scenario,
    Unreachable,
    bundled_scenarios,
    recipe_matches,
    recipe_notebook,
    script_text,
)
from kvscope.viz.common import markdown_literal

# The bundled demo where the embedded model's notes carry the most of the decision (lowest field-only recovery
# among the scenarios that flip; `python -m kvscope calibrate`): the Notes tab's default and the Learn tab's case.
NOTES_SCENARIO = "pharmacy_prescription"


class AppError(Exception):
    """A message for the user (bad input or an engine refusal); the session stays usable."""


class AppNotice(AppError):
    """Not a failure but information for the person: shown as a toast and in the panel the result would fill, with no
    error badges (see ``kvscope.app.page.notice``)."""

    warning = False  # a warning toast (something to do) rather than an info toast


class AppCancelled(AppNotice):
    """Work the person stopped (e.g. a calibration they cancelled)."""


class AppUnreachable(AppNotice):
    """A server the person named does not answer: their situation to fix, reported at once (a warning toast)."""

    warning = True


class AppMissingInput(AppNotice):
    """Input the person has not given yet (the message names the field, by its label on the page)."""

    warning = True


def guarded(function):
    """Turn engine refusals into :class:`AppError` with the engine's own message (:class:`AppCancelled` where the work was
    cancelled)."""

    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Cancelled as error:
            raise AppCancelled(str(error)) from error
        except Unreachable as error:
            raise AppUnreachable(str(error)) from error
        except KVScopeError as error:
            raise AppError(str(error)) from error

    wrapper.__name__, wrapper.__doc__ = function.__name__, function.__doc__
    return wrapper


def number(value, name: str, default: float, kind: type = int) -> float:
    """A numeric UI value (an API client may send None, "" or text): ``default`` when empty, else ``kind``."""
    if value is None or value == "":
        return default
    try:
        return kind(value)
    except (TypeError, ValueError) as error:
        raise AppError(f"{name} must be a {'whole ' if kind is int else ''}number, got {value!r}") from error


def bundled_text(paths: Mapping[str, Path], name: str, what: str) -> str:
    """The text of the bundled file ``name`` among ``paths``; an unknown name is refused as an unknown ``what``."""
    if name not in paths:
        raise AppError(f"unknown {what} {name!r}; bundled: {', '.join(paths)}")
    return paths[name].read_text(encoding="utf-8")


def bundled_scenario_text(name: str) -> str:
    """The TOML text of a bundled scenario."""
    return bundled_text(bundled_scenarios(), name, "scenario")  # sorted by name


@guarded
def parse_scenario(text: str, profile: HostingProfile | None = None) -> Scenario:
    """A scenario from the editor's TOML text (refused before parsing when longer than the profile allows)."""
    if not (text or "").strip():
        raise AppError("the scenario editor is empty: pick a bundled scenario, upload a TOML file or write one")
    if profile is not None:
        profile.check_scenario_text(text)
    return Scenario.from_toml(text, source="scenario editor")


@dataclass(frozen=True)
class ScenarioChoices:
    """The editor's scenario as the Notes tab offers it: its description, fields, the field's values and new value."""

    description: str
    fields: list[str]
    values: list[str]
    new: str


def scenario_choices(text: str, field: str | None = None) -> ScenarioChoices:
    """Fields and values to offer for the scenario in the editor."""
    scenario = parse_scenario(text)
    chosen = scenario.fields[field] if field in scenario.fields else scenario.field()
    return ScenarioChoices(
        description=f"**{markdown_literal(scenario.name)}** — {markdown_literal(scenario.description)}",
        fields=list(scenario.fields),
        values=list(chosen.values),
        new=chosen.new,
    )


@guarded
def export_files(
    folder: ExportFolder,
    result: dict | None,
    figures: Sequence[go.Figure],
    stem: str,
    html_parts: Sequence[str] = (),
    recipe: Recipe | None = None,
) -> list[str]:
    """Write the result JSON and one HTML file with every figure (and any HTML views); with the ``recipe`` that
    computed this result, also ``STEM.py`` and ``STEM.ipynb``, which rerun it. Returns their paths."""
    if not result:
        raise AppError("nothing to export yet: run something first")
    extra = reproduction_files(recipe, stem) if recipe is not None and recipe_matches(recipe, result) else {}
    return [str(path) for path in folder.write(result, [figure for figure in figures if figure is not None], stem, html_parts, extra)]


def reproduction_files(recipe: Recipe, stem: str) -> dict[str, str]:
    """The recipe as a runnable script and a notebook (the engine's public API only), by file name."""
    import nbformat  # exports alone need it

    book = nbformat.from_dict(recipe_notebook(recipe, f"{stem}.json"))
    nbformat.validate(book)
    return {f"{stem}.py": script_text(recipe, f"{stem}.json"), f"{stem}.ipynb": nbformat.writes(book)}
