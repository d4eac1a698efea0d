"""Composing contexts from precompiled skills, and how close splicing gets to a full recompute.

A scenario places skills with ``{skill:ID}`` placeholders. The *recomputed* path prefills every token. The
*spliced* path prefills only the text between skills and splices each skill's stored K/V (keys re-rotated to
their new positions, values unchanged), optionally recomputing the first ``seam`` tokens of each skill
against the real prefix (seam repair) or the top fraction of its most deviating tokens (CacheBlend-style,
ranked against the recomputed cache, so a diagnostic rather than a deployable ranking).
Cost: splice is O(L) per skill instead of O(L·context) attention and MLP work.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from engine.decision import Decision, logit_agreement
from engine.loaded import LoadedModel
from engine.notebook import Notebook, NotebookError
from engine.patching import kv_deviation, kv_relative_deviation
from engine.runs import render_for
from engine.scenario import RenderedPrompt, Scenario, ScenarioError, Skill, bundled_skills

SEAMS = (0, 1, 2, 4, 8, 16, 32)
ADHOC_QUESTION = "Is the information above internally consistent? Answer yes or no."


def replace_context(scenario: Scenario, context: str, skill_ids: Sequence[str], library: Mapping | None = None) -> Scenario:
    """The scenario with a new context that places ``skill_ids`` (loaded from the library); skill fields merged,
    the scenario's own declarations winning."""
    library = bundled_skills() if library is None else library
    unknown = [s for s in skill_ids if s not in library]
    if unknown:
        raise ScenarioError(f"unknown skill {unknown[0]!r}; available: {', '.join(sorted(library))}")
    skills = {**scenario.skills, **{s: Skill.load(library[s]) for s in skill_ids}}
    fields = {**{n: f for s in skills.values() for n, f in s.fields.items()}, **scenario.fields}
    return dataclasses.replace(scenario, context=context, skills=skills, fields=fields)


def literal(text: str | None) -> str:
    """User text placed in a context as written: braces escaped, so neither ``{field}`` nor ``{skill:ID}`` in it
    is expanded."""
    return (text or "").replace("{", "{{").replace("}", "}}").strip()


def compose_scenario(skill_ids: Sequence[str], before: str = "", between: str = "", base: Scenario | None = None,
                     library: Mapping | None = None) -> Scenario:
    """A context of literal text ``before``, the skills (literal text ``between`` them), then ``base``'s context
    (its question and answers too); without ``base``, the skills alone with a generic question."""
    if not skill_ids:
        raise ScenarioError("place at least one skill in the context (drag one from the library)")
    joiner = f"\n\n{literal(between)}\n\n" if literal(between) else "\n\n"
    placed = joiner.join(f"{{skill:{skill_id}}}" for skill_id in skill_ids)
    scenario = base or adhoc_scenario(list(skill_ids), library)
    tail = base.context if base else ""
    return replace_context(scenario, "\n\n".join(part for part in (literal(before), placed, tail) if part), skill_ids, library)


def with_skills(scenario: Scenario, skill_ids: Sequence[str], at: str = "start", library: Mapping | None = None) -> Scenario:
    """The scenario with skills placed before its context (``start``) or after it (``end``)."""
    if at not in ("start", "end"):
        raise ScenarioError(f"--at must be 'start' or 'end', got {at!r}")
    placed = "\n\n".join(f"{{skill:{s}}}" for s in skill_ids)
    context = f"{placed}\n\n{scenario.context}" if at == "start" else f"{scenario.context}\n\n{placed}"
    return replace_context(scenario, context, skill_ids, library)


def skill_of_length(lm: LoadedModel, skill: Skill, tokens: int) -> Skill:
    """``skill`` repeated or cut (at a line break) to about ``tokens`` tokens, as a new skill ``<id>_<tokens>``."""
    text = skill.text
    while len(lm.tokenizer(text, add_special_tokens=False).input_ids) < tokens:
        text += "\n\n" + skill.text
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    cut = lm.tokenizer.decode(ids).rsplit("\n", 1)[0]
    if skill.fields:
        raise ScenarioError(f"skill {skill.id!r} has fields; only field-free skills can be resized")
    return dataclasses.replace(skill, id=f"{skill.id}_{tokens}", text=cut.replace("{", "{{").replace("}", "}}"))


def adhoc_scenario(skill_ids: Sequence[str], library: Mapping | None = None) -> Scenario:
    """A scenario made only of skills, with a generic yes/no question."""
    base = Scenario(
        name="skills: " + ", ".join(skill_ids), description="Skills composed without a scenario.", system=None,
        context="", question=ADHOC_QUESTION, fields={}, answers={"yes": ("yes", "Yes"), "no": ("no", "No")}, expect={},
    )
    if not skill_ids:
        return base
    composed = with_skills(base, skill_ids, "start", library)
    return dataclasses.replace(composed, context=composed.context.strip())


