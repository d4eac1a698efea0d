"""The one part of the audit's JSON report still built as a dict, typed: a repair measured on a turn
(``measure.repairs.RepairResult.as_dict``, with the turn's ``within_bars``: ``measure.turn.AuditTurn``).

Every other part is a record (``report.records.Record``: its JSON and schema derived from its dataclass); the report as
a whole (``LogAudit``, ``PromptAudit``) and its JSON Schema are ``ci.report``'s. Text only: no torch, no stage imported,
and no ``from __future__ import annotations`` (``NotRequired`` must stay readable to ``__required_keys__``).
"""

from typing import NotRequired

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11


class RepairResultDict(TypedDict):
    """One repair on one turn: its cost and fidelity against the clean prefill (null where it does not apply, with its
    ``reason``), and what a prompt-level repair changed."""

    applicable: bool
    level: str
    reason: NotRequired[str | None]
    reused_tokens: int | None
    computed_tokens: int | None
    ttft_ms: float | None
    ttft_ratio: float | None
    kl: float | None
    top1_agree: bool | None
    top5_overlap: float | None
    generation_agreement: float | None
    generated_common_prefix: int | None
    prompt_changed: NotRequired[bool]
    grain: NotRequired[str | None]
    coarse_values: NotRequired[dict[str, str]]


class RepairDict(RepairResultDict):
    """One repair on one turn as the report holds it: with whether it holds the bars the recommendation judged it
    against (null where it does not apply)."""

    within_bars: bool | None
