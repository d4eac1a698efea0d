"""What every measured turn runs (``MeasureSettings``): the repairs, the greedy tokens generated per state, the
recommendation's bars (the largest next-token KL, the smallest share of agreeing greedy tokens), the grain coarsen
rounds date-times to, and the context limit. One object travels from the CLI or the app through the model pass, in
process, on Ray actors or on an endpoint. Nothing here imports torch: the endpoint's audit reads it too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.prompts.repair_requests import REPAIRS

DEFAULT_TOKENS = 32  # greedy tokens generated per state
DEFAULT_THRESHOLD = 0.05  # nats of KL divergence of the next-token distribution
DEFAULT_MIN_AGREEMENT = 0.9  # of the greedy tokens generated from the state and from the clean prefill


def check_repairs(names: Sequence[str]) -> tuple[str, ...]:
    """The repairs asked for, validated (``recompute`` always runs: it is the reference every cost compares to)."""
    unknown = [name for name in names if name not in REPAIRS]
    if unknown:
        raise RequestLogError(f"unknown repair {unknown[0]!r}; choose from {', '.join(REPAIRS)}")
    return tuple(dict.fromkeys(["recompute", *names]))


@dataclass(frozen=True)
class MeasureSettings:
    """What every measured turn runs: the repairs (``check_repairs``), greedy tokens, and the recommendation's bars."""

    repairs: tuple[str, ...] = REPAIRS
    tokens: int = DEFAULT_TOKENS
    threshold: float = DEFAULT_THRESHOLD
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    grain: str | None = None
    max_tokens: int | None = None

    def checked(self) -> MeasureSettings:
        """The settings with their repairs validated (``recompute`` first) and at least one token generated."""
        if self.tokens < 1:
            raise RequestLogError(f"generate at least one token per state, got {self.tokens}")
        return MeasureSettings(check_repairs(self.repairs), self.tokens, self.threshold, self.min_agreement, self.grain, self.max_tokens)


def measure_settings(
    repairs: Sequence[str] = REPAIRS,
    tokens: int | None = None,
    threshold: float | None = None,
    min_agreement: float | None = None,
    grain: str | None = None,
    max_tokens: int | None = None,
) -> MeasureSettings:
    """What each sampled turn is measured with: the repairs checked, and the defaults where a value is ``None``."""
    names = check_repairs(repairs)
    defaults = MeasureSettings(names)
    return MeasureSettings(
        names,
        defaults.tokens if tokens is None else tokens,
        defaults.threshold if threshold is None else threshold,
        defaults.min_agreement if min_agreement is None else min_agreement,
        grain,
        max_tokens,
    ).checked()
