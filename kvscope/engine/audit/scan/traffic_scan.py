"""The token pass over a whole request log (no model forward): every request rendered once (the fast tokenizer's batch
path), matched with the earlier request it shares the longest token prefix with (a radix tree, so no request is
compared with every other), the pair diffed (fields, growth, structural changes), the causes named, every simulated
cache fed through one step (``simulation``: the engines, with the replies servers cache, the hosted providers' caches
and any fleets), and the log's observed counts compared (``observed``). Turns are then grouped by change signature
(the causes and fields that changed, and whether the request grew), and up to K of each group picked for the model
pass (``traffic.audit_traffic``).

Nothing here imports torch: the distributed pass's workers (``distributed``) run it with the tokenizer alone.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import Field

from kvscope.engine.audit.changes.causes import Cause, another_prompt, causes_of
from kvscope.engine.audit.changes.fields import TurnDiff, common_prefix, compare_requests
from kvscope.engine.audit.logs.render import RenderedLog, RenderedRequest, Renderer, end_of_turn_ids
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError, Skipped
from kvscope.engine.audit.report.records import HIDDEN, Record, derived, rounded
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.simulate.budgets import Budget
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.fleet import FleetResult, hit_rates
from kvscope.engine.audit.simulate.hosted import hosted_request
from kvscope.engine.audit.simulate.observed import Reported, observe
from kvscope.engine.audit.simulate.registry import ENGINES, budgets
from kvscope.engine.audit.simulate.step import REPLY_COUNTS, Simulation, Step
from kvscope.engine.progress import StepProgress

if TYPE_CHECKING:
    from kvscope.engine.audit.logs.requests import ReadingDict

_PROGRESS_STEPS = 50  # progress reports per phase of the token pass


@dataclass(frozen=True)
class Breakpoint(Record):
    """A ``cache_control`` breakpoint of a request: its label, and the token the user asked the provider to cache up to
    (None: after the tool definitions)."""

    label: str
    token: int | None


@dataclass(frozen=True)
class TrafficRequest(Record):
    """One request after the token pass: its match, what changed, why it misses, and what each engine reuses."""

    request: int
    line: int
    session: str | None
    tokens: int
    matched_request: int | None
    common_prefix_tokens: int
    appended_tokens: int
    fields: tuple[str, ...]
    causes: tuple[Cause, ...]
    reused_tokens: dict[str, int]  # per engine (``registry.ENGINES``)
    signature: str
    breakpoints: Annotated[tuple[Breakpoint, ...], Field(serialization_alias="cache_breakpoints")] = ()
    observed_cached_tokens: int | None = None  # what the server reported cached (None: not reported)
    observed_prompt_tokens: int | None = None  # the prompt as the server counted it (None: not reported)
    hosted_reused_tokens: dict[str, int] = field(default_factory=dict)  # its hosted provider's simulated reuse (``hosted``)
    prompts_only_reused_tokens: Annotated[dict[str, int], HIDDEN] = field(default_factory=dict)  # per engine, were no reply ever cached
    model: Annotated[str | None, HIDDEN] = None  # the model its record names


@dataclass(frozen=True)
class SessionSummary(Record):
    """One session's requests, tokens and tokens reused per engine."""

    session: str | None
    requests: int
    tokens: int
    reused_tokens: dict[str, int]


