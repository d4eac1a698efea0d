"""Reproducible exports: a recipe (what one result depends on) as a runnable Python script or a Jupyter notebook.

An export of the Notes tab (an edit, with the frontier and a knockout run on it) or of the Probes tab carries a
:class:`Recipe`: the
model spec, dtype and device it ran with, the scenario TOML itself, the field and new value, the strategies and how
they were read, every strategy setting (``EditSettings``: K, ranking, erratum and restate templates, chain of thought,
minimum gap), the knockout positions, the probe and its options, and the figure options. :func:`script_text` and
:func:`notebook` turn it into code that uses only the engine's public API (``from kvscope import ...``) and writes
the export's JSON (same keys; measured timings aside) to ``reproduced.json``.

Pure functions: nothing here loads a model or imports torch. The scenario travels inline as a triple-quoted
literal that round-trips exactly (:func:`python_string`); every other value is written by :func:`python_literal`,
which accepts only JSON-like values, so no object's ``repr`` reaches the code.
"""

from __future__ import annotations

import math
import textwrap
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.words import counted

KIND_WORDS = {  # a recipe's kind: its result's title and what its script runs, in words
    "edit": ("edit {where}{frontier}", "run the edit{frontier}"),
    "knockout": ("edit {where}{frontier} and a knockout of {knocked}", "run the edit{frontier}, then the knockout"),
    "probe": ("probe {probe} on {where}", "run the probe {probe} on the edit"),
}
KINDS = tuple(KIND_WORDS)
OUTPUT = "reproduced.json"
NOTEBOOK_FORMAT = (4, 5)  # nbformat 4.5: cells carry ids


@dataclass(frozen=True)
class Recipe:
    """Everything one exported result depends on, enough to rerun it from the engine's public API.

    ``kind``: ``edit`` (the Notes tab's strategy report), ``knockout`` (that edit, then ``knockout`` positions
    hidden from the new-value decision, under the JSON's ``knockout`` key beside the edit's) or ``probe`` (``probe``
    with ``probe_options`` on the edit). ``frontier``: an edit's cost–quality frontier was run on it too (the JSON's
    ``frontier`` key).
    ``settings`` are the strategies' knobs (the fields of ``EditSettings``); ``head`` and ``all_positions`` choose
    what the figures show and do not change any number.
    """

    kind: str
    model: str
    dtype: str
    device: str
    scenario_toml: str
    field: str
    new: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    strategies: tuple[str, ...] = ()
    fused: bool = True
    knockout: tuple[int, ...] = ()
    frontier: bool = False
    probe: str | None = None
    probe_options: Mapping[str, Any] = field(default_factory=dict)
    head: int | None = None
    all_positions: bool = False
    scenario_name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown recipe kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind == "probe" and not self.probe:
            raise ValueError("a probe recipe names its probe")
        if self.kind == "knockout" and not self.knockout:
            raise ValueError("a knockout recipe lists the positions it hides")
        for value in (self.settings, self.probe_options, self.strategies, self.knockout):
            python_literal(value)  # refuse anything that would not be written as a plain literal

    @property
    def title(self) -> str:
        """What the result is, in a line."""
        return self._words(0)

    @property
    def what_runs(self) -> str:
        """What its script runs after prefilling the scenario, in words."""
        return self._words(1)

    def _words(self, which: int) -> str:
        """Its kind's words (:data:`KIND_WORDS`; 0: the title, 1: what runs) filled in."""
        return KIND_WORDS[self.kind][which].format(
            probe=self.probe,
            where=f"{self.scenario_name or 'scenario'}: {self.field} -> {self.new}",
            frontier=", its frontier" if self.frontier else "",
            knocked=counted(len(self.knockout or ()), "position"),
        )


