"""What an edit produces: the per-strategy results against stale and oracle, and the notes share.

:class:`FieldEditReport` is what every edit report shares (the notebook's :class:`EditReport` and the hybrid's
:class:`HybridEditReport`), with the one JSON summary both write.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvscope.engine.cache import display
from kvscope.engine.cache.decision import Decision, Recovery, margin_noise, noise_words
from kvscope.engine.edit.strategies import StrategyResult
from kvscope.engine.jsonable import attributes, rounded


@dataclass(frozen=True)
class NotesShare:
    """How much of a decision change the downstream notes carry, against the field's own K/V.

    ``share`` = 1 − field_only recovery: the part of the stale → oracle margin change that recomputing the
    field alone does not bring back. ``downstream_recovery`` (when measured) patches the oracle's K/V of
    every token after the field into the stale cache with the field left stale: the notes alone.
    """

    share: float | None
    field_recovery: float | None
    field_only_label: str | None
    stale_label: str
    oracle_label: str
    downstream_recovery: float | None = None
    reason: str | None = None
    unmoved_by: float | None = None  # the oracle − stale margin change, where it is too small to measure a recovery against

    @classmethod
    def of(cls, field_only: StrategyResult, stale: Decision, oracle: Decision, downstream: Recovery | None = None) -> "NotesShare":
        """From the field_only strategy's result (and the downstream patch's recovery, if read)."""
        down = None if downstream is None else downstream.value
        if not field_only.applicable:
            return cls(None, None, None, stale.label, oracle.label, down, f"field_only is not applicable: {field_only.reason}")
        value = field_only.recovery.value
        share = None if value is None else 1.0 - value
        unmoved = oracle.margin - stale.margin if value is None else None  # applicable: only a too-small change leaves no recovery
        return cls(share, value, field_only.decision.label, stale.label, oracle.label, down, field_only.recovery.reason, unmoved)

    @property
    def field_alone_flips(self) -> bool | None:
        """Whether recomputing the field alone already reaches the oracle's decision."""
        return None if self.field_only_label is None else self.field_only_label == self.oracle_label

    def headline(self) -> str:
        """One sentence computed from the numbers (plain text)."""
        if self.unmoved_by is not None:
            return (
                f"Notes not measurable here: this change does not move the decision. A clean prefill with the new value moves "
                f"the margin by only {self.unmoved_by:+.3f} ({self.stale_label} before, {self.oracle_label} after), too little "
                "to measure what the notes carry; pick a field or value whose change moves the answer"
            )
        if self.share is None:
            return f"Notes share undefined: {self.reason}"
        percent = f"{max(0.0, min(1.0, self.share)):.0%}"
        if self.stale_label == self.oracle_label:
            return f"Notes carry {percent} of this margin change; a clean prefill keeps the decision at {self.oracle_label}"
        if self.field_alone_flips:
            return (
                f"Notes carry {percent} of this decision; recomputing the field alone already reaches {self.field_only_label}: "
                "this model still reads much of the field directly"
            )
        return f"Notes carry {percent} of this decision; recomputing the field alone leaves it at {self.field_only_label}"

    def as_dict(self) -> dict:
        return {
            "share": rounded(self.share),
            "field_recovery": rounded(self.field_recovery),
            "downstream_recovery": rounded(self.downstream_recovery),
            "field_only_decision": self.field_only_label,
            "field_alone_flips": self.field_alone_flips,
            "headline": self.headline(),
            "reason": self.reason,
        }


@dataclass
class FieldEditReport(ABC):
    """One field change old → new: every requested strategy, with stale and oracle for reference."""

    model: str
    scenario: str
    field: str
    old: str
    new: str
    stale: StrategyResult
    oracle: StrategyResult
    strategies: dict[str, StrategyResult]

    @property
    @abstractmethod
    def context_tokens(self) -> int:
        """Tokens of the stale context."""

    @property
    def flips(self) -> bool:
        """Whether a clean prefill with the new value changes the decision."""
        return self.stale.decision.label != self.oracle.decision.label

    def as_dict(self) -> dict:
        """What changed, whether a clean prefill flips, stale, oracle, each strategy."""
        return {
            **attributes(self, "model", "scenario", "field", "old", "new", "context_tokens", "flips"),
            "delta_margin": round(self.oracle.decision.margin - self.stale.decision.margin, 4),
            **attributes(self, "stale", "oracle", "strategies"),
        }

    def headline(self) -> str:
        """One sentence computed from the numbers (plain text)."""
        outcome = "flips" if self.flips else "keeps"
        return f"A clean prefill with the new value {outcome} the decision: {self.stale.decision.label} → {self.oracle.decision.label}"

    def _repr_html_(self) -> str:
        """Jupyter's view: the headline, what changed, and a card per strategy (stale and oracle first)."""
        delta = self.oracle.decision.margin - self.stale.decision.margin
        change = f"{self.field}: {self.old} → {self.new} · {self.context_tokens} context tokens · Δ margin {delta:+.4f}"
        cards = "".join(_strategy_card(result) for result in (self.stale, self.oracle, *self.strategies.values()))
        title = f"Edit report: {self.scenario} on {self.model}"
        return display.block(title, display.paragraph(self.headline()), display.Raw(f"<div>{cards}</div>"), subtitle=change)


def _strategy_card(result: StrategyResult) -> str:
    """One strategy as a card: decision, margin, recovery, tokens recomputed, time (or why it does not apply)."""
    if not result.applicable or result.decision is None:
        return display.card(result.name, display.paragraph(f"not applicable: {result.reason}"))
    recovery = result.recovery
    rows = [
        ("decision", result.decision.label),
        ("margin", display.number(result.decision.margin, signed=True)),
        ("recovery", display.number(None if recovery is None else recovery.value, 3)),
        ("tokens recomputed", result.tokens_recomputed),
        ("ms", f"{result.ms:.1f}" + (" (share of one fused forward)" if result.ms_is_share else "")),
    ]
    if recovery is not None and recovery.value is None:
        rows.append(("recovery note", recovery.reason))
    return display.card(result.name, display.fields(rows))


@dataclass
class EditReport(FieldEditReport):
    """A field change on a notebook, with the notes share."""

    notes: NotesShare
    dtype: str = "float32"  # the model's, for the noise floor of its margins (:func:`margin_noise`)

    @property
    def context_tokens(self) -> int:
        return len(self.stale.notebook)

    @property
    def margin_noise(self) -> float:
        """The noise floor of this report's margins (0.0 in float32)."""
        return margin_noise(self.dtype)

    @property
    def within_noise(self) -> bool:
        """Whether the change's effect on the margin (oracle − stale) is within the noise floor."""
        return abs(self.oracle.decision.margin - self.stale.decision.margin) <= self.margin_noise

    def noise_words(self) -> str:
        """The noise floor in words, for this change (empty in float32)."""
        return noise_words(self.dtype, self.oracle.decision.margin - self.stale.decision.margin)

    def headline(self) -> str:
        """The notes share's headline."""
        return self.notes.headline()

    def as_dict(self) -> dict:
        noise = {"dtype": self.dtype, "margin_noise": self.margin_noise, "within_noise": self.within_noise}
        return super().as_dict() | {"notes": self.notes.as_dict()} | noise


@dataclass
class HybridEditReport(FieldEditReport):
    """A field change on a hybrid: stale, oracle and the erratum read exactly; in-place strategies refused."""

    stale_tokens: int

    @property
    def context_tokens(self) -> int:
        return self.stale_tokens

    def as_dict(self) -> dict:
        return super().as_dict() | {"hybrid": True}
