"""Which remedy the composer offers by default: one rule over measurements.

A remedy is *deployable* when a server could run it (nothing ranked against a full recompute). The goal: at least
``GOAL_AGREEMENT`` of the decisive decisions agree with a full recompute while the median TTFT speedup keeps at least
``GOAL_SPEED_SHARE`` of plain splice's, both measured in the same run. :func:`choose_remedy` reads a study summary
(``Study.summary()`` or a stored study's ``"summary"``):

1. where the keystone was measured (an edit inside a spliced skill; ``KEYSTONE_MAX_GAP``), remedies failing its bar
   are set aside, unless every measured remedy fails it;
2. of the remedies meeting the goal, the fastest;
3. else the best measured trade-off: the largest sum of the two goals' attained shares,
   ``min(agreement / 0.97, 1) + min(speedup / (0.7 × splice's), 1)``, then the fastest.

:mod:`kvscope.engine.compose.calibration` applies the rule to a small study measured once per model (``--remedy auto``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.compose.keystone import keystone
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.errors import KVScopeError
from kvscope.engine.jsonable import attributes
from kvscope.engine.scenario import Scenario, bundled_scenarios

GOAL_AGREEMENT = 0.97  # of decisive decisions (ties reported apart)
GOAL_SPEED_SHARE = 0.7  # of plain splice's median TTFT speedup, same run
KEYSTONE_MIN_DELTA = 1.0  # the keystone edit must move the recomputed decision this far to tell remedies apart
KEYSTONE_MAX_GAP = 0.15  # composed − recomputed recovery, every strategy


@dataclass(frozen=True)
class RemedyPoint:
    """One deployable remedy's measured agreement and cost."""

    name: str
    agree_decisive: int
    decisive: int
    ties: int
    agreement: float
    speedup: float  # median TTFT of the full recompute over the splice
    recomputed_fraction: float
    mean_abs_margin_error: float | None
    keystone_gap: float | None = None  # worst |composed − recomputed recovery|; None where not measured

    @classmethod
    def of(cls, name: str, row: Mapping, keystone_gap: float | None = None) -> RemedyPoint:
        return cls(
            name,
            row["agree_decisive"],
            row["decisive"],
            row["ties"],
            row["agreement"],
            row["speedup"]["median"],
            row["recomputed_fraction"],
            row["mean_abs_margin_error"],
            keystone_gap,
        )

    def numbers(self) -> str:
        """Its agreement and speed against a full recompute in a few plain words (the Composer's menu label)."""
        return f"keeps {self.agree_decisive}/{self.decisive} decisions of a full recompute, ×{self.speedup:.2f} faster first token (median)"

    def words(self) -> str:
        """:meth:`numbers` with the share agreeing, the tokens recomputed and the keystone gap."""
        keystone_words = "" if self.keystone_gap is None else f", keystone gap {self.keystone_gap:.2f}"
        return (
            f"{self.name}: keeps {self.agree_decisive}/{self.decisive} decisive decisions of a full recompute ({self.agreement:.0%}), "
            f"first token ×{self.speedup:.2f} faster than a full recompute's (median TTFT), "
            f"{self.recomputed_fraction:.0%} of skill tokens recomputed{keystone_words}"
        )


