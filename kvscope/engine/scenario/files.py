"""Scenario and skill files (TOML): parsed, validated and written back. The format is documented in docs/scenarios.md."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

from kvscope.engine.scenario.text import ScenarioError, bundled_skills, context_chunks, split_template, toml_string

_SKILL_KEYS = ("title", "description", "text", "fields")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOP_KEYS = ("name", "description", "system", "context", "question", "fields", "answers", "expect")
_REQUIRED_KEYS = ("name", "context", "question", "answers")
_FIELD_KEYS = ("old", "new", "values")


@dataclass(frozen=True)
class Field:
    """A mutable field: its old and new value and further values for probes (old and new first)."""

    name: str
    old: str
    new: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Scenario:
    """A parsed, validated scenario file."""

    name: str
    description: str
    system: str | None
    context: str
    question: str
    fields: dict[str, Field]
    answers: dict[str, tuple[str, ...]]
    expect: dict[str, str]
    source: str | None = None
    skills: dict[str, "Skill"] = dataclass_field(default_factory=dict)  # {skill:ID} blocks used by the context

    @classmethod
    def from_toml(cls, text: str, source: str | None = None, skills: Mapping[str, Path] | None = None) -> Scenario:
        """Parse and validate scenario TOML; `source` (a path) prefixes error messages.

        `{skill:ID}` placeholders resolve against `skills` (id -> file), by default the bundled library.
        """
        where = f"{source}: " if source else ""
        try:
            return _parse(_toml(text), source, bundled_skills() if skills is None else skills)
        except ScenarioError as e:
            raise ScenarioError(f"{where}{e}") from None

    @classmethod
    def load(cls, path: str | Path, skills: Mapping[str, Path] | None = None) -> Scenario:
        """Read and parse a scenario file."""
        return cls.from_toml(_read(path, "scenario"), source=str(path), skills=skills)

    def field(self, name: str | None = None) -> Field:
        """The named field, or the first one declared."""
        if name is None:
            return next(iter(self.fields.values()))
        if name not in self.fields:
            raise ScenarioError(f"unknown field {name!r}; this scenario has: {', '.join(self.fields)}")
        return self.fields[name]

    def values_with(self, **overrides: str) -> dict[str, str]:
        """Every field's old value, with `overrides` applied."""
        values = {name: f.old for name, f in self.fields.items()}
        for name, value in overrides.items():
            self.field(name)
            values[name] = _check_value(name, value)
        return values

    def to_toml(self) -> str:
        """The scenario as a file :meth:`from_toml` reads back equal (skills stay ``{skill:ID}`` placeholders,
        resolved against the library when read; every field is declared, a skill's own ones included)."""
        lines = [f"{key} = {toml_string(value)}" for key, value in self._top_level() if value is not None]
        for name, spec in self.fields.items():
            lines += ["", f"[fields.{name}]", f"old = {toml_string(spec.old)}", f"new = {toml_string(spec.new)}"]
            if spec.values[2:]:
                lines.append(f"values = [{', '.join(toml_string(value) for value in spec.values[2:])}]")
        lines += [
            "",
            "[answers]",
            *(f"{toml_string(label)} = [{', '.join(map(toml_string, surfaces))}]" for label, surfaces in self.answers.items()),
        ]
        if self.expect:
            lines += ["", "[expect]", *(f"{toml_string(value)} = {toml_string(label)}" for value, label in self.expect.items())]
        return "\n".join(lines) + "\n"

    def _top_level(self) -> list[tuple[str, str | None]]:
        return [
            ("name", self.name),
            ("description", self.description or None),
            ("system", self.system),
            ("context", self.context),
            ("question", self.question),
        ]


@dataclass(frozen=True)
class Skill:
    """A reusable text block (policy, tool specs, fact sheet...) whose K/V can be computed once and spliced."""

    id: str
    title: str
    description: str
    text: str
    fields: dict[str, Field]
    source: str | None = None

    @classmethod
    def load(cls, path: str | Path) -> "Skill":
        """Read and validate a skill file (TOML: title, description, text, optional [fields])."""
        path = Path(path)
        try:
            return _parse_skill(_toml(_read(path, "skill")), path.stem, str(path))
        except ScenarioError as e:
            raise ScenarioError(f"{path}: {e}") from None


