"""What the server or provider reported cached (``Request.observed_cached_tokens``) held against the simulated engines.

Per request, against the compared engine (``--observed-engine``, vLLM by default): observed below the simulation is an
``observed_shortfall`` cause, above it an ``observed_excess``; each names the token gap and, in words, what the log's
own evidence points to (another block size when the observed count is the shared prefix in whole blocks of another
size; a time-to-live when the matched request is long past; another replica when the match is another session's;
eviction when other requests were cached in between; another tokenizer when the log names a model the loaded one is
not). A request without an observed count (None: not reported) is never read as zero: it is left out of every
comparison and counted apart. Per log: the observed hit rate beside each engine's over the same requests, and the
share where observed equals simulated. ``fit_observed`` re-runs only the block cache over the token pass's ids for
a grid of block sizes and KV budgets, and names the settings that reproduce the most observed counts exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol

import numpy as np
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from kvscope.engine.audit.changes.causes import Cause
from kvscope.engine.audit.logs.requests import Request, RequestLogError
from kvscope.engine.audit.paged_blocks import BLOCK_SIZES, block_hashes
from kvscope.engine.audit.report.records import HIDDEN, OMITTED, Record, derived
from kvscope.engine.audit.simulate.hosted import TOKENS_NOTE, provider_of
from kvscope.engine.audit.simulate.metrics import ServerMetrics
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.registry import CACHES, DEFAULT_ENGINE, ENGINES, PROVIDERS, engine_of_answer

OBSERVED_ENGINES = tuple(ENGINES)  # the engines --observed-engine may compare with
OBSERVED_CAUSES = ("observed_shortfall", "observed_excess")  # causes of a gap to what the server reported, not of a miss
TTL_HINT_SECONDS = 300.0  # a match this long past points to a time-to-live (the shortest documented: Anthropic's 5 minutes)
NO_OBSERVED_COUNTS = "--fit-observed needs observed cached tokens: no request of the log reports a cached count"
EXPLANATIONS = "eviction under a budget, another replica, a time-to-live, another block size, or a tokenizer that is not the served model's"


class Row(Protocol):
    """What this module reads of a token pass's row (``traffic_scan.TrafficRequest``)."""

    request: int
    session: str | None
    tokens: int
    matched_request: int | None
    common_prefix_tokens: int
    causes: tuple[Cause, ...]
    reused_tokens: dict[str, int]
    breakpoints: tuple[tuple[str, int | None], ...]
    observed_cached_tokens: int | None
    hosted_reused_tokens: dict[str, int]
    observed_prompt_tokens: int | None
    model: str | None


@dataclass(frozen=True)
class Reported:
    """What a request's record says besides its text, as the comparison reads it."""

    index: int
    timestamp: float | None
    model: str | None
    observed_cached_tokens: int | None
    observed_prompt_tokens: int | None = None
    session_key: str | None = None  # the record's key its session was read from (``RequestLog.reading``)
    slot: int | None = None  # the llama-server slot the request pins (``id_slot``)
    answer_marks: tuple[str, ...] = ()  # what its logged answer says of its server (``usage.answer_marks``)

    @classmethod
    def of(cls, request: Request) -> Reported:
        return cls(
            request.index,
            request.timestamp,
            request.model,
            request.observed_cached_tokens,
            request.observed_prompt_tokens,
            request.session_key,
            request.slot,
            request.answer_marks,
        )


@dataclass(frozen=True)
class LogServer:
    """The serving engine a log's observed counts are compared with and the evidence, in words (named by the user,
    read from the answers the log records, or assumed: ``assumed``), and how many requests pin a llama-server slot
    (``id_slot``)."""

    engine: str
    evidence: str
    pinned: int = 0
    assumed: bool = False


