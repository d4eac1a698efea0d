"""Composing contexts from precompiled skills, and how close splicing gets to a full recompute.

A scenario places skills with ``{skill:ID}`` placeholders. The *recomputed* path prefills every token. The
*spliced* path prefills only the text between skills and splices each skill's stored K/V (keys re-rotated to
their new positions, values unchanged). A :class:`Remedy` says how the spliced skills are repaired: skills
compiled after the target's own system prompt (``prefix``), the first ``seam`` tokens of each skill recomputed
against the real prefix (seam repair), its last ``tail`` tokens recomputed against their real predecessors (where
the paper puts a block's notes; a training-free cousin of KVLink's link tokens), and a further selection of skill
tokens recomputed — every aggregator token (punctuation and line breaks, where models write notes), or the top
``fraction`` of a ranking:
``blend`` ranks by how far a token's spliced K/V at layer 1 sit from a fresh prefill run through that layer
only (CacheBlend's selection: a server can run it), ``query`` by the attention the question pays each spliced
token when it reads the plain splice (query-aware selection in the manner of InfoFlow-KV; it needs only the
splice, so a server can run it too), ``deviation`` by K/V deviation from the full recompute at every layer and
``causal`` by causal effect on the decision (attribution patching). These last two need the full recompute they
are compared with: diagnostics of how much a perfect ranking buys, not remedies a server could run. ``cover:M``
makes a deployable ranking's budget adaptive: the fewest top-ranked tokens whose scores reach the share M of the
ranking's total, at most its fraction. ``ape:T,S`` recomputes nothing: every token computed after the skills (the text
after and between them, recomputed tokens, the question) reads the spliced skill entries through APE's rescaled
attention (arXiv 2502.05431, :class:`~engine.cache.adapter.AttentionRescale`): their logits at temperature T, their
summed weight scaled by S against the rest. EPIC's LegoLink (``sink:K``, arXiv 2410.15332: recompute each chunk's
first K tokens against their real predecessors) is ``seam:K``; ``prefix`` differs from it in that it changes what
each skill was compiled after (the scenario's system prompt), recomputing nothing in place.
Cost: splice is O(L) per skill instead of O(L·context) attention and MLP work, plus what the remedy recomputes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from engine.cache import display
from engine.cache.adapter import AttentionRescale
from engine.cache.decision import DECISIVE_MARGIN, Decision, DecisionMatch, logit_agreement
from engine.cache.loaded import LoadedModel
from engine.cache.notebook import KVBlock, Notebook, NotebookError
from engine.cache.patching import (
    attribution_effects,
    entry_distance,
    kv_deviation,
    kv_relative_deviation,
)
from engine.cache.rope import RopeUnsupported, Rotary
from engine.compose.skills import SkillStore
from engine.edit.runs import render_for
from engine.scenario import (
    RenderedPrompt,
    Scenario,
    ScenarioError,
    Skill,
    Span,
    bundled_skills,
    is_aggregator,
)
from engine.timing import Spread, Stopwatch, side_by_side

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
    return (text or "").replace("{", "{{").replace("}", "}}").strip()


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
    return dataclasses.replace(skill, id=f"{skill.id}_{tokens}", text=cut.replace("{", "{{").replace("}", "}}"))


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


SELECTIONS = ("aggregators", "blend", "query", "deviation", "causal")
RANKED_SELECTIONS = ("blend", "query", "deviation", "causal")  # the top fraction of a ranking
REFERENCE_SELECTIONS = ("deviation", "causal")  # ranked against the recomputed cache
BLEND_LAYER = 1  # CacheBlend's check layer: the first whose K/V depend on other tokens
RANKING_WORDS = {  # a ranked selection in plain words: which skill tokens its fraction recomputes
    "blend": "whose layer-1 K/V sit farthest from a fresh prefill (CacheBlend)",
    "query": "the question attends to most when it reads the plain splice",
    "deviation": "whose K/V deviate most from the full recompute (a diagnostic)",
    "causal": "with the largest causal effect on the decision (a diagnostic)",
}
REMEDY_GRAMMAR = (  # the remedy language in plain words (the Composer's help shows it)
    "A remedy says which spliced skill tokens are recomputed; parts joined by +: prefix (compile each skill after the "
    "scenario's system prompt), seam:N (each skill's first N tokens), tail:N (its last N tokens), aggregators (its "
    "punctuation and line breaks), blend:F (the fraction F of skill tokens whose layer-1 K/V deviate most from a fresh "
    "prefill run through layers 0–1 only: CacheBlend), query:F (the fraction F the question attends to most in the plain "
    "splice), deviation:F and causal:F (ranked against the full recompute: diagnostics), cover:M (with blend or query: "
    "stop once the share M of the ranking's score is covered); splice alone recomputes nothing. ape:T,S recomputes nothing "
    "either: every token computed after the skills reads them through APE's rescaled attention (their logits at "
    "temperature T, their summed weight scaled by S; APE, arXiv 2502.05431). EPIC's sink:K (LegoLink) is seam:K; it "
    "differs from prefix in that it recomputes each skill's first K tokens in place, against their real predecessors, "
    "while prefix changes what the skill was compiled after and recomputes nothing."
)


def split_remedies(text: str) -> list[str]:
    """A comma-separated list of remedy specs, where ``ape:T,S`` keeps its comma (a part never starts with a digit)."""
    return [part.strip() for part in re.split(r",(?=\s*[A-Za-z])", text) if part.strip()]


@dataclass(frozen=True)
class Remedy:
    """How spliced skills are repaired; see the module docstring. ``parse("prefix+seam:1+deviation:0.15")``."""

    seam: int = 0
    prefix: bool = False
    tail: int = 0
    cover: float = 0.0  # adaptive budget of a deployable ranking: stop once this share of its total score is covered
    select: str | None = None
    fraction: float = 0.0
    ape: AttentionRescale | None = None  # read the spliced skills through APE's rescaled attention

    def __post_init__(self) -> None:
        if self.seam < 0:
            raise ScenarioError(f"seam must be ≥ 0, got {self.seam}")
        if self.tail < 0:
            raise ScenarioError(f"tail must be ≥ 0, got {self.tail}")
        if self.cover and (self.select not in ("blend", "query") or not 0.0 < self.cover < 1.0):
            raise ScenarioError(f"cover:{self.cover:g} needs blend:F or query:F (F caps it) and a share within (0, 1)")
        if self.select is not None and self.select not in SELECTIONS:
            raise ScenarioError(f"unknown selection {self.select!r}; choose one of: {', '.join(SELECTIONS)}")
        if self.select in RANKED_SELECTIONS and not 0.0 < self.fraction <= 1.0:
            raise ScenarioError(f"{self.select} selection needs a fraction within (0, 1], got {self.fraction}")
        if self.select not in RANKED_SELECTIONS and self.fraction:
            raise ScenarioError(f"a fraction ({self.fraction}) only applies to the ranked selections: {', '.join(RANKED_SELECTIONS)}")

    @classmethod
    def parse(cls, text: str) -> "Remedy":
        """From ``part+part``: ``prefix``, ``seam:N``, ``tail:N``, ``aggregators``, ``blend:F``, ``query:F``, ``deviation:F``,
        ``causal:F``, ``cover:M``, ``ape:T,S`` (or ``splice``)."""
        options: dict = {}
        for part in (p.strip() for p in text.split("+")):
            name, _, argument = part.partition(":")
            if name == "auto" and not argument:
                raise ScenarioError(
                    "remedy 'auto' is this model's calibrated choice: resolve it with engine.compose.choice.resolve_remedy "
                    "(the CLI's compose, agent and keystone and the Composer do)"
                )
            try:
                if name == "splice" and not argument:
                    continue
                if name == "prefix" and not argument:
                    options["prefix"] = True
                elif name in ("seam", "tail"):
                    options[name] = int(argument)
                elif name == "cover":
                    options["cover"] = float(argument)
                elif name == "aggregators" and not argument:
                    options["select"] = name
                elif name in RANKED_SELECTIONS:
                    options["select"], options["fraction"] = name, float(argument)
                elif name == "ape":
                    options["ape"] = _rescale_of(part, argument)
                else:
                    raise ValueError(part)
            except ScenarioError:
                raise
            except ValueError:
                raise ScenarioError(
                    f"remedy part {part!r} not understood; write e.g. prefix+seam:1, aggregators, blend:0.3, query:0.05, "
                    "deviation:0.15, causal:0.1 or ape:0.9,0.9, joined by +"
                ) from None
        return cls(**options)

    @property
    def needs_reference(self) -> bool:
        """Whether the selection is ranked against the recomputed cache (a diagnostic, not deployable)."""
        return self.select in REFERENCE_SELECTIONS

    def require_deployable(self, user: str) -> "Remedy":
        """This remedy, refused when it ranks against a full recompute that ``user`` does not have."""
        if self.needs_reference:
            raise ScenarioError(
                f"remedy {self.name!r} ranks tokens against a full recompute; {user} needs a deployable one "
                "(prefix, seam:N, tail:N, aggregators, blend:F, query:F, ape:T,S)"
            )
        return self

    @property
    def name(self) -> str:
        """The spec :meth:`parse` reads back."""
        parts = (
            (["prefix"] if self.prefix else [])
            + ([f"seam:{self.seam}"] if self.seam else [])
            + ([f"tail:{self.tail}"] if self.tail else [])
        )
        if self.select:
            parts.append(f"{self.select}:{self.fraction:g}" if self.select in RANKED_SELECTIONS else self.select)
        if self.cover:
            parts.append(f"cover:{self.cover:g}")
        if self.ape:
            parts.append(self.ape.name)
        return "+".join(parts) or "splice"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "seam": self.seam,
            "prefix": self.prefix,
            "tail": self.tail,
            "cover": self.cover,
            "select": self.select,
            "fraction": self.fraction,
            "ape": {"temperature": self.ape.temperature, "scale": self.ape.scale} if self.ape else None,
            "needs_reference": self.needs_reference,
        }


def _rescale_of(part: str, argument: str) -> AttentionRescale:
    """``ape:T,S``'s setting, refused by name where T or S is missing, not a number, or not > 0."""
    numbers = argument.split(",")
    if len(numbers) != 2:
        raise ScenarioError(f"remedy part {part!r}: ape needs a temperature and a scale, e.g. ape:0.9,0.9")
    try:
        temperature, scale = (float(number) for number in numbers)
    except ValueError:
        raise ScenarioError(f"remedy part {part!r}: ape's temperature and scale must be numbers, e.g. ape:0.9,0.9") from None
    try:
        return AttentionRescale(temperature, scale)
    except NotebookError as error:
        raise ScenarioError(f"remedy part {part!r}: {error}") from None