def _toml(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"TOML syntax error: {e}") from e


def _read(path: str | Path, kind: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ScenarioError(f"cannot read {kind} file {path}: {e}") from e


def _resolve_skills(context: str, library: Mapping[str, Path]) -> dict[str, Skill]:
    """Load every skill the context names, once each."""
    ids = [text for kind, text in context_chunks(context) if kind == "skill"]
    skills = {}
    for skill_id in ids:
        if ids.count(skill_id) > 1:
            raise ScenarioError(f"skill {skill_id!r} is placed {ids.count(skill_id)} times; each skill may appear once")
        if skill_id not in library:
            raise ScenarioError(f"unknown skill {skill_id!r}; available: {', '.join(sorted(library)) or 'none'}")
        skills[skill_id] = Skill.load(library[skill_id])
    return skills


def _parse_skill(data: dict[str, Any], skill_id: str, source: str | None) -> Skill:
    """Validate a skill document."""
    unknown = [key for key in data if key not in _SKILL_KEYS]
    if unknown:
        raise ScenarioError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(_SKILL_KEYS)}")
    text = _text(data, "text", required=True)
    if text is None:
        raise ScenarioError("missing required key 'text'")
    fields = _parse_fields(data["fields"]) if "fields" in data else {}
    names = split_template(text)[1]
    _check_placeholders(names, fields, "the skill text")
    return Skill(skill_id, _text(data, "title") or skill_id, _text(data, "description") or "", text, fields, source)


def _check_placeholders(names: list[str], fields: Mapping[str, Field], where: str) -> None:
    """Every placeholder declared and used once; every declared field used."""
    for placeholder in names:
        if placeholder not in fields:
            raise ScenarioError(
                f"{where} uses {{{placeholder}}} but no field {placeholder!r} is declared "
                f"(add a [fields.{placeholder}] table, or write {{{{{placeholder}}}}} for literal braces)"
            )
        if names.count(placeholder) > 1:
            raise ScenarioError(
                f"placeholder {{{placeholder}}} occurs {names.count(placeholder)} times in {where}; each field may appear once"
            )
    for field_name in fields:
        if field_name not in names:
            raise ScenarioError(f"field {field_name!r} is declared but {{{field_name}}} is not in {where}")


def _parse(data: dict[str, Any], source: str | None, library: Mapping[str, Path]) -> Scenario:
    """Validate the decoded TOML document and build the Scenario."""
    unknown = [key for key in data if key not in _TOP_KEYS]
    if unknown:
        raise ScenarioError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(_TOP_KEYS)}")
    for key in _REQUIRED_KEYS:
        if key not in data:
            raise ScenarioError(f"missing required key {key!r}")
    name = _text(data, "name", required=True)
    context = _text(data, "context", required=True)
    question = _text(data, "question", required=True)
    description = _text(data, "description") or ""
    system = _text(data, "system") or None

    skills = _resolve_skills(context, library)
    fields = _parse_fields(data["fields"]) if "fields" in data else {}
    for skill in skills.values():
        fields = {**skill.fields, **fields}  # the scenario's own declaration wins
    if not fields:
        raise ScenarioError("missing required key 'fields' (declare a [fields.NAME] table, or use a skill that declares one)")
    names = [name for kind, text in context_chunks(context) for name in split_template(skills[text].text if kind == "skill" else text)[1]]
    _check_placeholders(names, fields, "the context")
    for key, text in (("question", question), ("system", system or "")):
        used = [n for n in split_template(text)[1] if n in fields]
        if used:
            raise ScenarioError(f"{{{used[0]}}} appears in {key!r}; fields may only appear in the context")

    answers = _parse_answers(data["answers"])
    expect = _parse_expect(data.get("expect", {}), fields, answers)
    return Scenario(
        name=name,
        description=description,
        system=system,
        context=context,
        question=question,
        fields=fields,
        answers=answers,
        expect=expect,
        source=source,
        skills=skills,
    )


