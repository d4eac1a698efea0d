"""What every measured turn runs (``MeasureSettings``): the repairs, the greedy tokens generated per state, the
recommendation's bars (the largest next-token KL, the smallest share of agreeing greedy tokens), the grain coarsen
rounds date-times to, and the context limit. One object, checked in its constructor, travels from the CLI or the app
through the model pass, in process, on Ray actors or on an endpoint. Nothing here imports torch: the endpoint's audit reads it too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.prompts.repair_requests import GRAINS, REPAIRS

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
    """What every measured turn runs, checked in the constructor (each setting named where it is refused): the
    repairs (``check_repairs``: ``recompute`` first), greedy tokens, the recommendation's bars, coarsen's grain, and the
    context limit a prompt is cut at (None: the model's own)."""

    repairs: tuple[str, ...] = REPAIRS
    tokens: int = DEFAULT_TOKENS
    threshold: float = DEFAULT_THRESHOLD
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    grain: str | None = None
    context_limit: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "repairs", check_repairs(self.repairs))
        if self.tokens < 1:
            raise RequestLogError(f"--tokens: generate at least one token per state, got {self.tokens}")
        if self.threshold < 0:
            raise RequestLogError(f"--threshold: the KL threshold cannot be negative, got {self.threshold:g}")
        if not 0 <= self.min_agreement <= 1:
            raise RequestLogError(f"--min-agreement: the minimum agreement is a share between 0 and 1, got {self.min_agreement:g}")
        if self.grain is not None and self.grain not in GRAINS:
            raise RequestLogError(f"--grain: unknown grain {self.grain!r}; choose one of {', '.join(GRAINS)}")
        if self.context_limit is not None and self.context_limit < 1:
            raise RequestLogError(f"the context limit is at least 1 token, got {self.context_limit}")


def measure_settings(
    repairs: Sequence[str] = REPAIRS,
    tokens: int | None = None,
    threshold: float | None = None,
    min_agreement: float | None = None,
    grain: str | None = None,
    context_limit: int | None = None,
) -> MeasureSettings:
    """``MeasureSettings`` with the defaults where a value is ``None``."""
    given = {"tokens": tokens, "threshold": threshold, "min_agreement": min_agreement}
    return MeasureSettings(tuple(repairs), grain=grain, context_limit=context_limit, **{k: v for k, v in given.items() if v is not None})