# The static default, where no calibration of the loaded model is at hand (``engine.compose.choice``'s rule on the
# embedded model's short N-skill study and keystone, benchmarks/results/compose_many-embedded-cpu.json): no deployable
# remedy keeps ≥ 97% decisive agreement at ≥ 70% of splice's speedup; of those within the keystone bar this is the
# best trade-off (33/35 decisive, ×2.6 median TTFT, 15% of skill tokens recomputed, keystone gap 0.06).
DEFAULT_REMEDY = Remedy(seam=1, prefix=True, select="blend", fraction=0.15)


def _skill_blocks(
    lm: LoadedModel, scenario: Scenario, prompt: RenderedPrompt, store: SkillStore, remedy: Remedy
) -> list[tuple[str, Span, KVBlock]]:
    """Every placed skill's compiled block, in context order, checked against the context's tokens."""
    system = scenario.system if remedy.prefix else None
    placed = []
    for skill_id, span in sorted(prompt.skill_spans.items(), key=lambda item: item[1].start):
        skill = scenario.skills[skill_id]
        block = store.get(lm, skill, {name: prompt.values[name] for name in skill.fields}, system)
        if block.token_ids.tolist() != list(prompt.context_ids[span.start : span.end]):
            raise NotebookError(f"skill {skill_id!r} tokenizes differently in this context than when compiled")
        placed.append((skill_id, span, block))
    return placed