# ---------------------------------------------------------------------------- literals
def python_string(text: str, quote: str | None = None) -> str:
    """``text`` as a triple-quoted Python literal that evaluates to exactly ``text``: backslashes doubled, a quote
    escaped where it would close the literal, and control, format, separator and surrogate characters (``\\r``
    included: Python reads a raw CR in source as a newline) written as escapes. Tabs and newlines stay as they are."""
    if quote is None:  # the delimiter the text needs fewer escapes for
        quote = '"' if "'''" in text and '"""' not in text else "'"
    if quote not in ("'", '"'):
        raise ValueError("quote must be ' or \"")
    out: list[str] = []
    run = 0  # unescaped quotes just written
    for char in text:
        if char == quote:
            if run == 2:
                out.append("\\" + quote)
                run = 0
            else:
                out.append(char)
                run += 1
            continue
        run = 0
        if char == "\\":
            out.append("\\\\")
        elif char in "\n\t":
            out.append(char)
        elif _unprintable(char):
            out.append(_escaped(char))
        else:
            out.append(char)
    while run:  # quotes at the very end would merge with the closing delimiter
        out[-run] = "\\" + quote
        run -= 1
    return quote * 3 + "".join(out) + quote * 3


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _unprintable(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def quoted(text: str) -> str:
    """``text`` as a one-line double-quoted Python literal (what ``repr`` gives, in double quotes: readable non-ASCII
    text kept, control and separator characters escaped)."""
    named = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(named.get(char) or (_escaped(char) if _unprintable(char) else char) for char in text) + '"'


def python_literal(value: Any, indent: int = 0) -> str:
    """A JSON-like value (None, bool, int, float, str, list, tuple, dict with str keys) as Python source; dicts with
    several entries one per line. Anything else is refused, so no object's ``repr`` becomes code."""
    pad = " " * (indent + 4)
    if isinstance(value, str):
        return quoted(value)
    if value is None or isinstance(value, bool | int):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, list | tuple):
        items = [python_literal(item, indent) for item in value]
        return "[" + ", ".join(items) + "]"
    if isinstance(value, Mapping):
        if not all(isinstance(key, str) for key in value):
            raise TypeError("dict keys must be strings")
        if not value:
            return "{}"
        items = [f"{pad}{quoted(key)}: {python_literal(item, indent + 4)}," for key, item in value.items()]
        return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
    raise TypeError(f"cannot write a {type(value).__name__} as a plain literal")


# ---------------------------------------------------------------------------- the code
@dataclass(frozen=True)
class Cell:
    kind: str  # "markdown" or "code"
    source: str


def _imports(recipe: Recipe, script: bool) -> str:
    names = ["EditExperiment", "EditSettings", "Scenario", "load_model", *(["PROBES"] if recipe.kind == "probe" else ["analyse_edit"])]
    names += ["probe_frontier"] if recipe.frontier and recipe.kind != "probe" else []
    modules = ["json", *(["sys"] if script else [])]
    names.sort(key=lambda name: (0 if name.isupper() else 1 if name[0].isupper() else 2, name))  # as isort orders them
    lines = [*(f"import {module}" for module in modules), "from pathlib import Path", "", "from kvscope import " + ", ".join(names)]
    return "\n".join(lines)


def _constants(recipe: Recipe) -> str:
    lines = [
        f"MODEL = {python_literal(recipe.model)}  # alias, Hugging Face id or local directory",
        f"DTYPE = {python_literal(recipe.dtype)}",
        f"DEVICE = {python_literal(recipe.device)}  # where the export ran; another device agrees within its dtype's noise",
        f"FIELD = {python_literal(recipe.field)}",
        f"NEW = {python_literal(recipe.new)}",
        "# the strategies' knobs (EditSettings): K, ranking, erratum and restate templates, chain of thought, minimum gap",
        f"SETTINGS = {python_literal(dict(recipe.settings))}",
    ]
    if recipe.kind == "probe":
        lines += [
            f"PROBE = {python_literal(recipe.probe)}",
            f"PROBE_OPTIONS = {python_literal(dict(recipe.probe_options))}",
        ]
    else:
        lines += [
            f"STRATEGIES = {python_literal(list(recipe.strategies))}",
            f"FUSED = {python_literal(recipe.fused)}  # True: every strategy and the oracle read in one forward; False: timed one by one",
        ]
    if recipe.kind == "knockout":
        lines.append(f"KNOCKOUT = {python_literal(list(recipe.knockout))}  # positions hidden from the new-value decision")
    lines += [
        f"HEAD = {python_literal(recipe.head)}  # attention figure's head (None: mean over heads); figures only",
        f"ALL_POSITIONS = {python_literal(recipe.all_positions)}  # notes map over every position; figures only",
    ]
    return "\n".join(lines)


def _run(recipe: Recipe) -> str:
    lines = [
        "lm = load_model(MODEL, device=DEVICE, dtype=DTYPE)",
        'scenario = Scenario.from_toml(SCENARIO_TOML, source="exported scenario")',
        "experiment = EditExperiment(lm, scenario, FIELD, NEW, settings=EditSettings(**SETTINGS), capture_attention=True)",
    ]
    if recipe.kind == "probe":
        lines.append("result = PROBES[PROBE](experiment, **PROBE_OPTIONS).as_dict()")
    else:
        lines += [
            "analysis = analyse_edit(experiment, STRATEGIES, fused=FUSED)",
            "result = analysis.as_dict()",
            "print(analysis.report.notes.headline())",
        ]
        if recipe.frontier:
            lines.append('result["frontier"] = probe_frontier(experiment).as_dict()')
    if recipe.kind == "knockout":
        lines.append('result["knockout"] = {"positions": KNOCKOUT, **experiment.knocked_out(KNOCKOUT).as_dict()}')
    return "\n".join(lines)