@dataclass(frozen=True)
class RemedyChoice:
    """The remedy the rule picks (see the module docstring), why, and the measured points it chose from."""

    remedy: str
    goal_met: bool
    reason: str
    splice_speedup: float
    points: tuple[RemedyPoint, ...]
    source: str = ""  # where the numbers come from (a study file, or a calibration of a model)
    measured: dict = field(default_factory=dict)  # what a calibration ran: plan, dtype, device, seconds

    def point(self, name: str) -> RemedyPoint:
        return next(point for point in self.points if point.name == name)

    @property
    def chosen(self) -> RemedyPoint | None:
        """The chosen remedy's measured point (None for a fallback measured on no decisive case)."""
        return next((point for point in self.points if point.name == self.remedy), None)

    @property
    def fastest(self) -> RemedyPoint | None:
        """The fastest measured deployable remedy (may be the chosen one)."""
        return max(self.points, key=lambda point: point.speedup, default=None)

    @property
    def most_faithful(self) -> RemedyPoint | None:
        """The deployable remedy with the most decisive agreement, then the smallest margin error."""
        return max(self.points, key=lambda point: (point.agreement, -(point.mean_abs_margin_error or 0.0)), default=None)

    def frontier(self) -> list[RemedyPoint]:
        """Points no other point beats on both agreement and speedup, fastest first."""
        return sorted(
            (
                p
                for p in self.points
                if not any(
                    q.agreement >= p.agreement and q.speedup >= p.speedup and (q.agreement, q.speedup) != (p.agreement, p.speedup)
                    for q in self.points
                )
            ),
            key=lambda point: -point.speedup,
        )

    def as_dict(self) -> dict:
        return {
            **attributes(self, "remedy", "goal_met"),
            "goal": {"agreement": GOAL_AGREEMENT, "speed_share_of_splice": GOAL_SPEED_SHARE, "keystone_max_gap": KEYSTONE_MAX_GAP},
            **attributes(self, "reason", "splice_speedup"),
            "fastest": self.fastest.name if self.fastest else None,
            "most_faithful": self.most_faithful.name if self.most_faithful else None,
            "frontier": [point.name for point in self.frontier()],
            "points": [asdict(point) for point in self.points],
            **attributes(self, "source", "measured"),
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> RemedyChoice:
        points = tuple(RemedyPoint(**point) for point in data["points"])
        return cls(data["remedy"], data["goal_met"], data["reason"], data["splice_speedup"], points, data["source"], dict(data["measured"]))


def _attained(point: RemedyPoint, speed_goal: float) -> float:
    return min(point.agreement / GOAL_AGREEMENT, 1.0) + min(point.speedup / speed_goal, 1.0)


def choose_remedy(summary: Mapping[str, Mapping], gaps: Mapping[str, float | None] | None = None, source: str = "") -> RemedyChoice:
    """The default remedy for a study summary (and, where measured, each remedy's worst keystone gap), by the rule of
    the module docstring."""
    gaps = gaps or {}
    points = [
        RemedyPoint.of(name, row, gaps.get(name))
        for name, row in summary.items()
        if not row["needs_reference"] and row["decisive"] and row["speedup"]
    ]
    if not points:
        raise KVScopeError("no deployable remedy with a decisive case and a measured speedup to choose from")
    splice = next((point.speedup for point in points if point.name == "splice"), max(point.speedup for point in points))
    speed_goal = GOAL_SPEED_SHARE * splice
    passing = [point for point in points if point.keystone_gap is not None and point.keystone_gap <= KEYSTONE_MAX_GAP]
    measured_keystone = any(point.keystone_gap is not None for point in points)
    pool = passing if passing else points
    keystone_words = ""
    if measured_keystone:
        keystone_words = (
            f" among the remedies within the keystone bar (gap ≤ {KEYSTONE_MAX_GAP})"
            if passing
            else f" (no remedy is within the keystone bar, gap ≤ {KEYSTONE_MAX_GAP}: all were kept)"
        )
    goal = [point for point in pool if point.agreement >= GOAL_AGREEMENT and point.speedup >= speed_goal]
    if goal:
        chosen = max(goal, key=lambda point: (point.speedup, -point.recomputed_fraction))
        reason = (
            f"the fastest remedy keeping ≥ {GOAL_AGREEMENT:.0%} decisive agreement and ≥ {GOAL_SPEED_SHARE:.0%} of splice's "
            f"×{splice:.2f}{keystone_words}"
        )
    else:
        chosen = max(pool, key=lambda point: (round(_attained(point, speed_goal), 6), point.speedup))
        reason = (
            f"no remedy keeps ≥ {GOAL_AGREEMENT:.0%} decisive agreement at ≥ {GOAL_SPEED_SHARE:.0%} of splice's ×{splice:.2f} "
            f"(≥ ×{speed_goal:.2f}); this is the best measured trade-off{keystone_words}, by the largest sum of the shares of "
            "both goals attained"
        )
    return RemedyChoice(chosen.name, bool(goal), reason, splice, tuple(points), source)


def choice_record(summary: Mapping[str, Mapping], gaps: Mapping[str, float | None] | None = None, source: str = "") -> dict:
    """What a stored study says of its default: ``default`` and ``choice`` (:func:`choose_remedy`), both None with the
    reason in ``no_default`` where nothing deployable had a decisive case."""
    try:
        choice = choose_remedy(summary, gaps, source)
    except KVScopeError as error:
        return {"default": None, "choice": None, "no_default": str(error)}
    return {"default": choice.remedy, "choice": choice.as_dict()}


def keystone_gaps(
    lm: LoadedModel, store: SkillStore, remedies: list[Remedy], scenario_name: str, starting: Callable[[int], None] | None = None
) -> dict:
    """Per deployable remedy the worst keystone recovery gap (an edit inside a spliced skill, composed vs recomputed),
    with the edit's Δmargin; no gaps where the edit moves the decision less than ``KEYSTONE_MIN_DELTA`` (the keystone
    cannot tell remedies apart there). ``starting(k)`` is called before the k-th remedy's keystone (from 0)."""
    target = Scenario.load(bundled_scenarios()[scenario_name])
    rows, recomputed = {}, None
    for index, remedy in enumerate(remedy for remedy in remedies if not remedy.needs_reference):
        if starting:
            starting(index)
        report = keystone(lm, target, store, remedy=remedy, recomputed=recomputed)
        rows[remedy.name], recomputed = report.as_dict(), report.recomputed
    return {"scenario": scenario_name, **gaps_of(rows)}


def gaps_of(rows: Mapping[str, Mapping]) -> dict:
    """From keystone reports by remedy (``KeystoneReport.as_dict()``): the edit's Δmargin and each remedy's worst gap,
    no gaps where the edit moves the decision less than ``KEYSTONE_MIN_DELTA``."""
    delta = next(iter(rows.values()))["delta_margin"] if rows else 0.0
    gaps = {name: row["max_recovery_gap"] for name, row in rows.items()} if abs(delta) >= KEYSTONE_MIN_DELTA else {}
    return {"delta_margin": delta, "gaps": gaps}
