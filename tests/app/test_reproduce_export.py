"""Reproducible exports from the app's handlers: the Notes tab's export (an edit, a knockout) and the Probes tab's
write a script and a notebook beside the JSON, and running them gives the JSON's numbers (tiny-qwen2, float32)."""

import json
from pathlib import Path

import nbformat
import plotly.graph_objects as go
import pytest
from nbclient import NotebookClient

from kvscope.app.handlers.common import bundled_scenario_text, export_files
from kvscope.app.handlers.notes import (
    EditInputs,
    edit_recipe,
    frontier_recipe,
    knockout_recipe,
    run_edit,
    run_frontier,
    run_knockout,
    session_result,
)
from kvscope.app.handlers.probes import ProbeCase, probe_recipe, run_probe
from kvscope.app.state import ExportFolder
from tests.engine.test_reproduce import ROOT, numbers_agree, run_script

SCENARIO_NAME, FIELD, VALUE = "pharmacy_prescription", "prescription", "valid"  # recoveries are defined on tiny-qwen2
CHOSEN = ["field_only", "erratum", "field_topk"]
FILES = ["kvscope-notes-figures.html", "kvscope-notes.ipynb", "kvscope-notes.json", "kvscope-notes.py"]


@pytest.fixture
def edited(registry, sessions):
    text = bundled_scenario_text(SCENARIO_NAME)
    view = run_edit(registry, sessions, EditInputs(text, field=FIELD, new=VALUE, strategies=CHOSEN, top_k=4, head=1), session="repro")
    recipe = edit_recipe(
        registry,
        sessions,
        EditInputs(text, field=FIELD, new=VALUE, strategies=CHOSEN, top_k=4, head=1, separately=False, all_positions=True),
        session="repro",
    )
    return view, recipe


def _export(tmp_path: Path, result: dict, recipe, stem: str = "kvscope-notes") -> dict[str, Path]:
    (tmp_path / "exports").mkdir(exist_ok=True)
    folder = ExportFolder(2**23, keep=8, root=tmp_path / "exports")
    paths = export_files(folder, result, [go.Figure()], stem, (), recipe)
    return {Path(path).name: Path(path) for path in paths}


def test_the_notes_export_writes_a_script_that_reproduces_its_json(edited, registry, tmp_path):
    view, recipe = edited
    assert recipe.model == "tiny-qwen2" and recipe.dtype == "float32" and recipe.device == "cpu"
    assert recipe.settings["top_k"] == 4 and recipe.strategies == tuple(CHOSEN) and recipe.head == 1 and recipe.all_positions
    files = _export(tmp_path, view.summary, recipe)
    assert sorted(files) == FILES
    exported = json.loads(files["kvscope-notes.json"].read_text(encoding="utf-8"))
    reproduced = run_script(files["kvscope-notes.py"], tmp_path / "reproduced.json")
    numbers_agree(exported, reproduced)
    strategies = reproduced["strategies"]
    assert all(strategies[name]["recovery"] is not None for name in CHOSEN), "compare defined recoveries"
    assert [strategies[name]["decision"] for name in CHOSEN] == [exported["strategies"][name]["decision"] for name in CHOSEN]


def test_the_exported_notebook_runs_in_a_kernel_and_reproduces_the_json(edited, tmp_path, monkeypatch):
    view, recipe = edited
    files = _export(tmp_path, view.summary, recipe)
    book = nbformat.read(files["kvscope-notes.ipynb"], as_version=4)
    nbformat.validate(book)
    work = tmp_path / "kernel"
    work.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(work)}}).execute()
    numbers_agree(view.summary, json.loads((work / "reproduced.json").read_text(encoding="utf-8")))
    printed = "".join(output.get("text", "") for cell in book.cells for output in cell.get("outputs", []))
    assert view.summary["notes"]["headline"] in printed


def test_an_export_after_edit_frontier_and_knockout_holds_them_all_and_its_script_reproduces_them(edited, sessions, tmp_path):
    view, recipe = edited
    run_frontier(sessions, session="repro")
    _, _, data = run_knockout(sessions, session="repro", positions="", top_k=3)
    knocked = knockout_recipe(frontier_recipe(recipe), data["positions"])
    assert knocked.kind == "knockout" and knocked.frontier and list(knocked.knockout) == data["positions"] and len(data["positions"]) == 3
    result = session_result(sessions, session="repro")
    assert result["knockout"] == data and result["strategies"] == view.summary["strategies"]  # the edit's cards are kept
    assert {point["method"] for point in result["frontier"]["points"]} >= {"field_only", "erratum", "field_topk (causal)"}
    files = _export(tmp_path, result, knocked)
    exported = json.loads(files["kvscope-notes.json"].read_text(encoding="utf-8"))
    assert set(exported) >= {"strategies", "notes", "frontier", "knockout"}
    reproduced = run_script(files["kvscope-notes.py"], tmp_path / "reproduced.json")
    numbers_agree(exported, reproduced)  # the edit, the frontier and the knockout, every number
    assert reproduced["knockout"]["positions"] == data["positions"] and reproduced["strategies"]["erratum"]["recovery"] is not None


def test_a_probe_export_reproduces_the_probe(registry, tmp_path):
    text = bundled_scenario_text(SCENARIO_NAME)
    case = ProbeCase(text, FIELD, VALUE, "suffix")
    _, data = run_probe(registry, case)
    recipe = probe_recipe(registry, case)
    files = _export(tmp_path, data, recipe, "kvscope-probe")
    assert sorted(files) == ["kvscope-probe-figures.html", "kvscope-probe.ipynb", "kvscope-probe.json", "kvscope-probe.py"]
    numbers_agree(json.loads(files["kvscope-probe.json"].read_text()), run_script(files["kvscope-probe.py"], tmp_path / "probe.json"))


def test_an_export_whose_json_is_not_the_recipes_writes_no_script(edited, tmp_path):
    view, recipe = edited
    other = view.summary | {"new": "something else"}
    assert sorted(_export(tmp_path, other, recipe)) == ["kvscope-notes-figures.html", "kvscope-notes.json"]
    assert sorted(_export(tmp_path, view.summary, None)) == ["kvscope-notes-figures.html", "kvscope-notes.json"]
