"""A measured group's fidelity per repair, in process or on an endpoint: the records the report holds for each change
group, declared apart from the model pass that computes them (text only, no torch: the endpoint's pass reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.audit.report.records import Record
from kvscope.engine.audit.scan.traffic_scan import TrafficGroup


@dataclass(frozen=True)
class RepairFidelity(Record):
    """One repair over a group's turns measured in process: turns measured and applicable, how often recommended, its
    worst KL and agreement, its mean share of computed tokens."""

    measured: int
    applicable: int
    recommended: int
    worst_kl: float | None
    min_agreement: float | None
    mean_computed_share: float | None


@dataclass(frozen=True)
class EndpointRepairFidelity(Record):
    """One prompt-level repair over a group's turns measured on an endpoint: applicable, within the bars, its worst KL
    with its bound, and its least agreement."""

    measured: int
    applicable: int
    within_bars: int
    worst_kl: float | None
    worst_kl_bound: float | None
    min_agreement: float | None


@dataclass(frozen=True)
class MeasuredGroup(TrafficGroup):
    """A group with each repair's fidelity over its measured turns (in process, or on an endpoint)."""

    fidelity: dict[str, RepairFidelity | EndpointRepairFidelity]
