"""The text of scenarios and skills: ``{field}`` and ``{skill:ID}`` placeholders, brace escapes, TOML strings, the
bundled demos, and which tokens are aggregators."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from kvscope.engine.errors import KVScopeError

DEMOS = Path(__file__).parents[3] / "demos"  # bundled scenarios, skills, images and corpora (data, not code)
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
SKILL_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{skill:([A-Za-z0-9_-]+)\}")  # {{ and }} are escapes, never skills


class ScenarioError(KVScopeError):
    """A scenario file or a rendering request is invalid; the message names the problem."""


def escape_braces(text: str) -> str:
    """Literal text as a template holds it: braces doubled, so neither ``{field}`` nor ``{skill:ID}`` in it expands."""
    return text.replace("{", "{{").replace("}", "}}")


def unescape_braces(template: str) -> str:
    """A template's literal text as written: doubled braces single again (the inverse of :func:`escape_braces`)."""
    return template.replace("{{", "{").replace("}}", "}")


_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quote, backslash and every control character (U+0000–U+001F, U+007F) escaped."""
    escaped = "".join(_TOML_ESCAPES.get(char) or (f"\\u{ord(char):04X}" if char < " " or char == "\x7f" else char) for char in text)
    return f'"{escaped}"'


def bundled_scenarios() -> dict[str, Path]:
    """The demo scenarios shipped in demos/scenarios, by file stem."""
    folder = DEMOS / "scenarios"
    return {path.stem: path for path in sorted(folder.glob("*.toml"))}


def bundled_skills() -> dict[str, Path]:
    """The skill library shipped in demos/skills, by id (file stem)."""
    folder = DEMOS / "skills"
    return {path.stem: path for path in sorted(folder.glob("*.toml"))}


def bundled_logs() -> dict[str, Path]:
    """The demo request logs shipped in demos/logs and its folders (``traffic/``: interleaved sessions), by file stem;
    not ``exports/`` (one log in each observability tool's export format, which the export readers' tests read)."""
    folder = DEMOS / "logs"
    return {path.stem: path for path in sorted(folder.rglob("*.jsonl")) if path.relative_to(folder).parts[0] != "exports"}


def is_aggregator(text: str) -> bool:
    """Whether a token's text is whitespace only or punctuation only (a newline, '.', ':', ')\\n\\n' …)."""
    stripped = text.strip()
    return all(unicodedata.category(char).startswith("P") for char in stripped)


def context_chunks(context: str) -> list[tuple[str, str]]:
    """Split a context at `{skill:ID}` placeholders: ("text", text) and ("skill", id) chunks in order."""
    chunks, position = [], 0
    for match in SKILL_PLACEHOLDER.finditer(context):
        if match.group(1) is None:  # an escaped brace: literal text
            continue
        chunks.append(("text", context[position : match.start()]))
        chunks.append(("skill", match.group(1)))
        position = match.end()
    chunks.append(("text", context[position:]))
    return [(kind, text) for kind, text in chunks if kind == "skill" or text]


def split_template(text: str) -> tuple[list[str], list[str]]:
    """Split a template at `{name}` placeholders: literal texts (one more than names) and placeholder names."""
    texts, names, current, pos = [], [], [], 0
    for match in PLACEHOLDER.finditer(text):
        current.append(text[pos : match.start()])
        pos = match.end()
        if match.group(1) is None:
            current.append(match.group(0)[0])
        else:
            texts.append("".join(current))
            names.append(match.group(1))
            current = []
    current.append(text[pos:])
    texts.append("".join(current))
    return texts, names
