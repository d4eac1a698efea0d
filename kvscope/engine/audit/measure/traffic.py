"""A whole request log audited as traffic: a token pass over every request (``scan``), the model on a sample only.

``audit_traffic`` runs the token pass (``traffic_scan.scan_log``, or another pass given, e.g. ``ray_scan.ray_scan``), then
measures up to K turns of each change signature's group (``traffic_scan.sample_groups``) with every repair against a clean
prefill (``measure_turn``, as the per-turn audit does), so the model's cost is K × groups, not the log's size.
The turns are measured in this process (``measure_in_process``) or wherever a ``MeasureTurns`` sends them (Ray actors:
``ray_turns``), each with its lane (``TurnWork.lane``) so the turns that share a prefix stay together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvscope.engine.audit.changes.fields import TurnDiff
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError
from kvscope.engine.audit.logs.shards import LogFiles
from kvscope.engine.audit.measure.fidelity import EndpointRepairFidelity, MeasuredGroup, RepairFidelity
from kvscope.engine.audit.measure.kv_store import ComputedStates
from kvscope.engine.audit.measure.meter import ModelPassMeter
from kvscope.engine.audit.measure.repairs import Turn
from kvscope.engine.audit.measure.settings import MeasureSettings
from kvscope.engine.audit.measure.turn import AuditReport, AuditTurn, measure_turn
from kvscope.engine.audit.report.records import init_values
from kvscope.engine.audit.scan.sampling import traffic_scan
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficGroup, TrafficRequest, TrafficScan, is_cold, sample_groups
from kvscope.engine.audit.simulate.metrics import observed_aggregate
from kvscope.engine.audit.simulate.observed import ObservedSummary, fit_observed, hosted_summary, observed_summary
from kvscope.engine.cache.budget import Cancelled
from kvscope.engine.cache.loaded import LoadedModel, LoadedTokenizer
from kvscope.engine.progress import MessageProgress, StepProgress, Tick

DEFAULT_SAMPLE = 3  # turns measured per group
TokenPass = Callable[[LogFiles, ScanSettings], TrafficScan]  # a token pass run elsewhere: the log's files and its settings in


def group_fidelity(turns: Sequence[AuditTurn]) -> dict[str, RepairFidelity]:
    """Per repair over a group's measured turns: how many it applied to and stayed within the threshold on, its
    worst KL and agreement, and its mean share of computed tokens; and how often each repair was recommended."""
    summary: dict[str, RepairFidelity] = {}
    for name in dict.fromkeys(name for turn in turns for name in turn.repairs):
        results = [(turn, turn.repairs[name]) for turn in turns if name in turn.repairs]
        applied = [(turn, result) for turn, result in results if result.applicable]
        summary[name] = RepairFidelity(
            measured=len(results),
            applicable=len(applied),
            recommended=sum(turn.recommendation.repair == name for turn, _ in results),
            worst_kl=max((r.fidelity.kl for _, r in applied), default=None),
            min_agreement=min((r.fidelity.generation_agreement for _, r in applied), default=None),
            mean_computed_share=(sum(r.computed_tokens / t.tokens for t, r in applied) / len(applied)) if applied else None,
        )
    return summary


class RewritePart(Protocol):
    """A rewrite measured (``rewrite.measure.RewriteReport``, or on an endpoint ``endpoint.model_pass.EndpointRewrite``)."""

    def rows(self) -> list[dict[str, Any]]: ...

    def verdict(self) -> str: ...


class EndpointPart(Protocol):
    """The sampled turns measured on an endpoint (``endpoint.served_measure.EndpointAudit``, a record)."""

    def group_fidelity(self, requests: Sequence[int]) -> dict[str, EndpointRepairFidelity]: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class TrafficReport:
    """A log's token pass, its groups, and the sampled turns measured with every repair; and what the report holds
    beside where asked for: the observed counts' fit (``fit``), the server's scrapes (``scrapes``), a rewrite measured,
    the sampled turns measured on an endpoint instead (``endpoint``), and why a host lowered the sample."""

    model: str
    dtype: str
    scan: TrafficScan
    groups: tuple[TrafficGroup, ...]
    turns: dict[int, AuditTurn]  # measured, by request
    measure: MeasureSettings
    sample: int
    cancelled: str | None = None  # why no turn was measured: the model pass was cancelled (the token pass is whole)
    pending: str | None = None  # the token pass alone, shown while the model pass measures: what it is measuring
    fit: bool = False  # --fit-observed: the block-cache settings that reproduce the observed counts searched
    scrapes: tuple[str, ...] = ()  # --metrics: one or two Prometheus scrapes of the server, beside the simulation
    rewrite: RewritePart | None = None  # --rewritten / --template: the rewrite measured against the log
    endpoint: EndpointPart | None = None  # --endpoint: the groups' sampled turns measured there (their fidelity, its part)
    sample_bound: str | None = None  # why a host lowered --sample (the app's public profile)

    @property
    def sampled(self) -> bool:
        """Whether some measurable turn was left unmeasured (the model ran on a sample, not every turn)."""
        return any(group.measurable > len(group.measured) for group in self.groups)

    def as_dict(self) -> dict[str, Any]:
        """The report's ``LogAudit`` (``ci.report``), whole: every key the report holds is made here."""
        scan = self.scan
        return (
            {
                "model": self.model,
                "dtype": self.dtype,
                "formats": scan.formats,
                **scan.reading,
                "skipped": [item.as_dict() for item in scan.skipped],
                "skipped_count": len(scan.skipped),
                "engines": scan.totals().as_dict(),
                "sessions": [summary.as_dict() for summary in scan.sessions()],
                "causes": {name: count.as_dict() for name, count in scan.cause_counts().items()},
                "observed": self.observed().as_dict(),
                "hosted": {name: part if isinstance(part, str) else part.as_dict() for name, part in hosted_summary(scan.requests).items()},
                "requests": [row.as_dict() for row in scan.requests],
                "sample": self.sample,
                "sampled": self.sampled,
                "threshold": self.measure.threshold,
                "min_agreement": self.measure.min_agreement,
                "generated_tokens": self.measure.tokens,
                "repairs": list(self.measure.repairs),
                "grain": self.measure.grain,
                "groups": [MeasuredGroup(**init_values(group), fidelity=self.fidelity(group.measured)).as_dict() for group in self.groups],
                "turns": [turn.as_dict() for turn in self.measured_report().turns],
            }
            | ({"fleet": [result.as_dict() for result in scan.fleet]} if scan.fleet else {})
            | ({"cancelled": self.cancelled} if self.cancelled else {})
            | ({"pending": self.pending} if self.pending else {})
            | ({"rewrite": self.rewrite.rows(), "verdict": self.rewrite.verdict()} if self.rewrite is not None else {})
            | ({"endpoint": self.endpoint.as_dict()} if self.endpoint is not None else {})
            | ({"sample_bound": self.sample_bound} if self.sample_bound else {})
        )

    def observed(self) -> ObservedSummary:
        """The observed counts against the simulation, with the fit and the server's scrapes where asked for."""
        scan = self.scan
        summary = observed_summary(scan.requests, scan.settings.observed_engine, self.model, scan.observed_evidence)
        fit = fit_observed(scan.requests, scan.held, scan.settings.observed_engine) if self.fit else None
        metrics = observed_aggregate(self.scrapes, scan.totals().hit_rate) if self.scrapes else None
        return dataclasses.replace(summary, fit=fit, metrics=metrics)

    def fidelity(self, measured: Sequence[int]) -> dict[str, RepairFidelity] | dict[str, EndpointRepairFidelity]:
        """A group's repairs' fidelity over its measured turns (``RepairFidelity``): on the endpoint where they were
        measured there (``EndpointRepairFidelity``)."""
        if self.endpoint is not None:
            return self.endpoint.group_fidelity(measured)
        return group_fidelity([self.turns[i] for i in measured])

    def measured_report(self) -> AuditReport:
        """The cold prefills and the measured turns, in request order, in the per-turn audit's shape (what the tab's
        figures, the Notes scenario and the repaired template read)."""
        cold = {
            row.request: AuditTurn(row.request, row.tokens, None, None, {}, None)
            for row in self.scan.requests
            if row.matched_request is None
        }
        turns = sorted({**cold, **self.turns}.items())
        measure = self.measure
        return AuditReport(
            self.model,
            self.dtype,
            measure.threshold,
            measure.min_agreement,
            measure.tokens,
            measure.repairs,
            measure.grain,
            tuple(turn for _, turn in turns),
            tuple(self.scan.rendered[index] for index, _ in turns),
        )


