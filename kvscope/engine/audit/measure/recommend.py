"""The recommendation of a measured turn: the cheapest prompt-level repair whose fidelity stays within the bars (KL
of the next token at most ``threshold``, greedy agreement at least ``min_agreement``), the cheaper KV-level one beside
it where one holds them too, and why, in words drawn from the numbers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from pydantic import computed_field

from kvscope.engine.audit.measure.repairs import RepairResult
from kvscope.engine.audit.measure.settings import DEFAULT_MIN_AGREEMENT
from kvscope.engine.audit.prompts.repair_requests import LEVEL_WORDS, REPAIR_LEVELS, Level, OutputFidelity
from kvscope.engine.audit.report.records import HIDDEN, Record, rounded


@dataclass(frozen=True)
class KvAlternative(Record):
    """The cheapest KV-level repair within the bars, where it is cheaper than the prompt-level choice (fewer tokens
    computed and a shorter measured TTFT): what a cache-editing engine would save more."""

    repair: str
    saved_tokens: int
    saved_ttft_ms: Annotated[float, rounded(2)]


@dataclass(frozen=True)
class Recommendation(Record):
    """The cheapest prompt-level repair whose fidelity stays within the bars (any prefix cache serves it), the cheaper
    KV-level one beside it where one holds them too and is cheaper, and why, in words drawn from the numbers."""

    repair: str
    reason: str
    kv_alternative: KvAlternative | None = None
    bars: Annotated[Bars | None, HIDDEN] = None  # what every repair of the turn was judged against

    @computed_field
    @property
    def level(self) -> str:
        """The repair's level (``repairs.REPAIR_LEVELS``)."""
        return REPAIR_LEVELS[self.repair].value


@dataclass(frozen=True)
class Bars:
    """What a repair must hold to be recommended: the user's thresholds, widened to the noise floor where the exact
    reference itself misses them (``recompute`` against the clean prefill: 0 where the reference is recompute's own
    state, as :func:`measure_turn` computes it; a reference prefilled apart differs by rounding in a low-precision
    dtype)."""

    kl: float
    min_agreement: float
    floor: OutputFidelity

    @classmethod
    def of(cls, results: dict[str, RepairResult], threshold: float, min_agreement: float) -> Bars:
        floor = results["recompute"].fidelity
        return cls(max(threshold, floor.kl), min(min_agreement, floor.generation_agreement), floor)

    def holds(self, result: RepairResult) -> bool:
        return result.fidelity.within(self.kl, self.min_agreement)

    def words(self, threshold: float, min_agreement: float) -> str:
        """The noise floor, and the bars where it widened them."""
        floor = f"noise floor (recompute vs the clean prefill): KL {self.floor.kl:.3g}, {self.floor.generation_agreement:.0%} agreeing"
        widened = [
            *([f"KL ≤ {self.kl:.3g} instead of {threshold:g}"] if self.kl > threshold else []),
            *([f"≥ {self.min_agreement:.0%} agreeing instead of {min_agreement:.0%}"] if self.min_agreement < min_agreement else []),
        ]
        return floor + (f"; repairs are judged against it ({', '.join(widened)})" if widened else "")


def recommend(results: dict[str, RepairResult], threshold: float, min_agreement: float = DEFAULT_MIN_AGREEMENT) -> Recommendation:
    """The prompt-level repair computing the fewest tokens (then the fastest) whose KL stays ≤ ``threshold`` with the
    same top token and at least ``min_agreement`` of its greedy tokens agreeing, both widened to the noise floor
    (:class:`Bars`); ``recompute`` always qualifies: it is the exact reference. Beside it, the KV-level repair within
    the same bars, only where it is cheaper: fewer tokens computed and a shorter measured TTFT."""
    bars = Bars.of(results, threshold, min_agreement)
    exact = results["recompute"]
    best = _cheapest(results, bars, Level.PROMPT) or exact
    kv = _cheapest(results, bars, Level.KV)
    alternative = None
    if kv is not None and kv.computed_tokens < best.computed_tokens and kv.ttft_ms < best.ttft_ms:
        alternative = KvAlternative(kv.name, best.computed_tokens - kv.computed_tokens, best.ttft_ms - kv.ttft_ms)
    own = best.reused_tokens + best.computed_tokens
    cost = (
        f"{best.name} ({LEVEL_WORDS[Level.PROMPT]}) computes {best.computed_tokens:,} of {own:,} tokens ({best.computed_tokens / own:.1%})"
    )
    floor = bars.words(threshold, min_agreement)
    if best is exact:
        misses = [r for r in results.values() if r.applicable and r.level is Level.PROMPT and r.name != "recompute"]
        worst = "; ".join(
            f"{r.name} KL {r.fidelity.kl:.3g}, {r.fidelity.generation_agreement:.0%} agreeing"
            + ("" if r.fidelity.top1_agree else ", top token differs")
            for r in misses
        )
        words = f"{cost}: the exact reference; {floor}" + (
            f"; every other prompt-level repair drifts past the bars ({worst})" if misses else ""
        )
    else:
        saved = exact.computed_tokens - best.computed_tokens
        words = (
            f"{cost} at KL {best.fidelity.kl:.3g} ≤ {bars.kl:.3g} with the same top token and {best.fidelity.generation_agreement:.0%} "
            f"of {_generated(best)} greedy tokens agreeing (≥ {bars.min_agreement:.0%}); {floor}"
            f"; recompute would compute {exact.computed_tokens:,} ({saved:,} more)"
        )
    return Recommendation(best.name, words + _kv_words(alternative, kv, best), alternative, bars)


def _cheapest(results: dict[str, RepairResult], bars: Bars, level: Level) -> RepairResult | None:
    """The repair of ``level`` (other than the reference) computing the fewest tokens, then the fastest, within the bars."""
    within = [r for r in results.values() if r.applicable and r.level is level and r.name != "recompute" and bars.holds(r)]
    return min(within, key=lambda r: (r.computed_tokens, r.ttft_ms), default=None)


def _kv_words(alternative: KvAlternative | None, kv: RepairResult | None, best: RepairResult) -> str:
    """The KV-level repair beside the prompt-level choice, in words: offered where it is cheaper, else why not (nothing
    where none holds the bars)."""
    if kv is None:
        return ""
    level = LEVEL_WORDS[Level.KV]
    if alternative is None and kv.computed_tokens >= best.computed_tokens:
        return f"; {kv.name} ({level}) holds the bars too but would compute no fewer tokens"
    if alternative is None:
        return (
            f"; {kv.name} ({level}) holds the bars too and computes {best.computed_tokens - kv.computed_tokens:,} fewer tokens, "
            f"but measured slower here (TTFT {kv.ttft_ms:.1f} ms against {best.ttft_ms:.1f} ms), so it is not offered"
        )
    return (
        f"; a cache-editing engine could run {kv.name} ({level}) within the same bars: "
        f"{alternative.saved_tokens:,} fewer tokens computed, TTFT {kv.ttft_ms:.1f} ms against {best.ttft_ms:.1f} ms"
    )


def _generated(result: RepairResult) -> int:
    return max(len(result.generated), 1)
