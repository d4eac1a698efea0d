"""The parts of the audit's JSON report still built as dicts, typed: one ``TypedDict`` per part.

A part whose JSON is its dataclass's is a record instead (``report.records.Record``) and has no type here; a
hand-written ``as_dict`` is annotated to return its part (``Cause.as_dict() -> CauseDict``). The report as a whole
(``LogAudit``, ``PromptAudit``) and its JSON Schema are ``ci.report``'s: they hold the stages' records. Maps keyed by a
simulated engine (``simulate.registry.ENGINES``), a provider, a repair, a cause or a format are ``dict[str, …]``: their
registries name the keys. The parts by pass: ``traffic`` (``logs``, ``changes``, ``simulate``, ``scan``),
``measured`` (``measure``, ``rewrite``, ``endpoint``); here, the gate. Text only: no torch, no stage imported, and no
``from __future__ import annotations`` (``NotRequired`` must stay readable to ``__required_keys__``).
"""

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11

from kvscope.engine.audit.report.types.measured import (
    EndpointAuditDict,
    EndpointDescriptionDict,
    EndpointFidelityDict,
    EndpointRepairDict,
    EndpointRewrittenRequestDict,
    EndpointTurnDict,
    NotApplicableDict,
    RepairDict,
    RepairResultDict,
    RewrittenRequestDict,
)
from kvscope.engine.audit.report.types.traffic import (
    CauseCountDict,
    FitBestDict,
    FitSettingDict,
    GapDict,
    HostedDict,
    HostedProviderDict,
    MetricsDict,
    ObservedDict,
    ObservedFitDict,
    PromptsOnlyDict,
    ServerCountedDict,
    TotalsDict,
    TrafficGroupDict,
)

# ----------------------------------------------------------------------------------------------------------- report


class GateConditionDict(TypedDict):
    """One ``--fail-on`` condition: as written, its quantity's value, and whether it holds (a hold fails the gate)."""

    condition: str
    quantity: str
    value: float
    holds: bool


class GateDict(TypedDict):
    """``--fail-on``: each condition, and ``failed`` when any holds (exit code 1)."""

    conditions: list[GateConditionDict]
    failed: bool


__all__ = [
    "CauseCountDict",
    "EndpointAuditDict",
    "EndpointDescriptionDict",
    "EndpointFidelityDict",
    "EndpointRepairDict",
    "EndpointRewrittenRequestDict",
    "EndpointTurnDict",
    "FitBestDict",
    "FitSettingDict",
    "GapDict",
    "GateConditionDict",
    "GateDict",
    "HostedDict",
    "HostedProviderDict",
    "MetricsDict",
    "NotApplicableDict",
    "ObservedDict",
    "ObservedFitDict",
    "PromptsOnlyDict",
    "RepairDict",
    "RepairResultDict",
    "RewrittenRequestDict",
    "ServerCountedDict",
    "TotalsDict",
    "TrafficGroupDict",
]