def _assemble(
    lm: LoadedModel, prompt: RenderedPrompt, placed, seam: int, recompute: set[int], ape: AttentionRescale | None = None
) -> Notebook:
    """Prefill the text between skills, splice each block (seam repaired) and recompute the chosen skill
    positions before anything after the skill is computed; with ``ape`` everything computed after the first splice
    reads the spliced entries through APE's rescaled attention."""
    ids, segments = list(prompt.context_ids), list(prompt.context_segments)
    notebook, cursor = Notebook.empty(lm), 0
    for _, span, block in placed:
        if span.start > cursor:
            notebook = notebook.append(ids[cursor : span.start], segments[cursor : span.start])
        notebook = notebook.splice(block, seam=min(seam, len(block)))
        if ape and notebook.rescale is None:
            notebook = notebook.rescaled(ape)
        notebook = notebook.recompute(sorted(p for p in recompute if span.start + seam <= p < span.end))
        cursor = span.end
    if cursor < len(ids):
        notebook = notebook.append(ids[cursor:], segments[cursor:])
    return notebook


def _blend_ranking(lm: LoadedModel, prompt: RenderedPrompt, placed, candidates: Sequence[int]) -> dict[int, float]:
    """Candidate skill positions' scores: how far their spliced K/V at :data:`BLEND_LAYER` sit from a
    fresh prefill's (:func:`entry_distance` summed over heads); the prefill runs only the layers up to that one."""
    layer = min(BLEND_LAYER, len(placed[0][2].keys) - 1)
    try:
        rotary = Rotary.for_model(lm.model)
    except RopeUnsupported as error:
        raise NotebookError(f"cannot splice skills: {error}") from error
    fresh_keys, fresh_values = Notebook.prefill_layer(lm, prompt.context_ids, layer)
    score: dict[int, float] = {}
    for _, span, block in placed:
        deltas = torch.full((len(block),), span.start - block.start_position, dtype=torch.long)
        keys, values = rotary.move(block.keys[: layer + 1], block.values[: layer + 1], deltas)
        fresh = slice(span.start, span.end)
        distance = entry_distance(keys[layer][0], values[layer][0], fresh_keys[0, :, fresh], fresh_values[0, :, fresh])
        score.update(zip(range(span.start, span.end), distance.sum(0).tolist()))
    return {position: score[position] for position in candidates}


