"""docs/quickstart.ipynb runs top to bottom in a real kernel (nbclient + ipykernel) on a tiny model, so it never rots:
every code cell runs without an error, the rich displays and figures come out, and the printed numbers are there."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "quickstart.ipynb"


@pytest.fixture(scope="module")
def executed(monkeypatch_module) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    return notebook


@pytest.fixture(scope="module")
def monkeypatch_module():
    """The kernel inherits this environment: the tiny model, and the checkout importable (as after ``pip install -e .``)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("KVSCOPE_QUICKSTART_MODEL", "tiny-qwen2")
    patch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    yield patch
    patch.undo()


def _texts(cell, mime: str) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text if mime == "text/plain" else "")
        elif mime in output.get("data", {}):
            parts.append(output.data[mime])
    return "".join(parts)


def test_every_cell_runs_and_shows_its_results(executed):
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code)
    assert not [output for cell in code for output in cell.outputs if output.output_type == "error"]
    printed = "".join(_texts(cell, "text/plain") for cell in code)
    assert "decision " in printed and "margin " in printed and "Notes " in printed
    assert "transformers and KVScope continue alike: True" in printed
    html = [_texts(cell, "text/html") for cell in code]
    assert any("Notebook" in page and "segments" in page for page in html)  # the notebook's rich display
    assert any("field_only" in page and "recovery" in page for page in html)  # the report's strategy cards
    assert any("cosine" in page and "TTFT" in page for page in html)  # the composition's fidelity
    figures = [cell for cell in code if any("application/vnd.plotly.v1+json" in output.get("data", {}) for output in cell.outputs)]
    assert len(figures) == 3  # strategies, notes map, next-token bars: inline plotly figures
