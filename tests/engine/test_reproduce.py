"""Reproducible exports: a recipe as a script and a notebook that use only the public API, carry the scenario
exactly, and give the same numbers when run (a subprocess on tiny-qwen2, float32)."""

import ast
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.edit.strategies import EditSettings
from kvscope.engine.probes.analysis import analyse_edit
from kvscope.engine.reproduce import Recipe, matches, notebook, python_literal, python_string, quoted, recipe_settings, script_text
from kvscope.engine.scenario import Scenario, bundled_scenarios

ROOT = Path(__file__).resolve().parents[2]
NASTY = [
    "",
    "'",
    "''",
    "'''",
    "a'''b''''",
    '"""',
    "\\",
    "back\\slash\\",
    "ends with '",
    "\\'''",
    "x\r\ny\rz",
    "\x00\x1b\x7f\x85\u2028\u2029\ufeff\u200d",
    "\ud800 lone surrogate",
    "emoji \U0001f600 and ünïcödé",
    "tab\there\n",
    "\\N{EM DASH} \\u2014 \\x41",
    'context = """\nSESSION\nstatus: {status}\n"""\n',
]


def _recipe(**changes) -> Recipe:
    base = Recipe(
        kind="edit",
        model="tiny-qwen2",
        dtype="float32",
        device="cpu",
        scenario_toml=bundled_scenarios()["pharmacy_prescription"].read_text(encoding="utf-8"),
        field="prescription",
        new="valid",
        settings=recipe_settings(EditSettings(top_k=4)),
        strategies=("field_only", "erratum", "field_topk"),
        scenario_name="pharmacy_prescription",
    )
    return replace(base, **changes)


@pytest.mark.parametrize("text", NASTY)
def test_strings_round_trip_through_python_source(text):
    for quote in (None, "'", '"'):
        literal = python_string(text, quote)
        assert ast.literal_eval(literal) == text
        assert "\r" not in literal and "\u2028" not in literal
    assert ast.literal_eval(quoted(text)) == text and "\n" not in quoted(text)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(), max_size=60))
def test_any_text_round_trips(text):
    assert ast.literal_eval(python_string(text)) == text
    assert ast.literal_eval(quoted(text)) == text
    compile(f"X = {python_string(text)}\n", "<generated>", "exec")


def test_literals_are_json_like_values_only():
    value = {"a": [1, 2.5, None, True], "b": {"c": "d'\""}, "e": float("inf")}
    assert eval(python_literal(value), {}) == value  # noqa: S307 - our own literal
    with pytest.raises(TypeError, match="cannot write a object"):
        python_literal(object())
    with pytest.raises(TypeError, match="keys must be strings"):
        python_literal({1: 2})
    with pytest.raises(TypeError):
        _recipe(settings={"x": object()})
    with pytest.raises(ValueError, match="unknown recipe kind"):
        _recipe(kind="nope")
    with pytest.raises(ValueError, match="lists the positions"):
        _recipe(kind="knockout")