def _query_ranking(first: Notebook, prompt: RenderedPrompt, candidates: Sequence[int]) -> dict[int, float]:
    """Candidate skill positions' scores: the attention the question pays them when it reads the plain
    splice ``first`` (summed over layers, heads and question tokens): the tokens the decision reads from."""
    attention = first.read_prompt(prompt, capture_attention=True).attention
    computed = first.latest()
    mass = attention[..., : len(computed.positions)].float().sum(dim=(0, 1, 2))
    shown = computed.visible
    by_position = dict(zip(computed.positions[shown].tolist(), mass[shown].tolist()))
    return {position: by_position[position] for position in candidates}


def top_of(scores: Mapping[int, float], count: int, cover: float = 0.0) -> set[int]:
    """The ``count`` highest-scoring positions, or with ``cover`` > 0 the fewest from the top whose scores reach that
    share of the total (at most ``count``): an adaptive budget."""
    ranked = sorted(scores, key=lambda position: -scores[position])[:count]
    if cover <= 0:
        return set(ranked)
    target, total, kept = cover * sum(max(value, 0.0) for value in scores.values()), 0.0, []
    for position in ranked:
        if total >= target:
            break
        kept.append(position)
        total += max(scores[position], 0.0)
    return set(kept)


@dataclass(frozen=True)
class Spliced:
    """A context built with its skills spliced, and how many skill tokens the remedy recomputed."""

    notebook: Notebook
    remedy: Remedy
    recomputed_tokens: int
    skill_tokens: int


def splice_prompt(
    lm: LoadedModel,
    scenario: Scenario,
    prompt: RenderedPrompt,
    store: SkillStore,
    remedy: Remedy = DEFAULT_REMEDY,
    reference: Notebook | None = None,
) -> Spliced:
    """Build the prompt's context with every skill spliced from ``store`` and the rest prefilled, repaired by
    ``remedy`` (a ranked selection needs the recomputed ``reference``)."""
    if remedy.needs_reference and reference is None:
        raise NotebookError(f"the {remedy.select} selection ranks tokens against the recomputed cache: pass it as reference")
    placed = _skill_blocks(lm, scenario, prompt, store, remedy)
    if remedy.ape and not placed:
        raise NotebookError(
            f"remedy {remedy.name!r} reads spliced skills through APE's rescaled attention, and scenario {scenario.name!r} "
            "places no skill to splice"
        )
    seams = {p for _, span, _ in placed for p in range(span.start, min(span.start + remedy.seam, span.end))}
    tails = {p for _, span, _ in placed for p in range(max(span.end - remedy.tail, span.start), span.end)} - seams
    candidates = [p for _, span, _ in placed for p in range(span.start, span.end) if p not in seams and p not in tails]
    chosen: set[int] = set(tails)
    if remedy.select == "aggregators":
        texts = lm.tokenizer.batch_decode([[prompt.context_ids[p]] for p in candidates])
        chosen |= {p for p, text in zip(candidates, texts) if is_aggregator(text)}
    elif remedy.select in RANKED_SELECTIONS and candidates:
        count = min(len(candidates), max(1, round(remedy.fraction * len(candidates))))
        if remedy.select == "blend":
            chosen |= top_of(_blend_ranking(lm, prompt, placed, candidates), count, remedy.cover)
        else:
            first = _assemble(lm, prompt, placed, remedy.seam, set(), remedy.ape)
            if remedy.select == "query":
                chosen |= top_of(_query_ranking(first, prompt, candidates), count, remedy.cover)
            elif remedy.select == "deviation":
                chosen |= set(kv_deviation(first, reference, candidates).top_positions(count))
            else:
                gap = (
                    reference.read_prompt(prompt, answer_texts=scenario.answers).margin
                    - first.read_prompt(prompt, answer_texts=scenario.answers).margin
                )
                chosen |= set(attribution_effects(first, reference, prompt, candidates).top_positions(count, gap))
    notebook = _assemble(lm, prompt, placed, remedy.seam, chosen, remedy.ape)
    return Spliced(notebook, remedy, len(seams) + len(chosen), sum(len(span) for _, span, _ in placed))