def _text(data: dict[str, Any], key: str, *, required: bool = False) -> str | None:
    """A string value with surrounding whitespace removed; None when absent."""
    if key not in data:
        return None
    value = data[key]
    if not isinstance(value, str):
        raise ScenarioError(f"{key!r} must be a string, not {type(value).__name__}")
    value = value.strip()
    if required and not value:
        raise ScenarioError(f"{key!r} is empty")
    return value


def _parse_fields(table: Any) -> dict[str, Field]:
    """The [fields.NAME] tables, in file order."""
    if not isinstance(table, dict) or not table:
        raise ScenarioError("'fields' must declare at least one field as a [fields.NAME] table")
    fields = {}
    for name, spec in table.items():
        if not _IDENTIFIER.fullmatch(name):
            raise ScenarioError(f"field name {name!r} is not an identifier (letters, digits, _; no leading digit)")
        if not isinstance(spec, dict):
            raise ScenarioError(f"field {name!r} must be a table with 'old' and 'new'")
        unknown = [key for key in spec if key not in _FIELD_KEYS]
        if unknown:
            raise ScenarioError(f"field {name!r}: unknown key {unknown[0]!r}; allowed: {', '.join(_FIELD_KEYS)}")
        for key in ("old", "new"):
            if key not in spec:
                raise ScenarioError(f"field {name!r}: missing required key {key!r}")
        old, new = _check_value(name, spec["old"]), _check_value(name, spec["new"])
        if old == new:
            raise ScenarioError(f"field {name!r}: 'new' must differ from 'old' (both {old!r})")
        more = spec.get("values", [])
        if not isinstance(more, list):
            raise ScenarioError(f"field {name!r}: 'values' must be a list of strings")
        values = tuple(dict.fromkeys([old, new, *(_check_value(name, v) for v in more)]))
        fields[name] = Field(name=name, old=old, new=new, values=values)
    return fields


def _check_value(field: str, value: Any) -> str:
    """A field value: a non-empty string without braces."""
    if not isinstance(value, str):
        raise ScenarioError(f"field {field!r}: value {value!r} must be a string, not {type(value).__name__}")
    if not value:
        raise ScenarioError(f"field {field!r}: values must not be empty")
    if "{" in value or "}" in value:
        raise ScenarioError(f"field {field!r}: value {value!r} must not contain '{{' or '}}'")
    return value


def _parse_answers(table: Any) -> dict[str, tuple[str, ...]]:
    """The [answers] table: label -> surface strings (a string or a list of strings)."""
    if not isinstance(table, dict):
        raise ScenarioError("'answers' must be a table: label = [surface strings]")
    answers: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for label, surfaces in table.items():
        surfaces = [surfaces] if isinstance(surfaces, str) else surfaces
        if not isinstance(surfaces, list) or not surfaces:
            raise ScenarioError(f"answer label {label!r} needs a string or a non-empty list of strings")
        for surface in surfaces:
            if not isinstance(surface, str) or not surface.strip():
                raise ScenarioError(f"answer label {label!r}: {surface!r} is not a non-blank string")
            if surface in seen and seen[surface] != label:
                raise ScenarioError(f"answer {surface!r} is listed under both {seen[surface]!r} and {label!r}")
            seen[surface] = label
        answers[label] = tuple(dict.fromkeys(surfaces))
    if len(answers) < 2:
        raise ScenarioError(f"'answers' needs at least two labels to compare, got {len(answers)}")
    return answers


def _parse_expect(table: Any, fields: dict[str, Field], answers: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """The optional [expect] table: field value -> answer label."""
    if not isinstance(table, dict):
        raise ScenarioError("'expect' must be a table: value = \"label\"")
    known_values = {v for f in fields.values() for v in f.values}
    for value, label in table.items():
        if not isinstance(label, str) or label not in answers:
            raise ScenarioError(f"expect[{value!r}] names unknown answer label {label!r}; labels: {', '.join(answers)}")
        if value not in known_values:
            raise ScenarioError(f"expect names value {value!r}, which no field lists")
    return dict(table)