@dataclass(frozen=True)
class TrafficScan:
    """The token pass over a log: every request, its sessions, the records skipped and the settings it ran with.
    ``rendered`` (request index -> tokens) and ``diffs`` are kept for measuring, not reported: mappings that may render
    and diff again when read (``RenderedLog``, ``TurnDiffs``)."""

    requests: tuple[TrafficRequest, ...]
    skipped: tuple[Skipped, ...]
    formats: dict[str, int]
    settings: ScanSettings
    rendered: Mapping[int, RenderedRequest] = field(repr=False)
    diffs: Mapping[int, TurnDiff] = field(repr=False)
    observed_evidence: str = ""  # why the observed engine: named, read from the log's answers, or assumed (``observed.LogServer``)
    reading: ReadingDict = field(default_factory=dict)  # how the log was read: RequestLog.reading()
    fleet: tuple[FleetResult, ...] = ()  # the fleets simulated (``fleet.Fleet``), when asked for
    replies: dict[str, int] = field(default_factory=dict)  # requests per ``step.REPLY_COUNTS`` key
    reply_from: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)  # request -> (next turn, reply tokens it resent)
    cache_tokens: dict[str, int] = field(default_factory=dict)  # tokens each serving engine's cache held at the end (``Simulation.held``)

    def held(self, request: int) -> np.ndarray:
        """What the simulated servers held after ``request``: its tokens and its reply's (logged, or resent by the
        next turn of its session)."""
        rendered = self.rendered[request]
        if request not in self.reply_from:
            return rendered.held
        following, tokens = self.reply_from[request]
        return self.rendered[following].token_ids[: len(rendered) + tokens]

    def sessions(self) -> list[SessionSummary]:
        """Per session (in order of first appearance): requests, tokens and reuse per engine."""
        grouped: dict[str | None, list[TrafficRequest]] = {}
        for row in self.requests:
            grouped.setdefault(row.session, []).append(row)
        return [
            SessionSummary(key, len(rows), sum(r.tokens for r in rows), {e: sum(r.reused_tokens[e] for r in rows) for e in ENGINES})
            for key, rows in grouped.items()
        ]

    def groups(self) -> dict[str, list[TrafficRequest]]:
        """Requests by change signature, largest share of tokens first."""
        grouped: dict[str, list[TrafficRequest]] = {}
        for row in self.requests:
            grouped.setdefault(row.signature, []).append(row)
        return dict(sorted(grouped.items(), key=lambda item: -sum(r.tokens for r in item[1])))

    def totals(self) -> EngineTotals:
        """The log's tokens and each engine's reuse, with replies cached as servers cache them and with prompts only,
        and where the replies came from (``step.REPLY_COUNTS``)."""
        tokens = sum(row.tokens for row in self.requests)
        reused = {engine: sum(row.reused_tokens[engine] for row in self.requests) for engine in ENGINES}
        plain = {engine: sum(row.prompts_only_reused_tokens.get(engine, 0) for row in self.requests) for engine in ENGINES}
        replies = {key: self.replies.get(key, 0) for key in REPLY_COUNTS}
        return EngineTotals(
            self.settings.cache,
            budgets(self.settings.cache),
            len(self.requests),
            tokens,
            reused,
            PromptsOnly(plain, hit_rates(plain, tokens)),
            replies,
        )

    def cause_counts(self) -> dict[str, CauseCount]:
        """Per cause: the requests it occurs in, its occurrences, and the tokens it costs."""
        found: dict[str, list[Cause]] = {}
        requests: dict[str, int] = {}
        for row in self.requests:
            for cause in row.causes:
                found.setdefault(cause.name, []).append(cause)
            for name in {cause.name for cause in row.causes}:
                requests[name] = requests.get(name, 0) + 1
        return {name: CauseCount(requests[name], len(causes), sum(c.tokens for c in causes)) for name, causes in found.items()}


@dataclass(frozen=True)
class PromptsOnly(Record):
    """Each engine's reuse were no reply ever cached."""

    reused_tokens: dict[str, int]
    hit_rate: dict[str, float]


@dataclass(frozen=True)
class EngineTotals(Record):
    """The settings simulated, the budget each serving engine ran with (``registry.budgets``), the log's requests and
    prompt tokens, each engine's reuse and hit rate (with replies cached, and prompts only), and where the replies came
    from (``simulate.step.REPLY_COUNTS``)."""

    settings: CacheSettings
    budgets: list[Budget]
    requests: int
    tokens: int
    reused_tokens: dict[str, int]
    hit_rate: dict[str, float] = derived()
    prompts_only: PromptsOnly
    replies: dict[str, int]

    def __post_init__(self) -> None:
        self.derive(hit_rate=hit_rates(self.reused_tokens, self.tokens))


