"""What a stored N-skill study's speed-ups predict for another context length.

A full recompute prefills every context token (its MLPs cost O(L), its attention O(L²)); a splice prefills only the
text around the skills and reads their stored K/V, so its time grows far more slowly. The speed-up (full ÷ splice) thus
depends on the context length L, and a study's speed-ups hold at the lengths it measured. :func:`speedup_fits` fits
each side's median time to first token to a power of L over a study's cases (least squares in log–log: the exponent
says where between O(L) and O(L²) the side sits on that machine), and :meth:`SpeedupFit.at` reads the ratio at another
length. Outside the measured lengths it is an extrapolation, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

FULL_EXPONENTS = (0.5, 2.5)  # a full prefill's time grows about as L (MLPs) to L² (attention); outside this, the points are noise


@dataclass(frozen=True)
class PowerLaw:
    """``ms = scale × tokens ** exponent``, fitted in log–log."""

    scale: float
    exponent: float

    def at(self, tokens: int) -> float:
        return self.scale * tokens**self.exponent

    @classmethod
    def fit(cls, tokens: Sequence[int], ms: Sequence[float]) -> PowerLaw:
        exponent, offset = np.polyfit(np.log(np.asarray(tokens, dtype=float)), np.log(np.asarray(ms, dtype=float)), 1)
        return cls(math.exp(float(offset)), float(exponent))


@dataclass(frozen=True)
class SpeedupFit:
    """One remedy's time to first token against the context length, both sides fitted to a study's points."""

    remedy: str
    full: PowerLaw
    splice: PowerLaw
    shortest: int  # context tokens of the study's shortest and longest case
    longest: int
    points: int

    def at(self, tokens: int) -> float:
        """The speed-up (full ÷ splice) the fit predicts at ``tokens`` context tokens."""
        return self.full.at(tokens) / self.splice.at(tokens)

    @property
    def plausible(self) -> bool:
        """Whether the points grow with L as prefills do (full between about O(L) and O(L²), splice not shrinking); a
        study measured on a busy machine may not, and then predicts nothing."""
        return FULL_EXPONENTS[0] <= self.full.exponent <= FULL_EXPONENTS[1] and self.splice.exponent >= 0

    def measured_words(self) -> str:
        """Where the study measured it: "451–1,711-token contexts"."""
        return f"{self.shortest:,}–{self.longest:,}-token contexts"

    def words(self, tokens: int) -> str:
        """What the study's points predict at ``tokens`` context tokens, with the fit's exponents, in words."""
        if not self.plausible:
            return (
                f"the study's times for {self.remedy} do not grow with the context as prefills do (full recompute ∝ "
                f"L^{self.full.exponent:.2f}, splice ∝ L^{self.splice.exponent:.2f}: a noisy study), so they predict nothing "
                f"at {tokens:,} tokens"
            )
        outside = "" if self.shortest <= tokens <= self.longest else f", outside the measured {self.measured_words()}: an extrapolation"
        return (
            f"the study's {self.points} points predict ×{self.at(tokens):.2f} for {self.remedy} at {tokens:,} context tokens "
            f"(full recompute ∝ L^{self.full.exponent:.2f}, splice ∝ L^{self.splice.exponent:.2f}{outside})"
        )


def speedup_fits(cases: Sequence[Mapping]) -> dict[str, SpeedupFit]:
    """Per remedy, the fit of both sides' times over a stored study's cases (``Study.as_dict()["cases"]``: each with its
    ``context_tokens`` and, per remedy, ``ttft_ms``); a remedy measured at fewer than two lengths has none."""
    rows: dict[str, list[tuple[int, float, float]]] = {}
    for case in cases:
        for name, row in case.get("remedies", {}).items():
            ms = row.get("ttft_ms") or {}
            if ms.get("full", 0) > 0 and ms.get("splice", 0) > 0:
                rows.setdefault(name, []).append((case["context_tokens"], ms["full"], ms["splice"]))
    fits = {}
    for name, points in rows.items():
        tokens = [point[0] for point in points]
        if len(set(tokens)) < 2:
            continue
        full = PowerLaw.fit(tokens, [point[1] for point in points])
        splice = PowerLaw.fit(tokens, [point[2] for point in points])
        fits[name] = SpeedupFit(name, full, splice, min(tokens), max(tokens), len(points))
    return fits