def audit_traffic(
    lm: LoadedModel | LoadedTokenizer,
    log: RequestLog | LogFiles,
    *,
    sample: int = DEFAULT_SAMPLE,
    settings: ScanSettings = ScanSettings(),
    measure: MeasureSettings = MeasureSettings(),
    scan_progress: StepProgress = None,
    progress: StepProgress = None,
    token_pass: TokenPass | None = None,
    scan: TrafficScan | None = None,
    measure_turns: MeasureTurns | None = None,
    messages: MessageProgress | None = None,
    states: ComputedStates | None = None,
) -> TrafficReport:
    """The token pass over the whole log with ``settings`` (its context limit, default the model's), then up to
    ``sample`` turns of each change signature measured with every repair of ``measure``. ``log``: the log read, or its
    files (``shards.LogFiles``), which this process reads (``LogFiles.log``) unless ``token_pass`` reads them
    elsewhere (``scan_progress``: requests of the token pass; ``progress``: the measured steps; ``token_pass``: another
    token pass, given the log's files and the settings with the context limit set, e.g.
    ``ray_scan.ray_scan``; ``measure_turns``: where the sampled turns are measured, default ``measure_in_process``
    with ``lm``, e.g. ``turns.ray_measure_turns``; ``scan``: the token pass already made, e.g. shown while the model
    pass runs (:func:`pending_report`); ``messages``: the model pass a forward at a time with its time left, as
    :class:`~kvscope.engine.audit.measure.meter.ModelPassMeter` says it; ``states``: the store of computed states the turns measured
    here are computed in, default a new one: pass one to read the log's requests again from it, e.g. a rewrite's
    originals). With ``sample`` 0 only the tokenizer is read, so ``lm`` may be a
    :class:`~kvscope.engine.cache.loaded.LoadedTokenizer`. A model pass cancelled (``Cancelled``) keeps the token pass: the
    report has no measured turn and says so (``cancelled``)."""
    if sample < 0:
        raise RequestLogError(f"--sample is the turns measured per group, at least 0, got {sample}")
    if sample > 0 and isinstance(lm, LoadedTokenizer):
        raise RequestLogError(f"--sample {sample} measures turns with the model, and only the tokenizer of {lm.name} was loaded")
    if scan is None and token_pass is not None:
        if not isinstance(log, LogFiles):
            raise RequestLogError("a token pass run elsewhere reads the log's files: give them (LogFiles), not the log read")
        scan = token_pass(log, settings.for_model(lm))
    elif scan is None:
        scan = traffic_scan(lm, log.log if isinstance(log, LogFiles) else log, settings, progress=scan_progress)
    if not scan.requests:
        raise RequestLogError(f"no request of the log could be read: {len(scan.skipped)} skipped, the first: {scan.skipped[0].message}")
    groups = sample_groups(scan, sample)
    chosen = sorted(index for group in groups for index in group.measured)
    total, done = len(chosen) * (len(measure.repairs) + 1), 0
    meter = ModelPassMeter(len(chosen), measure.repairs, measure.tokens, messages) if messages and total else None

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)
        if meter is not None:
            meter.step_done()

    if progress and total:
        progress(0, total)  # the model's work begins: said before its first step ends
    if meter is not None:
        meter.begin()

    work = turn_work(scan, chosen)
    if measure_turns is None:
        states = states if states is not None or not total else ComputedStates(lm, measure.tokens)
        measure_turns = functools.partial(measure_in_process, lm, store=states)
    told = states.forwards_told(meter.forward) if states is not None and meter is not None else contextlib.nullcontext()
    try:
        with told:  # every forward moves the bar
            turns = measure_turns(work, measure, tick)
    except Cancelled:  # what was finished stands: the token pass, with no turn measured
        whole = done // (len(measure.repairs) + 1)  # a turn's steps run together: its reference, then each repair
        measured = f"{whole:,} of {len(chosen):,} turn{'s' if len(chosen) != 1 else ''} measured, not kept"
        why = f"the model pass was cancelled after {done:,} of {total:,} steps ({measured}): the token pass is whole"
        unmeasured = tuple(sample_groups(scan, 0, "not measured: the model pass was cancelled"))
        return TrafficReport(lm.fingerprint.name, lm.fingerprint.dtype, scan, unmeasured, {}, measure, 0, why)
    return TrafficReport(lm.fingerprint.name, lm.fingerprint.dtype, scan, tuple(groups), turns, measure, sample)


