"""The README is a front page that stays true: it is short, its commands exist (modules import, CLI verbs and flags
parse, scripts and files are there), and every relative link in it and in docs/ reaches a file and heading. The
engine page's Python examples use only the public API, and they run (on a tiny model here). Nothing loads a model
except the examples."""

import contextlib
import importlib.util
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

import kvscope.engine as engine
from kvscope.engine.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
EXAMPLE_PAGES = (README, ROOT / "docs" / "engine.md")  # where the Python examples live
MAX_README_LINES = 220

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
MODULE = re.compile(r"python -m ([A-Za-z_][\w.]*)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _fenced(text: str, languages: tuple[str, ...]) -> list[str]:
    return [body for language, body in FENCE.findall(text) if language in languages]


def _prose(text: str) -> str:
    """The text outside code blocks and inline code, where a link is a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", _text(path))):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _commands(text: str) -> list[list[str]]:
    """Each shell command of the bash blocks, continuation lines joined, comments dropped, split into words."""
    commands = []
    for block in _fenced(text, ("bash", "sh")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(words)
    return commands


def _engine_argv(words: list[str]) -> list[str] | None:
    """The CLI arguments of `python -m kvscope ...` or `kvscope ...`, else None."""
    if words[:3] == ["python", "-m", "kvscope"]:
        return words[3:]
    if words[0] == "kvscope":
        return words[1:]
    return None


def _parse(argv: list[str]) -> int:
    """Parse CLI arguments as `kvscope` would, running nothing: 0 when they parse (or --help printed), else argparse's code."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as stop:
            return stop.code or 0
    return 0


def test_the_readme_is_a_front_page():
    lines = _text(README).splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
    assert lines[0] == "---" and "app_file: app.py" in lines[: lines.index("---", 1)], "the Spaces front matter opens the README"


def test_the_test_command_is_the_one_ci_runs():
    readme_commands = [words for words in _commands(_text(README)) if words[:2] == ["bash", "scripts/test.sh"]]
    assert readme_commands, "the README shows `bash scripts/test.sh`"
    assert "bash scripts/test.sh" in _text(ROOT / ".ci" / "run")


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in LINK.findall(_prose(_text(page))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if ROOT not in linked.parents or not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, broken


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_python_module_shown_exists(page: Path):
    modules = set(MODULE.findall(_text(page)))
    assert page != README or modules, "the README shows how to run a module"
    missing = sorted(module for module in modules if importlib.util.find_spec(module) is None)
    assert not missing, f"{page.name} shows `python -m` of modules that do not exist: {missing}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda path: path.relative_to(ROOT).as_posix())
def test_every_cli_command_shown_parses(page: Path):
    commands = [argv for argv in map(_engine_argv, _commands(_text(page))) if argv is not None]
    assert page != README or commands, "the README shows the CLI"
    for argv in commands:
        assert _parse([argv[0], "--help"]) == 0, f"{page.name}: no CLI verb {argv[0]!r}"
        assert _parse(argv) == 0, f"{page.name}: the CLI does not accept {shlex.join(argv)}"


def test_the_readme_scripts_and_files_exist():
    scripts = tomllib.loads(_text(ROOT / "pyproject.toml"))["project"]["scripts"]
    for words in _commands(_text(README)):
        if words[0] in ("kvscope", "kvscope-app"):
            assert words[0] in scripts, f"{words[0]} is not a console script in pyproject.toml"
        paths = [word for word in words if re.fullmatch(r"[\w./-]+\.(sh|py|txt|toml|jsonl)", word)]
        paths += [words[index + 1] for index, word in enumerate(words[:-1]) if word == "-r"]
        for path in paths:
            assert (ROOT / path).exists(), f"README: {shlex.join(words)} names {path}, which does not exist"


def test_the_app_options_shown_exist(capsys):
    from kvscope.app.main import main

    flags = {word for words in _commands(_text(README)) if words[0] == "kvscope-app" for word in words[1:]}
    assert flags, "the README shows kvscope-app"
    with pytest.raises(SystemExit) as stop:
        main(["--help"])  # parsed before gradio or a model is touched
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in flags), (flags, shown)


def _python_examples() -> list[tuple[Path, str]]:
    return [(page, block) for page in EXAMPLE_PAGES for block in _fenced(_text(page), ("python",))]


def test_examples_import_only_the_public_api():
    imports = [
        line for _, block in _python_examples() for line in block.splitlines() if line.startswith(("from kvscope", "import kvscope"))
    ]
    assert imports, "the engine page has a Python example"
    for line in imports:
        assert line.startswith("from kvscope import "), line
        names = {name.strip() for name in line.removeprefix("from kvscope import ").split(",")}
        assert names <= set(engine.__all__), line


def test_examples_run(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for page, block in _python_examples():
        exec(compile(block.replace('load_model("embedded")', 'load_model("tiny-qwen2")'), page.name, "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"-?\d+\.\d+ -?\d+\.\d+", printed) and "Notes" in printed