@dataclass(frozen=True)
class Recomputed:
    """The full-recompute side of a comparison, reusable while the composed prompt stays the same."""

    notebook: Notebook
    decision: Decision
    ttft: Spread  # its time to first token, measured when it was computed


@dataclass
class Fidelity:
    """Spliced vs recomputed: next-token logits, decision (tie-aware), K/V deviation and time to first token."""

    scenario: str
    skills: list[str]
    remedy: Remedy
    context_tokens: int
    skill_tokens: int
    recomputed_tokens: int  # skill tokens the remedy recomputed (seams included)
    agreement: dict[str, float]
    match: DecisionMatch
    spliced: Decision
    recomputed: Decision
    deviation: torch.Tensor  # (layers, context tokens)
    ttft: dict[str, Spread]  # "splice", "full": wall times of the timed rounds (warm-up and skill compilation excluded)
    compile_ms: float  # one-time work: compiling the skills' K/V (shown apart, never in the splice's TTFT)
    reference_reused: bool = False  # the recomputed side (and its TTFT) came from an earlier comparison in the same study

    @property
    def ttft_ms(self) -> dict[str, float]:
        """Median time to first token per side, in ms."""
        return {side: spread.median for side, spread in self.ttft.items()}

    @property
    def speedup(self) -> float:
        """The full recompute's median TTFT over the splice's, both measured side by side."""
        return self.ttft["full"].median / self.ttft["splice"].median

    @property
    def decision_agree(self) -> bool | None:
        """Same label as the recomputed decision; None when that decision is a tie."""
        return self.match.agree

    def as_dict(self) -> dict:
        return {
            "scenario": self.scenario,
            "skills": self.skills,
            "remedy": self.remedy.as_dict(),
            "seam": self.remedy.seam,
            "context_tokens": self.context_tokens,
            "skill_tokens": self.skill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "recomputed_fraction": round(self.recomputed_tokens / max(self.skill_tokens, 1), 4),
            **{key: round(value, 6) for key, value in self.agreement.items()},
            **self.match.as_dict(),
            "spliced": self.spliced.as_dict(),
            "recomputed": self.recomputed.as_dict(),
            "max_kv_deviation": round(float(self.deviation.max()), 6),
            "ttft_ms": {key: round(value, 1) for key, value in self.ttft_ms.items()},
            "ttft_spread_ms": {key: spread.as_dict() for key, spread in self.ttft.items()},
            "speedup": round(self.speedup, 2),
            "compile_ms": round(self.compile_ms, 1),
            "reference_reused": self.reference_reused,
        }

    def _repr_html_(self) -> str:
        """Jupyter's view: next-token agreement, the decisions (tie-aware) and time to first token, both sides."""
        agreement = {
            True: "agree",
            False: "disagree",
            None: f"the recomputed decision is a tie (|margin| < {DECISIVE_MARGIN}): compare the margins",
        }[self.decision_agree]
        numbers = display.fields(
            [
                ("cosine", display.number(self.agreement["cosine"], 6)),
                ("KL (spliced ‖ recomputed)", display.number(self.agreement["kl"], 6)),
                ("top-1 agree", "yes" if self.agreement["top1_agree"] else "no"),
                *[
                    (f"{key.removesuffix('_agree')} overlap", display.number(value, 2))
                    for key, value in self.agreement.items()
                    if key.startswith("top") and key != "top1_agree"
                ],
                ("decision", agreement),
                ("max K/V deviation", display.number(float(self.deviation.max()), 6)),
            ]
        )
        spliced_computed = self.context_tokens - self.skill_tokens + self.recomputed_tokens
        sides = display.table(
            [
                ("decision", self.spliced.label, self.recomputed.label),
                ("margin", display.number(self.spliced.margin, signed=True), display.number(self.recomputed.margin, signed=True)),
                (
                    "TTFT ms",
                    f"{self.ttft_ms['splice']:.1f}",
                    f"{self.ttft_ms['full']:.1f}" + (" (reused)" if self.reference_reused else ""),
                ),
                ("tokens computed", spliced_computed, self.context_tokens),
                ("skill tokens recomputed", self.recomputed_tokens, self.skill_tokens),
            ],
            header=("", "spliced", "recomputed"),
        )
        subtitle = (
            f"skills {', '.join(self.skills)} · remedy {self.remedy.name} · {self.context_tokens} context tokens, "
            f"{self.skill_tokens} in skills · speedup ×{self.speedup:.2f} · skills compiled in {self.compile_ms:.1f} ms"
        )
        return display.block(f"Composition: {self.scenario}", numbers, sides, subtitle=subtitle)


