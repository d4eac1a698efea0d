"""The model pass's parts of the report: each measured turn with every repair and the recommendation (``measure``), a
rewrite measured against the original (``rewrite``), and the same on a served model (``endpoint``)."""

from typing import Literal, NotRequired

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11

# ---------------------------------------------------------------------------------------------------------- measure


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


# ---------------------------------------------------------------------------------------------------------- rewrite


class RewrittenRequestDict(TypedDict):
    """One request before and after the rewrite: tokens and reuse per engine, and the output compared."""

    request: int
    tokens_before: int
    tokens_after: int
    reused_tokens_before: dict[str, int]
    reused_tokens_after: dict[str, int]
    kl: float
    top1_agree: bool
    top5_overlap: float
    generation_agreement: float
    generated_common_prefix: int
    same_text: bool
    original_text: str
    rewritten_text: str
    verdict: str


class EndpointRewrittenRequestDict(RewrittenRequestDict):
    """A rewritten request measured on an endpoint: the KL's bound, and the server's cached tokens beside the simulated."""

    kl_bound: float
    tail_mass: float
    top_k: int
    server_cached_tokens_before: int | None
    server_cached_tokens_after: int | None
    simulated_engine: str
    simulated_reused_tokens_before: int
    simulated_reused_tokens_after: int


# --------------------------------------------------------------------------------------------------------- endpoint


class EndpointFidelityDict(TypedDict):
    """One prompt's answer on an endpoint against the reference's, with the KL's bound from the top-k log-probs."""

    kl: float
    kl_bound: float
    tail_mass: float
    top_k: int
    top1_agree: bool
    top5_overlap: float
    generation_agreement: float
    generated_common_prefix: int
    same_text: bool


class EndpointRepairDict(EndpointFidelityDict):
    """A prompt-level repair measured on an endpoint."""

    applicable: Literal[True]
    within_bars: bool
    server_cached_tokens: int | None


class NotApplicableDict(TypedDict):
    """A repair that does not apply (or that an endpoint cannot measure), and why."""

    applicable: Literal[False]
    reason: str


class EndpointTurnDict(TypedDict):
    """One sampled turn on the endpoint: the server's cached tokens for the reference, the simulation's, each repair."""

    request: int
    matched_request: int
    server_cached_tokens: int | None
    simulated_reused_tokens: dict[str, int]
    repairs: dict[str, EndpointRepairDict | NotApplicableDict]


class EndpointDescriptionDict(TypedDict):
    """The endpoint as the report names it (never its key)."""

    url: str
    model: str | None
    served_by: str | None
    sent_as: str | None
    top_k: int
    kl_bound: str
    cache_file: str | None


class EndpointAuditDict(EndpointDescriptionDict):
    """``--endpoint``: the endpoint, the repairs it cannot measure and why, and the sampled turns measured on it."""

    not_measurable: dict[str, str]
    turns: list[EndpointTurnDict]