def log_server(reported: Sequence[Reported], named: str | None = None) -> LogServer:
    """The server that wrote the log: ``named`` (``--observed-engine``) where given, else the serving engine most of
    its answers name (``registry.engine_of_answer``: each engine reads its own marks), else ``DEFAULT_ENGINE``, said so."""
    if named is not None and named not in OBSERVED_ENGINES:
        raise RequestLogError(f"--observed-engine is one of {', '.join(OBSERVED_ENGINES)}, got {named!r}")
    pinned = sum(item.slot is not None for item in reported)
    found: dict[str, list[str]] = {}
    for item in reported:
        hit = engine_of_answer(item.answer_marks)
        if hit is not None:
            found.setdefault(hit[0], []).append(hit[1])
    read = max(found, key=lambda name: len(found[name]), default=None)
    said = f"{len(found[read]):,} of the log's {len(reported):,} answers carry {found[read][0]}" if read else ""
    if named is not None:
        return LogServer(named, "named by --observed-engine" + (f" (the log's answers name {read}: {said})" if read else ""), pinned)
    if read is not None:
        return LogServer(read, said, pinned)
    return LogServer(DEFAULT_ENGINE, f"no answer in the log names its server: {DEFAULT_ENGINE} assumed (the default)", pinned, assumed=True)


@dataclass(frozen=True)
class Observation:
    """What one request adds to its row: the observed count, its gap cause (if any), its provider's simulated reuse."""

    observed_cached_tokens: int | None
    causes: tuple[Cause, ...]
    hosted_reused_tokens: dict[str, int]
    observed_prompt_tokens: int | None = None


def observe(
    rows: Sequence[Row], reported: Sequence[Reported], hosted: Sequence[dict[str, int]], engine: str, block: int, model: str
) -> list[Observation]:
    """Per row of the token pass (in time order, one per ``reported``): its observed count, its observed cause against
    ``engine``, and ``hosted``: its hosted provider's simulated reuse (``hosted``, fed by ``step``)."""
    if engine not in OBSERVED_ENGINES:
        raise RequestLogError(f"--observed-engine is one of {', '.join(OBSERVED_ENGINES)}, got {engine!r}")
    evidence = _Evidence(rows, {item.index: item for item in reported}, block, model)
    out = []
    for row, item, provider in zip(rows, reported, hosted, strict=True):
        observed = item.observed_cached_tokens
        causes = () if observed is None else evidence.causes(row, observed, row.reused_tokens[engine], engine)
        out.append(Observation(observed, causes, provider, item.observed_prompt_tokens))
    return out


class _Evidence:
    """What the log says about a request's observed gap: times, sessions, tokens in between, the model named."""

    def __init__(self, rows: Sequence[Row], requests: Mapping[int, Reported], block: int, model: str):
        self.requests = requests
        self.block = block
        self.model = model
        self.position = {row.request: n for n, row in enumerate(rows)}
        self.before = np.concatenate([[0], np.cumsum([row.tokens for row in rows])])  # tokens of the rows before each position
        self.sessions = {row.request: row.session for row in rows}

    def causes(self, row: Row, observed: int, simulated: int, engine: str) -> tuple[Cause, ...]:
        if observed == simulated:
            return ()
        gap = abs(observed - simulated)
        said = f"observed {observed:,} cached tokens, simulated {engine} {simulated:,}"
        if observed < simulated:
            found = self.shortfall(row, observed, simulated, engine)
            words = f"likely {'; '.join(found)}" if found else f"the log alone does not say which of: {EXPLANATIONS}"
            return (Cause("observed_shortfall", f"{said}: {gap:,} fewer; {words}", gap),)
        found = self.excess(row, observed, simulated, engine)
        return (Cause("observed_excess", f"{said}: {gap:,} more; the simulation missed {'; or '.join(found)}", gap),)

    def shortfall(self, row: Row, observed: int, simulated: int, engine: str) -> list[str]:
        usable = min(row.common_prefix_tokens, row.tokens - 1)
        found = []
        size = _block_size(observed, usable, [b for b in BLOCK_SIZES if b > CACHES[engine].cache.granule(self.block)])
        if size is not None:
            found.append(f"another block size: {observed:,} is the {usable:,} shared tokens in whole {size}-token blocks")
        elif simulated - observed < self.block:
            found.append(f"another block size: the gap is under one {self.block}-token block")
        matched = row.matched_request
        if matched is not None:
            elapsed = self._elapsed(row.request, matched)
            if elapsed is not None and elapsed >= TTL_HINT_SECONDS:
                found.append(f"a time-to-live: {elapsed:,.0f} s since the matched request {matched}")
            if self.sessions.get(matched) != row.session:
                found.append(f"another replica: the matched request {matched} is another session's")
            between = int(self.before[self.position[row.request]] - self.before[self.position[matched] + 1])
            if between > 0:
                found.append(f"eviction under a budget: {between:,} tokens of other requests were cached since request {matched}")
        named = self._other_tokenizer(row.request)
        if named:
            found.append(named)
        return found

    def excess(self, row: Row, observed: int, simulated: int, engine: str) -> list[str]:
        usable = min(row.common_prefix_tokens, row.tokens - 1)
        found = []
        if observed > usable:
            found.append(
                f"more than the {usable:,} tokens any earlier prompt of the log shares with it (in the loaded model's tokens): "
                "an earlier reply the log does not record and no later turn resends (servers cache what they generate), "
                "another tokenizer, or a cache warmed by requests not in the log"
            )
        elif hint := CACHES[engine].cache.excess_hint(observed, usable, self.block):
            found.append(hint)
        if simulated < usable and observed <= usable:
            found.append("a larger KV budget than simulated: the simulation evicted what the server still held")
        named = self._other_tokenizer(row.request)
        if named and observed <= usable:
            found.append(named)
        return found or ["something: the server reused more than this simulation can"]

    def _elapsed(self, request: int, matched: int) -> float | None:
        now, then = self.requests[request].timestamp, self.requests[matched].timestamp
        return None if now is None or then is None else now - then

    def _other_tokenizer(self, request: int) -> str | None:
        named = self.requests[request].model
        if not named:
            return None
        if provider_of(named) or not _same_model(named, self.model):
            return f"a tokenizer that is not the served model's: the log names {named}, the audit counts {self.model}'s tokens"
        return None