def compare(
    lm: LoadedModel,
    scenario: Scenario,
    store: SkillStore,
    *,
    remedy: Remedy = DEFAULT_REMEDY,
    values: Mapping[str, str] | None = None,
    reps: int = 1,
    warmup: int = 0,
    references: MutableMapping[tuple, Recomputed] | None = None,
) -> Fidelity:
    """Splice (repaired by ``remedy``) vs full recompute of the scenario, timed side by side in this call: the skills
    compiled first (timed apart), ``warmup`` untimed rounds, then ``reps`` timed rounds alternating both sides.

    ``references`` keeps recomputed sides by prompt within one run (a study's remedies on one prompt): a prompt
    seen before reuses its recomputed cache, decision and TTFT, and says so. A ranked remedy's splice time leaves
    out the recomputed cache it ranks against.
    """
    if not scenario.skills:
        raise ScenarioError(f"scenario {scenario.name!r} places no skills (use {{skill:ID}} or --skills)")
    prompt = render_for(lm, scenario, values)
    system = scenario.system if remedy.prefix else None
    lm.splice_gate.require(lm)  # the self-test runs once, before anything is timed
    watch = Stopwatch()
    for skill in scenario.skills.values():
        store.get(lm, skill, {name: prompt.values[name] for name in skill.fields}, system)
    compile_ms = watch.ms
    answers = scenario.answers

    key = (lm.fingerprint, tuple(prompt.context_ids), tuple(prompt.decode_ids), tuple(prompt.answer_ids.items()))
    cached = None if references is None else references.get(key)
    recomputed_side: list[tuple[Notebook, Decision]] = [] if cached is None else [(cached.notebook, cached.decision)]

    def recompute() -> tuple[Notebook, Decision]:  # the latest recomputed side is the splice's reference
        notebook = Notebook.from_prompt(lm, prompt)
        recomputed_side[:] = [(notebook, notebook.read_prompt(prompt, answer_texts=answers))]
        return recomputed_side[0]

    def splice_and_read() -> tuple[Spliced, Decision]:
        spliced = splice_prompt(lm, scenario, prompt, store, remedy, reference=recomputed_side[0][0])
        return spliced, spliced.notebook.read_prompt(prompt, answer_texts=answers)

    sides = {"splice": splice_and_read} if cached else {"full": recompute, "splice": splice_and_read}
    results, spreads = side_by_side(sides, reps=reps, warmup=warmup)
    if cached is None:
        reference, recomputed = recomputed_side[0]
        cached = Recomputed(reference.materialized(), recomputed, spreads["full"])
        if references is not None:
            references[key] = cached
    reference, recomputed = cached.notebook, cached.decision
    built, spliced = results["splice"]
    return Fidelity(
        scenario=scenario.name,
        skills=list(scenario.skills),
        remedy=remedy,
        context_tokens=len(prompt.context_ids),
        skill_tokens=built.skill_tokens,
        recomputed_tokens=built.recomputed_tokens,
        agreement=logit_agreement(spliced.next_token_logits, recomputed.next_token_logits),
        match=DecisionMatch.of(spliced, recomputed),
        spliced=spliced,
        recomputed=recomputed,
        deviation=kv_relative_deviation(built.notebook, reference),
        ttft={"splice": spreads["splice"], "full": cached.ttft},
        compile_ms=compile_ms,
        reference_reused="full" not in spreads,
    )