def _write(script: bool) -> str:
    target = f"Path({quoted(OUTPUT)})"
    target = f"Path(sys.argv[1]) if len(sys.argv) > 1 else {target}" if script else target
    return f'out = {target}\nout.write_text(json.dumps(result, indent=2, ensure_ascii=False), encoding="utf-8")\nprint(f"wrote {{out}}")'


def cells(recipe: Recipe, json_name: str | None = None, script: bool = True) -> list[Cell]:
    """The export as cells: what it reproduces, the settings, the scenario, the run, the JSON written."""
    compared = f" — compare with `{json_name}`" if json_name else ""
    intro = (
        f"# KVScope: {recipe.title}\n\n"
        f"Reruns this result on `{recipe.model}` ({recipe.dtype}, {recipe.device}) with the engine's public API only, "
        "in a KVScope checkout or wherever KVScope is installed. It writes the export's JSON (the same keys; "
        f"measured timings differ) to `{OUTPUT}`{compared}."
    )
    return [
        Cell("markdown", intro),
        Cell("code", _imports(recipe, script) + "\n\n" + _constants(recipe)),
        Cell("markdown", "The scenario, exactly as exported (TOML)."),
        Cell("code", "SCENARIO_TOML = " + python_string(recipe.scenario_toml)),
        Cell("markdown", f"Load the model, prefill the scenario at its old values and {recipe.what_runs}."),
        Cell("code", _run(recipe)),
        Cell("code", _write(script)),
    ]


def script_text(recipe: Recipe, json_name: str | None = None) -> str:
    """A runnable Python script: ``python NAME.py [OUT.json]`` writes the result's JSON (default reproduced.json)."""
    parts = cells(recipe, json_name, script=True)
    usage = "\n\nRun it with `python this_file.py [OUT.json]`."
    intro = "\n\n".join(textwrap.fill(paragraph, 110) for paragraph in (parts[0].source.removeprefix("# ") + usage).split("\n\n"))
    docstring = python_string(intro, quote='"')
    body = [
        part.source if part.kind == "code" else "\n".join(f"# {line}".rstrip() for line in part.source.splitlines()) for part in parts[1:]
    ]
    return docstring + "\n\n" + "\n\n".join(body) + "\n"


def notebook(recipe: Recipe, json_name: str | None = None) -> dict:
    """The same code as a Jupyter notebook (nbformat 4.5, as a dict: ``json.dump`` it or pass it to nbformat)."""
    entries = []
    for index, part in enumerate(cells(recipe, json_name, script=False)):
        entry = {"cell_type": part.kind, "id": f"kvscope-{index}", "metadata": {}, "source": _lines(part.source)}
        if part.kind == "code":
            entry |= {"execution_count": None, "outputs": []}
        entries.append(entry)
    major, minor = NOTEBOOK_FORMAT
    metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    return {"cells": entries, "metadata": metadata, "nbformat": major, "nbformat_minor": minor}


def _lines(source: str) -> list[str]:
    return source.splitlines(keepends=True)


def recipe_settings(settings: Any) -> dict[str, Any]:
    """A settings dataclass (``EditSettings``) as the plain mapping a recipe keeps."""
    from dataclasses import asdict

    return dict(asdict(settings))


def matches(recipe: Recipe, result: Mapping[str, Any]) -> bool:
    """Whether ``result`` (an export's JSON) is what ``recipe`` computes: an edit's field and new value, with a frontier
    where the recipe runs one and the knockout's positions where it has one (a probe result carries none of them, so any
    is taken)."""
    if recipe.kind == "probe":
        return True
    knocked = (result.get("knockout") or {}).get("positions")
    return (
        result.get("field") == recipe.field
        and result.get("new") == recipe.new
        and ("frontier" in result) == recipe.frontier
        and (list(knocked) if knocked is not None else None) == (list(recipe.knockout) if recipe.kind == "knockout" else None)
    )


__all__ = ["Recipe", "matches", "notebook", "python_literal", "python_string", "recipe_settings", "script_text"]
