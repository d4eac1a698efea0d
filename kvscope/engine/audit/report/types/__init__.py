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

from typing import NotRequired

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11

from kvscope.engine.audit.logs.requests import Skipped

from kvscope.engine.audit.report.types.model_pass import (
    AuditTurnDict,
    EndpointAuditDict,
    EndpointDescriptionDict,
    EndpointFidelityDict,
    EndpointRepairDict,
    EndpointRepairFidelityDict,
    EndpointRewrittenRequestDict,
    EndpointTurnDict,
    MeasuredGroupDict,
    NotApplicableDict,
    RepairDict,
    RepairFidelityDict,
    RepairResultDict,
    RewrittenRequestDict,
)
from kvscope.engine.audit.scan.token_pass import SessionSummary, TrafficRequest
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
    ReadingDict,
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


class PromptAudit(TypedDict):
    """One prompt with a new value (``audit FILE --find … --new …``), or the measured turns in that shape: the settings
    and each turn."""

    model: str
    dtype: str
    threshold: float
    min_agreement: float
    generated_tokens: int
    repairs: list[str]
    grain: str | None
    turns: list[AuditTurnDict]
    gate: NotRequired[GateDict]


class LogAudit(ReadingDict):
    """A request log audited: how it was read, the token pass over every request (the engines' reuse, sessions, causes,
    observed and hosted counts), the change groups with the turns measured, and where asked for the fleets, a rewrite,
    an endpoint's measurements and the gate."""

    model: str
    dtype: str
    formats: dict[str, int]
    skipped: list[Skipped]
    skipped_count: int
    engines: EnginesDict
    sessions: list[SessionSummary]
    causes: dict[str, CauseCountDict]
    observed: ObservedDict
    hosted: HostedDict
    requests: list[TrafficRequest]
    sample: int
    sampled: bool
    threshold: float
    min_agreement: float
    generated_tokens: int
    repairs: list[str]
    grain: str | None
    groups: list[MeasuredGroupDict]
    turns: list[AuditTurnDict]
    fleet: NotRequired[list[FleetDict]]
    cancelled: NotRequired[str]  # the model pass was cancelled: why no turn was measured
    pending: NotRequired[str]  # the token pass shown while the model pass runs: what it is measuring
    rewrite: NotRequired[list[RewrittenRequestDict | EndpointRewrittenRequestDict]]
    verdict: NotRequired[str]
    endpoint: NotRequired[EndpointAuditDict]
    gate: NotRequired[GateDict]
    sample_bound: NotRequired[str]  # why a host lowered the sample (the app's public profile)


AuditJSON = LogAudit | PromptAudit  # what ``python -m kvscope audit … --json`` prints

__all__ = [
    "AuditJSON",
    "AuditTurnDict",
    "CacheSettingsDict",
    "CandidateDict",
    "CauseCountDict",
    "CauseDict",
    "EndpointAuditDict",
    "EndpointDescriptionDict",
    "EndpointFidelityDict",
    "EndpointRepairDict",
    "EndpointRepairFidelityDict",
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
    "LogAudit",
    "MeasuredGroupDict",
    "MetricsDict",
    "NotApplicableDict",
    "ObservedDict",
    "ObservedFitDict",
    "PromptAudit",
    "PromptsOnlyDict",
    "ReadingDict",
    "RepairDict",
    "RepairFidelityDict",
    "RepairResultDict",
    "RewrittenRequestDict",
    "ServerCountedDict",
    "TotalsDict",
    "TrafficGroupDict",
]