def splice_prompt(
    lm: LoadedModel,
    scenario: Scenario,
    prompt: RenderedPrompt,
    store,
    *,
    seam: int = 0,
    blend: float = 0.0,
    reference: Notebook | None = None,
) -> Notebook:
    """Build the prompt's context with every skill spliced from ``store`` and the rest prefilled."""
    if blend and reference is None:
        raise NotebookError("CacheBlend-style recompute needs the recomputed notebook as reference")
    ids, segments = list(prompt.context_ids), list(prompt.context_segments)
    notebook, cursor = Notebook.empty(lm), 0
    for skill_id, span in sorted(prompt.skill_spans.items(), key=lambda item: item[1].start):
        if span.start > cursor:
            notebook = notebook.append(ids[cursor : span.start], segments[cursor : span.start])
        skill = scenario.skills[skill_id]
        block = store.get(lm, skill, {name: prompt.values[name] for name in skill.fields})
        if block.token_ids.tolist() != ids[span.start : span.end]:
            raise NotebookError(f"skill {skill_id!r} tokenizes differently in this context than when compiled")
        notebook = notebook.splice(block, seam=min(seam, len(block)))
        if blend:
            count = max(1, round(blend * len(block)))
            notebook = notebook.recompute(kv_deviation(notebook, reference, range(span.start, span.end)).top_positions(count))
        cursor = span.end
    if cursor < len(ids):
        notebook = notebook.append(ids[cursor:], segments[cursor:])
    return notebook


@dataclass(frozen=True)
class Recomputed:
    """The full-recompute side of a comparison, reusable while the composed prompt stays the same."""

    notebook: Notebook
    decision: Decision
    ms: float


@dataclass
class Fidelity:
    """Spliced vs recomputed: next-token logits, decision, K/V deviation and time to first token."""

    scenario: str
    skills: list[str]
    seam: int
    blend: float
    context_tokens: int
    skill_tokens: int
    agreement: dict[str, float]
    decision_agree: bool
    spliced: Decision
    recomputed: Decision
    deviation: torch.Tensor  # (layers, context tokens)
    ttft_ms: dict[str, float]
    compile_ms: float
    reference_reused: bool = False  # the recomputed side (and its TTFT) came from an earlier comparison

    def as_dict(self) -> dict:
        return {
            "scenario": self.scenario,
            "skills": self.skills,
            "seam": self.seam,
            "blend": self.blend,
            "context_tokens": self.context_tokens,
            "skill_tokens": self.skill_tokens,
            **{key: round(value, 6) for key, value in self.agreement.items()},
            "decision_agree": self.decision_agree,
            "spliced": self.spliced.as_dict(),
            "recomputed": self.recomputed.as_dict(),
            "max_kv_deviation": round(float(self.deviation.max()), 6),
            "ttft_ms": {key: round(value, 1) for key, value in self.ttft_ms.items()},
            "speedup": round(self.ttft_ms["full"] / self.ttft_ms["splice"], 2),
            "compile_ms": round(self.compile_ms, 1),
            "reference_reused": self.reference_reused,
        }


def _timed(function: Callable[[], tuple[Notebook, Decision]], reps: int) -> tuple[tuple[Notebook, Decision], float]:
    """The last result and the median wall time in ms; with several reps the first is a warm-up."""
    times, result = [], None
    for _ in range(reps):
        started = time.perf_counter()
        result = function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return result, statistics.median(times[1:] if reps > 1 else times)


def compare(
    lm: LoadedModel,
    scenario: Scenario,
    store,
    *,
    seam: int = 0,
    blend: float = 0.0,
    values: Mapping[str, str] | None = None,
    reps: int = 1,
    references: MutableMapping[tuple, Recomputed] | None = None,
) -> Fidelity:
    """Splice vs full recompute of the scenario, side by side in one run (skills compiled first).

    ``references`` keeps recomputed sides by prompt (e.g. across seam or blend changes in the app): a
    prompt seen before reuses its recomputed cache, decision and measured TTFT.
    """
    if not scenario.skills:
        raise ScenarioError(f"scenario {scenario.name!r} places no skills (use {{skill:ID}} or --skills)")
    if seam < 0 or not 0.0 <= blend <= 1.0:
        raise ScenarioError(f"seam must be ≥ 0 and blend within [0, 1], got seam={seam}, blend={blend}")
    prompt = render_for(lm, scenario, values)
    started = time.perf_counter()
    for skill in scenario.skills.values():
        store.get(lm, skill, {name: prompt.values[name] for name in skill.fields})
    compile_ms = (time.perf_counter() - started) * 1000
    answers = scenario.answers

    def recompute_and_read() -> tuple[Notebook, Decision]:
        notebook = Notebook.from_prompt(lm, prompt)
        return notebook, notebook.read_prompt(prompt, answer_texts=answers)

    key = (lm.fingerprint, tuple(prompt.context_ids), tuple(prompt.decode_ids), tuple(prompt.answer_ids.items()))
    cached = None if references is None else references.get(key)
    reused = cached is not None
    if cached is None:
        (reference, recomputed), full_ms = _timed(recompute_and_read, reps)
        cached = Recomputed(reference, recomputed, full_ms)
        if references is not None:
            references[key] = cached
    reference, recomputed, full_ms = cached.notebook, cached.decision, cached.ms

    def splice_and_read() -> tuple[Notebook, Decision]:
        notebook = splice_prompt(lm, scenario, prompt, store, seam=seam, blend=blend, reference=reference)
        return notebook, notebook.read_prompt(prompt, answer_texts=answers)

    (spliced_notebook, spliced), splice_ms = _timed(splice_and_read, reps)
    return Fidelity(
        scenario=scenario.name,
        skills=list(scenario.skills),
        seam=seam,
        blend=blend,
        context_tokens=len(prompt.context_ids),
        skill_tokens=sum(len(span) for span in prompt.skill_spans.values()),
        agreement=logit_agreement(spliced.next_token_logits, recomputed.next_token_logits),
        decision_agree=spliced.label == recomputed.label,
        spliced=spliced,
        recomputed=recomputed,
        deviation=kv_relative_deviation(spliced_notebook, reference),
        ttft_ms={"splice": splice_ms, "full": full_ms},
        compile_ms=compile_ms,
        reference_reused=reused,
    )