@pytest.mark.parametrize("kind", ["edit", "knockout", "probe"])
def test_script_and_notebook_use_only_the_public_api_and_carry_everything(kind):
    import kvscope.engine as engine

    extra = {"knockout": {"knockout": (3, 4), "frontier": True}, "probe": {"probe": "suffix", "probe_options": {"k": 2}}}.get(kind, {})
    recipe = _recipe(kind=kind, **extra, scenario_toml="name = 'odd'''\nx = \"\\\\\"\r\n")
    text = script_text(recipe, "kvscope-notes.json")
    tree = ast.parse(text)
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert {node.module for node in imports} == {"kvscope", "pathlib"}
    assert {alias.name for node in imports if node.module == "kvscope" for alias in node.names} <= set(engine.__all__)
    constants = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id.isupper()
    }
    assert constants["SCENARIO_TOML"] == recipe.scenario_toml
    assert constants["MODEL"] == "tiny-qwen2" and constants["DTYPE"] == "float32" and constants["DEVICE"] == "cpu"
    assert constants["SETTINGS"] == dict(recipe.settings) and constants["SETTINGS"]["top_k"] == 4
    assert (constants["FIELD"], constants["NEW"]) == ("prescription", "valid")
    if kind == "probe":
        assert constants["PROBE"] == "suffix" and constants["PROBE_OPTIONS"] == {"k": 2}
    else:
        assert constants["STRATEGIES"] == list(recipe.strategies) and constants["FUSED"] is True
    if kind == "knockout":
        assert constants["KNOCKOUT"] == [3, 4]
    assert "kvscope-notes.json" in ast.get_docstring(tree)
    book = nbformat.from_dict(notebook(recipe, "kvscope-notes.json"))
    nbformat.validate(book)
    code = ["".join(cell.source) for cell in book.cells if cell.cell_type == "code"]
    compile("\n\n".join(code), "<notebook>", "exec")
    assert all(source in text for source in code[1:-1]) and "sys.argv" not in code[-1]  # the script's code, argv aside


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("kind", ["edit", "knockout", "probe"])
def test_the_script_is_clean_python(kind, tmp_path):
    """ruff finds nothing to fix or reformat (long lines aside: the scenario TOML travels verbatim)."""
    trigger = {"probe": "trigger", "probe_options": {"find": "a", "replace": None}}
    extra = {"knockout": {"knockout": (3,), "frontier": True}, "probe": trigger}.get(kind, {})
    script = tmp_path / "exported.py"
    script.write_text(script_text(_recipe(kind=kind, **extra)), encoding="utf-8")
    for command in (["check", "--isolated", "--select", "E,F,W,I", "--ignore", "E501"], ["format", "--isolated", "--check"]):
        done = subprocess.run(["ruff", *command, "--line-length", "140", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_matches_knows_which_result_a_recipe_computes():
    recipe, edit = _recipe(), {"field": "prescription", "new": "valid"}
    assert matches(recipe, edit) and not matches(recipe, edit | {"new": "x"})
    knocked = _recipe(kind="knockout", knockout=(3, 4))
    assert matches(knocked, edit | {"knockout": {"positions": [3, 4]}}) and not matches(knocked, edit | {"knockout": {"positions": [3]}})
    assert not matches(knocked, edit) and not matches(recipe, edit | {"knockout": {"positions": [3, 4]}})
    assert not matches(knocked, {"positions": [3, 4]})  # a knockout alone is not the session's result
    both = _recipe(kind="knockout", knockout=(3, 4), frontier=True)
    knocked_only = edit | {"knockout": {"positions": [3, 4]}}
    assert matches(both, knocked_only | {"frontier": {}}) and not matches(both, knocked_only)


def numbers_agree(expected, actual, path="") -> None:
    """Every value of the export's JSON in the reproduction: numbers within one step of their 4 stored decimals, labels and the rest equal;
    measured timings (ms, timing, rank_ms) aside."""
    if isinstance(expected, dict):
        assert set(expected) == set(actual), path
        for key, value in expected.items():
            if key not in ("ms", "timing", "rank_ms"):
                numbers_agree(value, actual[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(expected) == len(actual), path
        for index, (a, b) in enumerate(zip(expected, actual)):
            numbers_agree(a, b, f"{path}[{index}]")
    elif isinstance(expected, float) and not isinstance(expected, bool):
        assert actual == pytest.approx(expected, abs=1.5e-4), path  # JSON keeps 4 decimals: a last-digit flip at a rounding boundary
    else:
        assert actual == expected, path


def run_script(script: Path, out: Path) -> dict:
    """Run an exported script in a fresh interpreter (the checkout on its path, as a user's would be)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(out)], cwd=script.parent, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


def test_a_script_reproduces_the_edit_it_was_made_from(lm, tmp_path):
    recipe = _recipe()
    scenario = Scenario.from_toml(recipe.scenario_toml)
    stale = run_scenario(lm, scenario, capture_attention=True)  # as the app's baseline
    experiment = EditExperiment(lm, scenario, "prescription", "valid", EditSettings(top_k=4), capture_attention=True, stale=stale)
    expected = json.loads(json.dumps(analyse_edit(experiment, recipe.strategies).as_dict()))
    script = tmp_path / "kvscope-notes.py"
    script.write_text(script_text(recipe, "kvscope-notes.json"), encoding="utf-8")
    reproduced = run_script(script, tmp_path / "reproduced.json")
    numbers_agree(expected, reproduced)
    assert reproduced["strategies"]["field_only"]["recovery"] is not None  # the numbers compared are defined ones
    assert reproduced["strategies"]["field_topk"]["detail"]["k"] == 4
