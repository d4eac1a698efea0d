"""The token pass's parts of the report: how the log was read (``logs``), what changed and why a request misses
(``changes``), the simulated caches' reuse and the observed counts (``simulate``), every request, session and change group
(``scan``)."""

from typing import NotRequired

from typing_extensions import TypedDict  # pydantic reads a TypedDict from typing_extensions on Python 3.11

# ------------------------------------------------------------------------------------------------------------- logs


# ---------------------------------------------------------------------------------------------------------- changes


# --------------------------------------------------------------------------------------------------------- simulate


class PromptsOnlyDict(TypedDict):
    """Each engine's reuse were no reply ever cached."""

    reused_tokens: dict[str, int]
    hit_rate: dict[str, float]


class TotalsDict(TypedDict):
    """The log's requests and prompt tokens, each engine's reuse and hit rate (with replies cached, and prompts only),
    and where the replies came from (``simulate.step.REPLY_COUNTS``)."""

    requests: int
    tokens: int
    reused_tokens: dict[str, int]
    hit_rate: dict[str, float]
    prompts_only: PromptsOnlyDict
    replies: dict[str, int]


class ServerCountedDict(TypedDict):
    """The cached and prompt tokens as the server counted both, where it logged both."""

    cached_tokens: int
    prompt_tokens: int


class GapDict(TypedDict):
    """Requests whose observed count falls short of (or exceeds) the simulation, and the tokens."""

    requests: int
    tokens: int


class FitSettingDict(TypedDict):
    """One setting of the compared engine tried by ``--fit-observed`` (vLLM: block, budget_tokens; SGLang: page,
    budget_tokens; llama.cpp: slots, prompt_cache, cache_reuse), and the requests whose observed count it reproduces."""

    block: NotRequired[int]
    page: NotRequired[int]
    budget_tokens: NotRequired[int | None]
    slots: NotRequired[int | None]
    prompt_cache: NotRequired[bool]
    cache_reuse: NotRequired[int]
    matches: int


class FitBestDict(FitSettingDict):
    """The best setting, with its share of the requests with a count."""

    share: float | None


class ObservedFitDict(TypedDict):
    """``--fit-observed``: the settings tried over the requests with an observed count, best first."""

    engine: str
    requests_with_count: int
    working_set_tokens: int
    best: FitBestDict
    tied: list[FitSettingDict]
    tried: list[FitSettingDict]


class MetricsDict(TypedDict):
    """``--metrics``: what the server's Prometheus scrapes say beside each engine's simulated hit rate (``hits`` and
    ``queries`` from counters; a hit-rate gauge gives the rate alone)."""

    source: str
    hits: NotRequired[int]
    queries: NotRequired[int]
    hit_rate: float | None
    simulated_hit_rate: dict[str, float]


class ObservedDict(TypedDict):
    """The cached tokens the log reports against the simulation, over the requests that carry a count."""

    engine: str
    engine_evidence: NotRequired[str]  # why that engine: named, read from the log's answers, or assumed
    requests_with_count: int
    requests_without_count: int
    tokens: int
    observed_tokens: int
    hit_rate: dict[str, float | None]
    observed_rate_over: str
    server_counted: ServerCountedDict
    equal: int
    equal_share: float | None
    shortfalls: GapDict
    excesses: GapDict
    fit: NotRequired[ObservedFitDict]
    metrics: NotRequired[MetricsDict]


class HostedProviderDict(TypedDict):
    """A hosted provider's simulated cache over the requests naming its models: its rule, requests, tokens, reuse."""

    rule: str
    requests: int
    tokens: int
    reused_tokens: int
    hit_rate: float | None


HostedDict = dict[str, HostedProviderDict | str]  # per provider the log names, and "note" (a string) when any


# ------------------------------------------------------------------------------------------------------------- scan


class CauseCountDict(TypedDict):
    """One cause over the log: the requests it occurs in, its occurrences, and the tokens it costs."""

    requests: int
    occurrences: int
    tokens: int


class TrafficGroupDict(TypedDict):
    """One change signature: its requests, their share of the tokens, and the turns measured (or why none)."""

    signature: str
    count: int
    tokens: int
    token_share: float
    requests: list[int]
    measurable: int
    measured: list[int]
    reason: str | None