def pending_report(lm: LoadedModel | LoadedTokenizer, scan: TrafficScan, sample: int, measure: MeasureSettings) -> TrafficReport:
    """The token pass alone while the model pass measures up to ``sample`` turns of each group: every request, engine,
    cause and group, no turn measured yet, and what is being measured (``pending``)."""
    groups = sample_groups(scan, sample)
    chosen = sum(len(group.measured) for group in groups)
    work = f"{chosen:,} turn{'s' if chosen != 1 else ''} of {len(groups):,} change signature{'s' if len(groups) != 1 else ''}"
    why = f"the token pass is whole; the model pass is measuring {work} with {len(measure.repairs)} repairs each"
    unmeasured = tuple(sample_groups(scan, 0, "being measured: the model pass is running"))
    return TrafficReport(lm.fingerprint.name, lm.fingerprint.dtype, scan, unmeasured, {}, measure, 0, pending=why)


@dataclass(frozen=True)
class TurnWork:
    """One sampled turn for the model pass: the older request (the cached one), the newer one, their diff, and its
    lane: its session, else the first request of its conversation (the turns of one lane share prefixes)."""

    old: RenderedRequest
    new: RenderedRequest
    diff: TurnDiff
    lane: str | int

    @property
    def request(self) -> int:
        return self.new.request.index


