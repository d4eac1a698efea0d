"""The audit's JSON report, typed: what ``python -m kvscope audit … --json`` prints, one ``TypedDict`` per part.

Each stage's ``as_dict`` is annotated to return its part (``Cause.as_dict() -> CauseDict``), the gate, the Markdown and
the figures read these types, and ``kvscope.engine.audit.report.schema`` publishes them as a JSON Schema
(docs/audit-report.schema.json) for CI users. A key added to an ``as_dict`` is added here, or the schema test fails.

``AuditJSON`` is either report: a log's (``LogAudit``: its token pass over every request, and the sampled turns
measured) or one prompt's with a new value (``PromptAudit``, ``--new``). Maps keyed by a simulated engine
(``simulate.registry.ENGINES``), a provider, a repair, a cause or a format are ``dict[str, …]``: their registries name
the keys. The parts by pass: ``token_pass`` (``logs``, ``changes``, ``simulate``, ``scan``), ``model_pass`` (``measure``,
``rewrite``, ``endpoint``); here, the gate and the two reports. The stages below ``report`` name these types under
``TYPE_CHECKING`` only: at run time no stage imports one above it. Text only: no torch, and no
``from __future__ import annotations`` (``NotRequired`` must stay readable to ``__required_keys__``).
"""

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11

from kvscope.engine.audit.report.types.model_pass import (
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
from kvscope.engine.audit.report.types.token_pass import (
    CacheSettingsDict,
    CandidateDict,
    CauseCountDict,
    CauseDict,
    EnginesDict,
    FieldChangeDict,
    FitBestDict,
    FitSettingDict,
    FleetDict,
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
    "CacheSettingsDict",
    "CandidateDict",
    "CauseCountDict",
    "CauseDict",
    "EndpointAuditDict",
    "EndpointDescriptionDict",
    "EndpointFidelityDict",
    "EndpointRepairDict",
    "EndpointRewrittenRequestDict",
    "EndpointTurnDict",
    "EnginesDict",
    "FieldChangeDict",
    "FitBestDict",
    "FitSettingDict",
    "FleetDict",
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
