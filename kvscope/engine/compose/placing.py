"""Where skills go in a scenario's text: a context of literal text and ``{skill:ID}`` placeholders (the Composer's),
skills placed at the start, after the fields or at the end of a scenario (the N-skill study's), a skill resized to a
token count, and a scenario made of skills alone with a generic question."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.scenario import Scenario, ScenarioError, Skill, bundled_skills, escape_braces

ADHOC_QUESTION = "Is the information above internally consistent? Answer yes or no."


def replace_context(scenario: Scenario, context: str, skill_ids: Sequence[str], library: Mapping | None = None) -> Scenario:
    """The scenario with a new context that places ``skill_ids`` (from the library: skill file paths by id, or
    skills themselves, e.g. one made by :func:`skill_of_length`); skill fields merged, the scenario's own
    declarations winning."""
    library = bundled_skills() if library is None else library
    unknown = [s for s in skill_ids if s not in library]
    if unknown:
        raise ScenarioError(f"unknown skill {unknown[0]!r}; available: {', '.join(sorted(library))}")
    loaded = {s: library[s] if isinstance(library[s], Skill) else Skill.load(library[s]) for s in skill_ids}
    skills = {**scenario.skills, **loaded}
    fields = {**{n: f for s in skills.values() for n, f in s.fields.items()}, **scenario.fields}
    return dataclasses.replace(scenario, context=context, skills=skills, fields=fields)


def literal(text: str | None) -> str:
    """User text placed in a context as written: braces escaped, so neither ``{field}`` nor ``{skill:ID}`` in it
    is expanded."""
    return escape_braces(text or "").strip()


def compose_scenario(
    skill_ids: Sequence[str], before: str = "", between: str = "", base: Scenario | None = None, library: Mapping | None = None
) -> Scenario:
    """A context of literal text ``before``, the skills (literal text ``between`` them), then ``base``'s context
    (its question and answers too); without ``base``, the skills alone with a generic question. A ``base`` that
    places skills itself may stand alone."""
    placed_by_base = [s for s in skill_ids if base is not None and s in base.skills]
    if placed_by_base:
        raise ScenarioError(f"skill {placed_by_base[0]!r} is already placed by scenario {base.name!r}; remove it from the context")
    if not skill_ids:
        if base is not None and base.skills:
            return replace_context(base, "\n\n".join(part for part in (literal(before), base.context) if part), [], library)
        raise ScenarioError("place at least one skill in the context (drag one from the library), or choose a scenario that places skills")
    joiner = f"\n\n{literal(between)}\n\n" if literal(between) else "\n\n"
    placed = joiner.join(f"{{skill:{skill_id}}}" for skill_id in skill_ids)
    scenario = base or adhoc_scenario(list(skill_ids), library)
    tail = base.context if base else ""
    return replace_context(scenario, "\n\n".join(part for part in (literal(before), placed, tail) if part), skill_ids, library)


PLACEMENTS = ("start", "after_fields", "end")


def with_skills(scenario: Scenario, skill_ids: Sequence[str], at: str = "start", library: Mapping | None = None) -> Scenario:
    """The scenario with skills placed before its context (``start``), after the paragraph holding its last
    field (``after_fields``: between the fields and the rules that read them) or after its context (``end``)."""
    if at not in PLACEMENTS:
        raise ScenarioError(f"--at must be one of {', '.join(PLACEMENTS)}, got {at!r}")
    placed = "\n\n".join(f"{{skill:{s}}}" for s in skill_ids)
    if at == "start":
        context = f"{placed}\n\n{scenario.context}"
    elif at == "end":
        context = f"{scenario.context}\n\n{placed}"
    else:
        context = _after_fields(scenario, placed)
    return replace_context(scenario, context, skill_ids, library)


def _after_fields(scenario: Scenario, placed: str) -> str:
    """The context with ``placed`` inserted at the first paragraph break after the last field placeholder."""
    ends = [
        match.end() for name in scenario.fields for match in re.finditer(r"(?<!\{)\{" + re.escape(name) + r"\}(?!\})", scenario.context)
    ]
    if not ends:
        raise ScenarioError(f"scenario {scenario.name!r} has no field in its context to place skills after")
    cut = scenario.context.find("\n\n", max(ends))
    if cut < 0:
        raise ScenarioError(
            f"scenario {scenario.name!r} has no paragraph break (blank line) after its last field; place the skills at the start or the end"
        )
    return f"{scenario.context[:cut]}\n\n{placed}{scenario.context[cut:]}"


def skill_of_length(lm: LoadedModel, skill: Skill, tokens: int) -> Skill:
    """``skill`` repeated or cut (at a line break) to about ``tokens`` tokens, as a new skill ``<id>_<tokens>``."""
    text = skill.text
    while len(lm.tokenizer(text, add_special_tokens=False).input_ids) < tokens:
        text += "\n\n" + skill.text
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    cut = lm.tokenizer.decode(ids).rsplit("\n", 1)[0]
    if skill.fields:
        raise ScenarioError(f"skill {skill.id!r} has fields; only field-free skills can be resized")
    return dataclasses.replace(skill, id=f"{skill.id}_{tokens}", text=escape_braces(cut))


def adhoc_scenario(skill_ids: Sequence[str], library: Mapping | None = None) -> Scenario:
    """A scenario made only of skills, with a generic yes/no question."""
    base = Scenario(
        name="skills: " + ", ".join(skill_ids),
        description="Skills composed without a scenario.",
        system=None,
        context="",
        question=ADHOC_QUESTION,
        fields={},
        answers={"yes": ("yes", "Yes"), "no": ("no", "No")},
        expect={},
    )
    if not skill_ids:
        return base
    composed = with_skills(base, skill_ids, "start", library)
    return dataclasses.replace(composed, context=composed.context.strip())
