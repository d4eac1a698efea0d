"""The remedy language: how the skills spliced into a context are repaired, parsed from a spec such as
``prefix+seam:1+blend:0.15`` (:meth:`Remedy.parse`; :data:`REMEDY_GRAMMAR` says it in plain words).

A :class:`Remedy` says which spliced skill tokens are recomputed: skills compiled after the target's own system prompt
(``prefix``), the first ``seam`` tokens of each skill recomputed against the real prefix (seam repair), its last
``tail`` tokens recomputed against their real predecessors (where the paper puts a block's notes; a training-free
cousin of KVLink's link tokens), and a further selection of skill tokens recomputed — every aggregator token
(punctuation and line breaks, where models write notes), or the top ``fraction`` of a ranking:
``blend`` ranks by how far a token's spliced K/V at layer 1 sit from a fresh prefill run through that layer
only (CacheBlend's selection: a server can run it), ``query`` by the attention the question pays each spliced
token when it reads the plain splice (query-aware selection in the manner of InfoFlow-KV; it needs only the
splice, so a server can run it too), ``deviation`` by K/V deviation from the full recompute at every layer and
``causal`` by causal effect on the decision (attribution patching). These last two need the full recompute they
are compared with: diagnostics of how much a perfect ranking buys, not remedies a server could run. ``cover:M``
makes a deployable ranking's budget adaptive: the fewest top-ranked tokens whose scores reach the share M of the
ranking's total, at most its fraction. ``ape:T,S`` recomputes nothing: every token computed after the skills (the text
after and between them, recomputed tokens, the question) reads the spliced skill entries through APE's rescaled
attention (arXiv 2502.05431, :class:`~kvscope.engine.cache.adapter.AttentionRescale`): their logits at temperature T, their
summed weight scaled by S against the rest. EPIC's LegoLink (``sink:K``, arXiv 2410.15332: recompute each chunk's
first K tokens against their real predecessors) is ``seam:K``; ``prefix`` differs from it in that it changes what
each skill was compiled after (the scenario's system prompt), recomputing nothing in place.
:func:`kvscope.engine.compose.splice.splice_prompt` applies a remedy; :data:`DEFAULT_REMEDY` is the static default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvscope.engine.cache.adapter import AttentionRescale
from kvscope.engine.errors import NotebookError
from kvscope.engine.jsonable import attributes
from kvscope.engine.scenario import ScenarioError

SELECTIONS = ("aggregators", "blend", "query", "deviation", "causal")
RANKED_SELECTIONS = ("blend", "query", "deviation", "causal")  # the top fraction of a ranking
REFERENCE_SELECTIONS = ("deviation", "causal")  # ranked against the recomputed cache
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
    "temperature T, their summed weight scaled by S; APE, arXiv 2502.05431). EPIC's sink:K (LegoLink) is seam:K (write it so); it "
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
                    "remedy 'auto' is this model's calibrated choice: resolve it with kvscope.engine.compose.calibration.resolve_remedy "
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
            **attributes(self, "name", "seam", "prefix", "tail", "cover", "select", "fraction"),
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


# The static default, where neither a stored study nor a calibration of the loaded model is at hand
# (``kvscope.engine.compose.choice``'s rule on the embedded model's short N-skill study and keystone,
# benchmarks/studies/results/compose_many-embedded-cpu.json): no deployable remedy keeps ≥ 97% decisive agreement at
# ≥ 70% of splice's speedup within the keystone bar (APE keeps 35/35 at ×4.5 but misses the keystone by 0.7); of those
# within it this is the best trade-off: EPIC's sink:16 after the scenario's system prompt (32/35 decisive, ×4.16 median
# TTFT, 4.6% of skill tokens recomputed, keystone gap 0.09).
DEFAULT_REMEDY = Remedy(seam=16, prefix=True)
