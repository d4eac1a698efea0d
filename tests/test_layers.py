"""The architecture as tests: import-linter's contracts (pyproject.toml) hold, and fail on an injected upward import
(or an app import of an engine submodule, past the engine's public API);
no import circle inside the engine or the benchmarks (type-checking imports included); importing the engine has no side effects;
the tree is formatted and linted by ruff (settings in pyproject.toml)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(root)}
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--no-cache",
            "--config",
            str(root / "pyproject.toml"),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_hold():
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    "module, upward, contract",
    [
        ("kvscope/engine/cache/rope.py", "import kvscope.engine.compose.splice", "engine's own layers"),
        ("kvscope/engine/edit/runs.py", "import kvscope.viz.common", "app -> viz -> engine"),
        ("kvscope/viz/common.py", "import gradio", "only the app imports gradio"),
        ("kvscope/engine/probes/common.py", "import transformers", "transformers is imported by the cache and model layers"),
        ("kvscope/app/tabs/composer.py", "from kvscope.engine.compose.splice import X", "the app imports the engine's public API only"),
        ("kvscope/engine/audit/logs/requests.py", "import kvscope.engine.audit.measure.turn", "the audit's stages in layers"),
        ("kvscope/engine/audit/simulate/caches.py", "import kvscope.engine.audit.scan.traffic_scan", "the audit's stages in layers"),
        ("kvscope/viz/audit.py", "import kvscope.engine.models.gguf", "reach models through LoadedModel"),
    ],
)
def test_an_injected_upward_import_breaks_a_contract(tmp_path, module, upward, contract):
    shutil.copytree(ROOT / "kvscope", tmp_path / "kvscope", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{upward}\n")
    done = _lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout
    report = " ".join(done.stdout.split())  # the report wraps long lines
    assert "1 broken" in report and contract in report.split("Broken contracts", 1)[1], done.stdout
    assert module.removesuffix(".py").replace("/", ".") in report  # it names the importing module


@pytest.mark.parametrize("package", ["kvscope.engine", "benchmarks"])
def test_no_import_circle_in_the_engine_or_the_benchmarks(package):
    graph = grimp.build_graph(package.split(".")[0], exclude_type_checking_imports=False)
    # the engine's root only names the public API (and kvscope's root re-exports it)
    modules = [module for module in graph.modules if module.startswith(f"{package}.")]
    circles = sorted(
        {
            tuple(sorted((a, b)))
            for a in modules
            for b in graph.find_modules_directly_imported_by(a)
            if b in modules and graph.chain_exists(importer=b, imported=a)
        }
    )
    assert circles == []


def test_importing_the_engine_loads_nothing_and_changes_no_process_state():
    code = (
        "import os, sys; before = dict(os.environ); import kvscope.engine as engine; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy imports'; "
        "assert dict(os.environ) == before, 'environment changed'; "
        "assert engine.__all__ == sorted(engine._PUBLIC) and all(hasattr(engine, name) for name in engine.__all__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={key: value for key, value in os.environ.items() if key != "MKL_CBWR"},
    )
    assert done.returncode == 0, done.stderr


def test_the_tree_is_formatted_and_linted():
    for command in (["check", "--quiet"], ["format", "--check", "--quiet"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *command, "kvscope", "benchmarks", "tests", "app.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"ruff {command[0]}: " + done.stdout + done.stderr
