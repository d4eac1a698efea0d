"""The README's Python examples use only the engine's public API, and they run (on a tiny model here)."""

import re
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)


def test_examples_import_only_the_public_api():
    imports = [line for block in BLOCKS for line in block.splitlines() if line.startswith(("from engine", "import engine"))]
    assert imports, "the README has a Python example"
    for line in imports:
        assert line.startswith("from engine import "), line
        names = {name.strip() for name in line.removeprefix("from engine import ").split(",")}
        assert names <= set(engine.__all__), line


def test_examples_run(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for block in BLOCKS:
        exec(compile(block.replace('load_model("embedded")', 'load_model("tiny-qwen2")'), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"-?\d+\.\d+ -?\d+\.\d+", printed) and "Notes" in printed