@dataclass(frozen=True)
class CauseCount(Record):
    """One cause over the log: the requests it occurs in, its occurrences, and the tokens it costs."""

    requests: int
    occurrences: int
    tokens: int


def scan_log(
    tokenizer: Any,
    log: RequestLog,
    settings: ScanSettings = ScanSettings(),
    *,
    model: str = "this model",
    progress: StepProgress = None,
) -> TrafficScan:
    """The token pass with ``settings``: render (each prompt cut at its context limit), match, diff, causes and every
    simulated engine and fleet, over every request of ``log`` (a request that cannot be rendered is skipped by name);
    then the observed counts against its observed engine and the hosted providers' caches (``observed.observe``).

    Memory follows what the simulated caches hold, not the log: requests are rendered as a stream, a batch at a
    time; only the latest rendered requests are kept (``RenderedLog``: an older one, read as a match or by the model
    pass, is rendered again), and each diff is kept as its match and its kind (``TurnDiffs``: computed again when read).
    The rows hold numbers and names. Token ids are ``(tokens,) int32`` numpy arrays throughout."""
    settings, server = settings.for_log([Reported.of(request) for request in log.requests])
    block = settings.cache.block
    rendered = RenderedLog(Renderer(tokenizer, settings.limit, model))
    diffs = TurnDiffs(rendered, block)
    simulation = Simulation(settings.cache, settings.fleet, end_of_turn_ids(tokenizer))
    skipped, rows, served, good = list(log.skipped), [], [], []
    every = max(len(log.requests) // _PROGRESS_STEPS, 1)
    with settling_heap() as settle:
        for time, (request, new) in enumerate(rendered.renderer.stream(log.requests), 1):
            if isinstance(new, RequestLogError):
                skipped.append(Skipped(request.line, "rendering", str(new)))
            else:
                rows.append(_simulated_row(simulation, rendered, diffs, new, served, block))
                good.append(request)
            if time % every == 0:
                settle()
            if progress and (time % every == 0 or time == len(log.requests)):
                progress(time, len(log.requests))
        simulation.finish()
        rows = observed_rows(rows, [Reported.of(request) for request in good], served, settings, model)
        return TrafficScan(
            tuple(rows),
            tuple(skipped),
            dict(log.formats),
            settings,
            rendered,
            diffs,
            observed_evidence=server.evidence,
            reading=log.reading(),
            fleet=tuple(simulated.result() for simulated in simulation.fleets),
            replies=dict(simulation.replies),
            reply_from=dict(simulation.reply_from),
            cache_tokens=simulation.held(),
        )


def _simulated_row(
    simulation: Simulation, rendered: RenderedLog, diffs: TurnDiffs, new: RenderedRequest, served: list[dict[str, int]], block: int
) -> TrafficRequest:
    """``new`` through every simulated cache, and its row against its match (whose diff ``diffs`` records); ``new``
    is then kept among the recent rendered requests, and its hosted provider's reuse appended to ``served``."""
    request = new.request
    hosted = hosted_request(new, breakpoint_tokens(new))
    step = Step(new.token_ids, new.reply_ids, request.index, request.session, request.reply is not None, hosted)
    result = simulation.step(step)
    old = None if result.matched is None else rendered[result.matched]
    row, diff = compared_row(old, new, result.matched, block)
    served.append(result.hosted)
    rendered.keep(new)
    if diff is not None:
        diffs.add(request.index, result.matched, diff)
    return dataclasses.replace(row, reused_tokens=result.reused, prompts_only_reused_tokens=result.prompts_only)


class TurnDiffs(Mapping[int, TurnDiff]):
    """Each request's diff against its match, by request, without holding them: kept as the match and whether the
    diff changes only messages' text (``flat``), and computed again from the rendered requests when read (the same
    ``compare_requests``, on the same tokens). A mapping of held diffs (the distributed pass's) reads the same."""

    def __init__(self, rendered: Mapping[int, RenderedRequest], block: int):
        self.rendered, self.block = rendered, block
        self._matched: dict[int, int] = {}  # request -> its match, for each request with a diff
        self._structural: set[int] = set()  # requests whose diff changes something outside messages' text

    def add(self, request: int, matched: int, diff: TurnDiff) -> None:
        self._matched[request] = matched
        if diff.structural:
            self._structural.add(request)

    def flat(self, request: int) -> bool:
        """Whether the request has a diff, and it changes only messages' text (no structural change)."""
        return request in self._matched and request not in self._structural

    def __getitem__(self, request: int) -> TurnDiff:
        matched = self._matched[request]
        return compare_requests(self.rendered[matched], self.rendered[request], self.block)

    def __iter__(self) -> Iterator[int]:
        return iter(self._matched)

    def __len__(self) -> int:
        return len(self._matched)

    def __contains__(self, request: object) -> bool:
        return request in self._matched


@contextmanager
def settling_heap() -> Iterator[Callable[[], None]]:
    """Within: ``settle()`` moves every object alive into the collector's permanent generation (``gc.freeze``), so that
    its collections scan only what was made since. A token pass keeps millions of small objects (rows, diffs, radix
    nodes, rendered requests) that each full collection would otherwise scan again: on a 2,000-request shard's records,
    unpickled beside ten others, 0.51 s with them against 0.05 s without. On exit they are collectable again."""
    try:
        yield gc.freeze
    finally:
        gc.unfreeze()


def observed_rows(
    rows: Sequence[TrafficRequest], reported: Sequence[Reported], hosted: Sequence[dict[str, int]], settings: ScanSettings, model: str
) -> list[TrafficRequest]:
    """The rows with what the log reports (``observed.observe``, against the settings' observed engine): the observed
    counts, their gap causes, the hosted providers' reuse; one function for the single-process and the distributed pass."""
    seen = observe(rows, reported, hosted, settings.observed_engine, settings.cache.block, model)
    return [
        dataclasses.replace(
            row,
            observed_cached_tokens=o.observed_cached_tokens,
            causes=row.causes + o.causes,
            hosted_reused_tokens=o.hosted_reused_tokens,
            observed_prompt_tokens=o.observed_prompt_tokens,
            model=item.model,
        )
        for row, o, item in zip(rows, seen, reported)
    ]


def compared_row(
    old: RenderedRequest | None, new: RenderedRequest, matched: int | None, block: int
) -> tuple[TrafficRequest, TurnDiff | None]:
    """``new``'s row against ``old``, the request ``matched`` it was matched with (None: no match), with its reuse
    left empty (the engines fill it), and their diff: one function for the single-process and the distributed pass."""
    shared, diff = _compared(old, new, block)
    causes = causes_of(old, new, diff, block)
    return _row(new, matched if shared else None, shared, diff, causes, {}), diff


def _compared(old: RenderedRequest | None, new: RenderedRequest, block: int) -> tuple[int, TurnDiff | None]:
    """The tokens ``new`` shares with its match, and their diff: none without a match, nor when the match is
    ``another_prompt`` (a diff would only list their differences; on interleaved logs, most of the diffing time)."""
    if old is None:
        return 0, None
    if another_prompt(old.request, new.request):
        return common_prefix(old.token_ids, new.token_ids), None
    diff = compare_requests(old, new, block)
    return diff.common_prefix_tokens, diff


def _row(
    new: RenderedRequest, matched: int | None, shared: int, diff: TurnDiff | None, causes: tuple[Cause, ...], reused: dict[str, int]
) -> TrafficRequest:
    fields = tuple(change.name for change in diff.fields) if diff else ()
    appended = len(new) - diff.growth_start if diff and matched else 0
    return TrafficRequest(
        new.request.index,
        new.request.line,
        new.request.session,
        len(new),
        matched,
        shared,
        appended,
        fields,
        causes,
        reused,
        signature(causes, appended > 0),
        tuple(Breakpoint(mark.label, token) for mark, token in zip(new.request.breakpoints, breakpoint_tokens(new))),
    )


def breakpoint_tokens(rendered: RenderedRequest) -> list[int | None]:
    """Per ``cache_control`` breakpoint of the request, the token it asks caching up to (None: after the tools)."""
    return [_breakpoint_token(rendered, mark.message, mark.chars) for mark in rendered.request.breakpoints]


def signature(causes: Sequence[Cause], grew: bool) -> str:
    """A turn's change signature: its causes (with the field each concerns) and whether it grew."""
    parts = sorted({f"{cause.name}:{cause.field}" if cause.field else cause.name for cause in causes})
    parts += ["growth"] if grew else []
    return " + ".join(parts) or "identical"


def _breakpoint_token(rendered: RenderedRequest, message: int | None, chars: int) -> int | None:
    """The token after which a ``cache_control`` breakpoint asks for caching (None: after the tool definitions,
    which the chat template places itself)."""
    if message is None or message >= len(rendered.content_spans):
        return None
    content = rendered.request.contents[message]
    lead = len(content) - len(content.lstrip())
    at = rendered.content_spans[message][0] + max(chars - lead, 0)
    return rendered.tokens_in(max(at - 1, 0), at).stop


@dataclass(frozen=True)
class TrafficGroup(Record):
    """One change signature: its requests, their share of the log's tokens, and the turns measured (up to K)."""

    signature: str
    count: int = derived()  # the group's requests
    tokens: int
    share: Annotated[float, Field(serialization_alias="token_share"), rounded(4)]
    requests: tuple[int, ...]
    measurable: int  # turns that share a prefix with their match and change only messages' text
    measured: tuple[int, ...]
    reason: str | None  # why none was measured, when none was

    def __post_init__(self) -> None:
        self.derive(count=len(self.requests))


def sample_groups(scan: TrafficScan, sample: int, unmeasured: str = "not measured: --sample 0") -> list[TrafficGroup]:
    """Every group, with up to ``sample`` of its measurable turns picked evenly across the log (first and last
    included); a turn is measurable when it shares a prefix with its match and changes only messages' text. A group
    with measurable turns but none picked gives ``unmeasured`` as its reason."""
    total = max(sum(row.tokens for row in scan.requests), 1)
    groups = []
    for key, rows in scan.groups().items():
        measurable = [row.request for row in rows if _measurable(scan, row)]
        picked = _spread(measurable, sample)
        reason = None
        if not picked:
            reason = unmeasured if measurable else _unmeasurable(rows[0])
        tokens = sum(row.tokens for row in rows)
        groups.append(TrafficGroup(key, tokens, tokens / total, tuple(row.request for row in rows), len(measurable), tuple(picked), reason))
    return groups


UNREPAIRABLE = ("new_prefix", "other_conversation")  # causes no field repair applies to: nothing of this prompt is cached


def _measurable(scan: TrafficScan, row: TrafficRequest) -> bool:
    return row.matched_request is not None and _flat(scan.diffs, row.request) and not is_cold(row)


def _flat(diffs: Mapping[int, TurnDiff], request: int) -> bool:
    """Whether ``request`` has a diff that changes only messages' text (read off a ``TurnDiffs`` without computing it)."""
    if isinstance(diffs, TurnDiffs):
        return diffs.flat(request)
    diff = diffs.get(request)
    return diff is not None and not diff.structural


def is_cold(row: TrafficRequest) -> bool:
    """Whether nothing of the request's own conversation is cached: a new prefix, or a match in another conversation."""
    return any(cause.name in UNREPAIRABLE for cause in row.causes)


def _unmeasurable(row: TrafficRequest) -> str:
    if row.matched_request is None or any(cause.name == "new_prefix" for cause in row.causes):
        return "not measured: a cold prefill has nothing cached to repair"
    if any(cause.name == "other_conversation" for cause in row.causes):
        return "not measured: its match is another conversation, whose shared head is all a cache could serve"
    return "not measured: the change is outside the messages' text (tools, roles, tool calls), so only recompute applies, exactly"


def _spread(items: Sequence[int], count: int) -> list[int]:
    if count <= 0 or not items:
        return []
    if len(items) <= count:
        return list(items)
    if count == 1:
        return [items[0]]
    return sorted({items[round(k * (len(items) - 1) / (count - 1))] for k in range(count)})