MeasureTurns = Callable[[Sequence[TurnWork], MeasureSettings, Tick], dict[int, AuditTurn]]  # turns in, by request out


def turn_work(scan: TrafficScan, chosen: Sequence[int]) -> list[TurnWork]:
    """The ``chosen`` turns of ``scan`` (each with a match and a diff), in order, with their lanes."""
    rows = {row.request: row for row in scan.requests}
    work = []
    for index in chosen:
        new, session = scan.rendered[index], rows[index].session
        lane = _conversation(rows, index) if session is None else session
        work.append(TurnWork(scan.rendered[rows[index].matched_request], new, scan.diffs[index], lane))
    return work


def _conversation(rows: dict[int, TrafficRequest], index: int) -> int:
    """The first request of ``index``'s conversation: up its matches to the one that started cold (``traffic_scan.is_cold``)."""
    row = rows[index]
    while row.matched_request is not None and not is_cold(row):
        row = rows[row.matched_request]
    return row.request


def measure_in_process(
    lm: LoadedModel, work: Sequence[TurnWork], measure: MeasureSettings, tick: Tick = lambda: None, store: ComputedStates | None = None
) -> dict[int, AuditTurn]:
    """The turns measured here, in order, with every repair (one ``tick`` per step), on one store of computed states
    (``store``, default a new one): each prompt computed once, a prefix shared with an earlier one reused."""
    if store is None:
        store = ComputedStates(lm, measure.tokens)
    turns = {}
    for item in work:
        turn = Turn(lm, item.old, item.new, item.diff, store.state(item.old.ids), store, measure.grain, measure.context_limit)
        turns[item.request] = measure_turn(turn, measure, tick)
    return turns