def _block_size(observed: int, usable: int, sizes: Sequence[int]) -> int | None:
    """The first block size whose whole blocks of the ``usable`` shared tokens are exactly ``observed``."""
    return next((size for size in sizes if usable // size * size == observed), None)


def _same_model(named: str, loaded: str) -> bool:
    """Whether a model name in the log can be the loaded model (one name holds the other's last part)."""
    a, b = named.lower().rsplit("/", 1)[-1], loaded.lower().rsplit("/", 1)[-1]
    return a in b or b in a


@dataclass(frozen=True)
class Gap(Record):
    """Requests whose observed count falls short of (or exceeds) the simulation, and the tokens."""

    requests: int
    tokens: int


@dataclass(frozen=True)
class ServerCounted(Record):
    """The cached and prompt tokens as the server counted both, where it logged both (else 0, 0)."""

    cached_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class ObservedSummary(Record):
    """The cached tokens the log reports against the simulation, over the requests that carry a count (``requests``;
    ``unreported``: those without), with the fit and the server's scrapes where asked for."""

    engine: str
    evidence: Annotated[str, Field(serialization_alias="engine_evidence"), OMITTED]  # why that engine (``LogServer.evidence``)
    requests: Annotated[int, Field(serialization_alias="requests_with_count")]
    unreported: Annotated[int, Field(serialization_alias="requests_without_count")]
    tokens: int
    observed_tokens: int
    hit_rate: dict[str, float | None] = derived()  # observed beside each engine's: ``hit_rates``
    observed_rate_over: str = derived()  # what the observed rate is over, in words
    server_counted: ServerCounted
    equal: int
    equal_share: float | None = derived()
    shortfalls: Gap
    excesses: Gap
    fit: Annotated[ObservedFit | None, OMITTED] = None  # --fit-observed
    metrics: Annotated[ServerMetrics | None, OMITTED] = None  # --metrics
    # per engine (and provider): (tokens reused, tokens of the requests it covers)
    reused: Annotated[dict[str, tuple[int, int]], HIDDEN] = dataclasses.field(default_factory=dict)
    other_tokenizer: Annotated[str | None, HIDDEN] = None  # the model the log names where its tokenizer is not the loaded one

    def __post_init__(self) -> None:
        self.derive(hit_rate=self.hit_rates(), observed_rate_over=self.observed_over(), equal_share=_rate(self.equal, self.requests))

    def hit_rates(self) -> dict[str, float | None]:
        """The observed rate over the server's own prompt counts where the log carries them (a rate over the same tokens
        that were counted), else over the loaded tokenizer's; each engine's over the loaded tokenizer's."""
        counted = self.server_counted
        if counted.prompt_tokens:
            observed = _rate(counted.cached_tokens, counted.prompt_tokens)
        else:
            observed = _rate(self.observed_tokens, self.tokens)
        return {"observed": observed} | {name: _rate(reused, tokens) for name, (reused, tokens) in self.reused.items()}

    def observed_over(self) -> str:
        """What the observed rate is over, in words."""
        prompt = self.server_counted.prompt_tokens
        if not prompt:
            return "the loaded tokenizer's prompt tokens (the log carries no prompt count of its own)"
        words = f"the {prompt:,} prompt tokens the server counted (usage.prompt_tokens and its kin)"
        if self.other_tokenizer:
            words += f"; the log names {self.other_tokenizer}, not the loaded model: its tokens are not the engines'"
        return words


def _rate(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def observed_summary(rows: Sequence[Row], engine: str, model: str = "", evidence: str = "") -> ObservedSummary:
    """The log's observed hit rate beside each engine's (the simulated ones and any hosted provider's, each over the
    requests with a count that it covers), and how many requests match the compared ``engine`` exactly. The observed
    rate is over the server's own prompt counts where every counted request logs one; ``model``: the loaded model, to
    say when the log's model is another."""
    counted = [row for row in rows if row.observed_cached_tokens is not None]
    both = [row for row in counted if row.observed_prompt_tokens]
    server = (0, 0)
    if len(both) == len(counted):
        server = (sum(r.observed_cached_tokens for r in both), sum(r.observed_prompt_tokens for r in both))
    reused = {engine: (sum(r.reused_tokens[engine] for r in counted), sum(r.tokens for r in counted)) for engine in ENGINES}
    for provider in PROVIDERS:
        covered = [row for row in counted if provider in row.hosted_reused_tokens]
        if covered:
            reused[provider] = (sum(r.hosted_reused_tokens[provider] for r in covered), sum(r.tokens for r in covered))

    def gaps(name: str) -> Gap:
        found = [cause.tokens for row in counted for cause in row.causes if cause.name == name]
        return Gap(len(found), sum(found))

    return ObservedSummary(
        engine=engine,
        evidence=evidence,
        requests=len(counted),
        unreported=len(rows) - len(counted),
        tokens=sum(row.tokens for row in counted),
        observed_tokens=sum(row.observed_cached_tokens for row in counted),
        server_counted=ServerCounted(*server),
        equal=sum(row.observed_cached_tokens == row.reused_tokens[engine] for row in counted),
        shortfalls=gaps("observed_shortfall"),
        excesses=gaps("observed_excess"),
        reused=reused,
        other_tokenizer=_named_model(rows, model),
    )


def _named_model(rows: Sequence[Row], model: str) -> str | None:
    """The model a counted request names where it is a hosted one or not the loaded ``model`` (None: none such)."""
    for row in rows:
        named = row.model
        if named and (provider_of(named) or (model and not _same_model(named, model))):
            return named
    return None


@dataclass(frozen=True)
class HostedProvider(Record):
    """A hosted provider's simulated cache over the requests naming its models: its rule, requests, tokens, reuse."""

    rule: str
    requests: int
    tokens: int
    reused_tokens: int
    hit_rate: float | None = derived()

    def __post_init__(self) -> None:
        self.derive(hit_rate=_rate(self.reused_tokens, self.tokens))


Hosted = dict[str, HostedProvider | str]  # per provider the log names, and "note" (a string) when any


def hosted_summary(rows: Sequence[Row]) -> Hosted:
    """Per hosted provider the log's requests name: its rule, the requests, tokens and tokens its simulation reuses, and
    the hit rate (empty for a log of no hosted model)."""
    out: Hosted = {}
    for provider, rule in PROVIDERS.items():
        covered = [row for row in rows if provider in row.hosted_reused_tokens]
        if covered:
            tokens, reused = sum(r.tokens for r in covered), sum(r.hosted_reused_tokens[provider] for r in covered)
            out[provider] = HostedProvider(rule, len(covered), tokens, reused)
    return out | ({"note": TOKENS_NOTE} if out else {})


@dataclass(frozen=True)
class FitSetting(Record):
    """One setting of the compared engine tried by ``fit_observed`` and the requests whose observed count it reproduces;
    the setting's keys (its names, as the engine's ``fit_grid`` names them: vLLM block, budget_tokens; SGLang page,
    budget_tokens; llama.cpp slots, prompt_cache, cache_reuse) stand beside ``matches``."""

    setting: dict[str, int | bool | None]
    matches: int

    @model_serializer(mode="wrap")
    def _beside(self, fields: SerializerFunctionWrapHandler) -> dict[str, int | bool | float | None]:
        """The setting's keys, then the record's own."""
        out = fields(self)
        return {**out.pop("setting"), **out}


@dataclass(frozen=True)
class FitBest(FitSetting):
    """The best setting, with its share of the requests with a count."""

    share: float | None


@dataclass(frozen=True)
class ObservedFit(Record):
    """``--fit-observed``: the compared engine's settings tried over the requests with an observed count, best first."""

    engine: str
    requests: Annotated[int, Field(serialization_alias="requests_with_count")]
    working_set_tokens: int  # tokens an unbounded token cache holds after the whole log
    best: FitBest = derived()
    tied: tuple[FitSetting, ...] = derived()  # as many matches as the best
    tried: tuple[FitSetting, ...]  # most matches first; among ties, in the order tried (the engine's ``fit_grid``)

    def __post_init__(self) -> None:
        first = self.tried[0]
        best = FitBest(first.setting, first.matches, _rate(first.matches, self.requests))
        self.derive(best=best, tied=tuple(s for s in self.tried if s.matches == best.matches))


def fit_observed(rows: Sequence[Row], held: Callable[[int], np.ndarray], engine: str = DEFAULT_ENGINE) -> ObservedFit:
    """The settings of ``engine``'s server (its ``fit_grid``: vLLM's block size and budget, SGLang's page size and
    budget, llama.cpp's slots, prompt cache and ``--cache-reuse``) that reproduce the most observed counts exactly, over
    the token pass's ``rows`` and what the server held after each (``held``: request -> its tokens and its reply's,
    ``TrafficScan.held``): the engine's cache re-run per setting, fed in the pass's order."""
    counted = [(n, row.observed_cached_tokens) for n, row in enumerate(rows) if row.observed_cached_tokens is not None]
    if not counted:
        raise RequestLogError(NO_OBSERVED_COUNTS)
    if engine not in OBSERVED_ENGINES:
        raise RequestLogError(f"--observed-engine is one of {', '.join(OBSERVED_ENGINES)}, got {engine!r}")
    ids = [held(row.request) for row in rows]
    # per request and block size, its block hashes, computed once for every budget; block 1's also count the working set
    chains: dict[tuple[int, int], np.ndarray] = {(n, 1): block_hashes(item, 1) for n, item in enumerate(ids, 1)}
    working = int(len(np.unique(np.concatenate(list(chains.values()))))) if ids else 0  # one key per prefix held
    cache = CACHES[engine].cache
    tried = []
    for setting in cache.fit_grid(working):
        simulated, block = cache.fitted(setting), setting.get("block")
        reused = []
        for n, (item, row) in enumerate(zip(ids, rows), 1):
            if block is not None and (n, block) not in chains:
                chains[n, block] = block_hashes(item, block)
            hashes = None if block is None else chains[n, block]
            reused.append(simulated.insert(CacheRequest(item[: row.tokens], row.request, row.session, n, held=item, hashes=hashes)))
        tried.append(FitSetting(setting, sum(reused[n] == observed for n, observed in counted)))
    ranked = sorted(range(len(tried)), key=lambda k: (-tried[k].matches, k))
    return ObservedFit(engine, len(counted), working, tuple(tried[k] for k in ranked))
