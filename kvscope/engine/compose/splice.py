"""Splicing: a context built from precompiled skills, repaired by a remedy, and the rankings that choose what to recompute.

A scenario places skills with ``{skill:ID}`` placeholders (:mod:`kvscope.engine.compose.placing`). The *recomputed* path
prefills every token. The *spliced* path (:func:`splice_prompt`) prefills only the text between skills and splices each
skill's stored K/V (keys re-rotated to their new positions, values unchanged), then repairs the spliced skills as a
:class:`~kvscope.engine.compose.remedy.Remedy` says: seams and tails recomputed, and a selection of skill tokens recomputed by
rank (``blend``: CacheBlend's layer-:data:`BLEND_LAYER` distance from a fresh prefill; ``query``: the attention the
question pays each token in the plain splice; ``deviation`` and ``causal``: against the full recompute, diagnostics).
:mod:`kvscope.engine.compose.fidelity` compares the result with a full recompute.
Cost: splice is O(L) per skill instead of O(L·context) attention and MLP work, plus what the remedy recomputes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvscope.engine.cache.adapter import AttentionRescale
from kvscope.engine.cache.blocks import KVBlock
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook, NotebookError
from kvscope.engine.cache.patching import attribution_effects, entry_distance, kv_deviation
from kvscope.engine.cache.rope import RopeUnsupported, Rotary
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, RANKED_SELECTIONS, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.scenario import RenderedPrompt, Scenario, Span, is_aggregator

BLEND_LAYER = 1  # CacheBlend's check layer: the first whose K/V depend on other tokens


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
