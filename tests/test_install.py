"""``pip install -e .`` in a fresh virtualenv gives the console scripts ``kvscope`` and ``kvscope-app`` and the
``kvscope`` import name (the only top-level one: its layers are ``kvscope.engine``, ``kvscope.viz`` and
``kvscope.app``), working from outside the checkout.

The virtualenv sees this machine's site-packages (``--system-site-packages``), so the declared dependency ranges
must admit the pinned, installed set: pip resolves them without downloading anything, and fails if one does not fit.
"""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvscope.engine as engine

ROOT = Path(__file__).resolve().parents[1]
REFUND = ROOT / "demos" / "scenarios" / "refund_gate.toml"


def _environment() -> dict[str, str]:
    """This environment without anything that points Python at the checkout."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("install") / "venv"
    # --without-pip: the venv's own bundled pip and setuptools (older, no bdist_wheel) would shadow this machine's,
    # and nothing can be downloaded; this machine's pip then installs into the venv.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True, timeout=120)
    done = subprocess.run(
        # setuptools comes from this machine (no isolated build environment to download); the dependencies resolve
        # against the installed set; --no-index: nothing may come from an index
        [str(path / "bin" / "python"), "-m", "pip", "install", "--no-index", "--no-build-isolation", "--quiet", "-e", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_environment(),
        cwd=path.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return path


def _run(venv: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / command[0]), *command[1:]], capture_output=True, text=True, timeout=300, env=_environment(), cwd=cwd
    )


def test_the_cli_edits_a_scenario_from_outside_the_checkout(venv, tmp_path):
    done = _run(
        venv,
        "kvscope",
        "edit",
        "--model",
        "tiny-qwen2",
        "--scenario",
        str(REFUND),
        "--strategies",
        "field_only,erratum",
        "--json",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout
    report = json.loads(lines[0])
    assert set(report["strategies"]) == {"field_only", "erratum"} and report["field"] == "refund_eligible"
    assert report["strategies"]["erratum"]["decision"] in ("yes", "no") and "Notes" in report["notes"]["headline"]
    failed = _run(venv, "kvscope", "decide", "--model", "tiny-qwen2", "--scenario", "missing.toml", "--json", cwd=tmp_path)
    assert failed.returncode == 2 and "missing.toml" in json.loads(failed.stdout)["error"]  # the exit code reaches the shell


def test_the_kvscope_import_name_and_the_app_script(venv, tmp_path):
    code = (
        "import sys, kvscope; import kvscope.engine as engine; assert 'torch' not in sys.modules, 'importing kvscope loads torch'; "
        "from kvscope import load_model, Scenario; "
        "assert kvscope.__all__ == kvscope.engine.__all__ and load_model is kvscope.engine.load_model; "
        "print(kvscope.__file__); print(Scenario.load.__qualname__)"
    )
    done = _run(venv, "python", "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(ROOT / "kvscope" / "__init__.py"), "Scenario.load"]
    found = "import importlib.util as u; print([n for n in ('engine', 'viz', 'app') if u.find_spec(n)])"
    generic = _run(venv, "python", "-c", found, cwd=tmp_path)
    assert generic.stdout.strip() == "[]", generic.stdout + generic.stderr  # one top-level name installed: kvscope
    app = _run(venv, "kvscope-app", "--help", cwd=tmp_path)
    assert app.returncode == 0 and "--public" in app.stdout and "kvscope-app" in app.stdout, app.stderr


def test_the_declared_dependencies_admit_the_pinned_set():
    """Every runtime requirement of requirements.txt is declared (extras for the app, tests and serving), as a
    range its pinned version satisfies; kvscope re-exports exactly the engine's public API."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(text).name.lower(): Requirement(text) for text in project["dependencies"]}
    for extra in ("app", "test", "serving"):
        declared |= {Requirement(text).name.lower(): Requirement(text) for text in project["optional-dependencies"][extra]}
    for file in ("requirements.txt", "requirements-test.txt", "requirements-serving.txt"):
        for line in (ROOT / file).read_text().splitlines():
            line = line.split("#")[0].strip()
            if not line or line.startswith("-r"):
                continue
            pinned = Requirement(line)
            assert pinned.name.lower() in declared, f"{pinned.name} ({file}) is not declared in pyproject.toml"
            for spec in pinned.specifier:
                if spec.operator == "==":
                    assert declared[pinned.name.lower()].specifier.contains(spec.version, prereleases=True), (
                        pinned,
                        declared[pinned.name.lower()],
                    )
    assert project["scripts"] == {"kvscope": "kvscope.engine.cli:main", "kvscope-app": "kvscope.app.main:main"}
    import kvscope

    assert kvscope.__all__ == engine.__all__ and all(
        getattr(kvscope, name) is getattr(engine, name) for name in ("Scenario", "KVScopeError")
    )
