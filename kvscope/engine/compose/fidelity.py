"""How close splicing gets to a full recompute: :func:`compare` splices a scenario's skills (repaired by a
:class:`~kvscope.engine.compose.remedy.Remedy`) and recomputes the whole context, times both sides in one call and returns a
:class:`SpliceFidelity`: next-token agreement, the decisions (tie-aware), K/V deviation and time to first token, with
its Jupyter view."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from kvscope.engine.cache import display
from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.cache.decision import DECISIVE_MARGIN, Decision, DecisionMatch, logit_agreement
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.cache.patching import kv_relative_deviation
from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.compose.splice import Spliced, splice_prompt
from kvscope.engine.edit.runs import render_for
from kvscope.engine.jsonable import attributes
from kvscope.engine.scenario import Scenario, ScenarioError
from kvscope.engine.timing import Spread, Stopwatch, side_by_side


@dataclass(frozen=True)
class Recomputed:
    """The full-recompute side of a comparison, reusable while the composed prompt stays the same."""

    notebook: Notebook
    decision: Decision
    ttft: Spread  # its time to first token, measured when it was computed


@dataclass
class SpliceFidelity:
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
            **attributes(self, "scenario", "skills", "remedy"),
            "seam": self.remedy.seam,
            **attributes(self, "context_tokens", "skill_tokens", "recomputed_tokens"),
            "recomputed_fraction": round(self.recomputed_tokens / max(self.skill_tokens, 1), 4),
            **{key: round(value, 6) for key, value in self.agreement.items()},
            **self.match.as_dict(),
            **attributes(self, "spliced", "recomputed"),
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
) -> SpliceFidelity:
    """Splice (repaired by ``remedy``) vs full recompute of the scenario, timed side by side in this call: the skills
    compiled first (timed apart), ``warmup`` untimed rounds, then ``reps`` timed rounds alternating both sides.

    ``references`` keeps recomputed sides by prompt within one run (a study's remedies on one prompt): a prompt
    seen before reuses its recomputed cache, decision and TTFT, and says so. A ranked remedy's splice time leaves
    out the recomputed cache it ranks against. In a server's request (:func:`~kvscope.engine.cache.budget.bounded` with a
    gate) the rounds hold the model's gate from the first to the last, so no other request's work overlaps the timing.
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
    with compute_slot(len(prompt.context_ids)):  # the model held for the rounds: no other request's forward runs between them
        results, spreads = side_by_side(sides, reps=reps, warmup=warmup)
    if cached is None:
        reference, recomputed = recomputed_side[0]
        cached = Recomputed(reference.materialized(), recomputed, spreads["full"])
        if references is not None:
            references[key] = cached
    reference, recomputed = cached.notebook, cached.decision
    built, spliced = results["splice"]
    return SpliceFidelity(
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
