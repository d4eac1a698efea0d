"""The token pass on Ray: the per-request work on many processes or machines, the cache simulation in one ordered pass.

The result is the single-process ``traffic_scan.scan_log``'s, request for request (the same rows, causes, diffs, groups
and engines' reuse); only where the work runs differs:

- **Stage 1, on tokenizer actors** (``workers`` actors of ``shard_tokens.ShardTokenPass``, one CPU each, each holding
  the tokenizer, over the log's shards, ``shards.plan_shards``). A first pass counts each shard's requests (read and
  unwrap only), and returns their timestamps, the records skipped, the flags and the sessions Langfuse traces name
  (``LogCount``): so every request gets its number in the whole log, in time order where every request has a timestamp
  (as one process orders it, ``reading.time_ordered``), and each observation its trace's session from any shard. The
  second reads, unwraps, renders and tokenizes each request, hashes its blocks (``blocks.block_hashes``) and computes
  its row against its match among the shard's earlier requests (a radix tree of the shard alone; cold without one;
  ``traffic_scan.compared_row``: the diff and the causes, which need the texts). A shard's records come back pickled,
  as bytes, token ids as int32 arrays. Both passes stream their shards back in order (``in_order``: ``AHEAD`` shards
  per actor in flight), so the driver simulates each shard while the actors tokenize the next.
- **Stage 2, on the driver**, in time order, over compact records: per request its token ids (int32, for the radix
  tree and the slots), its block hashes (int64), its row and what its record reports (``Reported``, and for a hosted
  model what its provider's cache reads). The radix tree matches the request; when the match is the shard's own guess
  (nearly every request, none included), the row computed on the worker is the row; otherwise the pair is left for
  stage 2b. The engines and the hosted providers' caches are fed here; each ``fleet`` (replicas behind a router,
  independent of the engines and of the other fleets) is simulated on an actor of its own (``FleetLane``), sent the
  same steps in batches without waiting for them, and asked for its result at the end; the observed
  counts are compared at the end (``traffic_scan.observed_rows``, as in one process). The driver keeps each request's row,
  its diff (the changed values only) and where it is in the log, never a text. Files in time order stream through;
  a log whose files are not (an export written in another order) is held whole, then sorted.
- **Stage 2b, on the driver**: the pairs whose match was another request or none (a match in an earlier shard, or one the
  budget evicted; a few percent of a log with shards of thousands of lines): both requests re-read by file
  and line, rendered, and diffed by the same ``compared_row``. (On the driver, not as Ray tasks: a task process's
  start, importing the tokenizer's library, costs more than these few pairs on a small cluster.)
- **Stage 3, the model pass** (``traffic.audit_traffic``) on the few sampled turns: the requests it reads (the sampled
  turns, their matches, the cold requests) are re-read and rendered on the driver, and the turns measured by Ray actors
  that each hold the model (``ray_turns``), or on a serving endpoint (``endpoint_audit``) where one is given.

Faults: a shard that cannot be read (a truncated gzip, an unreadable file) is skipped from the line it failed at,
named by file and line, and the other shards go on; a worker that dies is restarted by Ray and its shard retried
(``RETRIES``: the actors' ``max_restarts`` and ``max_task_retries``). A log is streamed: each worker reads its
shard's lines, Ray holds the few shards in flight, and the driver one shard's records at a time (all of them, for a
log out of time order). An
OpenTelemetry export is one shard (``shards.LINKED``: its spans' messages and sessions lie on other lines).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.engine.audit.changes.fields import TurnDiff
from kvscope.engine.audit.distributed.ray_setup import RETRIES
from kvscope.engine.audit.distributed.shard_tokens import ShardTokenPass, ShardTokens, TokenRecord
from kvscope.engine.audit.logs.reading import join_traces, record_requests, time_order
from kvscope.engine.audit.logs.render import RenderedRequest, end_of_turn_ids, render_batch
from kvscope.engine.audit.logs.requests import Flagged, Request, RequestLogError, Skipped
from kvscope.engine.audit.logs.requests import reading as log_reading
from kvscope.engine.audit.logs.shards import SHARD_LINES, LogFiles, Shard, ShardCount, read_shard, shard_lines
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import (
    TrafficRequest,
    TrafficScan,
    TurnDiffs,
    compared_row,
    observed_rows,
    sample_groups,
    settling_heap,
)
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.fleet import FleetResult
from kvscope.engine.audit.simulate.observed import Reported
from kvscope.engine.audit.simulate.step import Simulation, Step, StepResult
from kvscope.engine.progress import StepProgress


@dataclass(frozen=True)
class Rereader:
    """Requests re-read from their shards by place (request -> shard, line, position among its record's requests)
    without parsing other lines, and rendered as stage 1 rendered them."""

    tokenizer: Any
    shards: Sequence[Shard]
    fmt: str
    limit: int
    model: str
    sessions: dict[str, str]  # the Langfuse traces' sessions

    def requests(self, where: dict[int, tuple[int, int, int]]) -> dict[int, Request]:
        wanted: dict[int, dict[int, list[tuple[int, int]]]] = {}  # shard -> line -> [(request, position)]
        for index, (number, line, position) in where.items():
            wanted.setdefault(number, {}).setdefault(line, []).append((index, position))
        found: dict[int, Request] = {}
        for number, lines in wanted.items():
            shard = self.shards[number]
            if shard.whole or shard.linked:  # records that complete each other: the shard read again, joined
                by_line: dict[int, list[Request]] = {}
                for request in read_shard(shard, self.fmt).requests:
                    by_line.setdefault(request.line, []).append(request)
                for line, items in lines.items():
                    found |= {index: dataclasses.replace(by_line[line][position], index=index) for index, position in items}
                continue
            last = max(lines)
            for line, raw in shard_lines(shard):
                if line in lines:
                    for index, position in lines[line]:
                        found[index] = record_requests(json.loads(raw), self.fmt, index - position, line).requests[position]
                if line == last:
                    break
        return dict(zip(found, join_traces(list(found.values()), self.sessions)))

    def rendered(self, where: dict[int, tuple[int, int, int]]) -> dict[int, RenderedRequest]:
        requests = self.requests(where)
        order = sorted(requests)
        rendered = zip(order, render_batch(self.tokenizer, [requests[i] for i in order], self.limit, self.model))
        return {i: item for i, item in rendered if isinstance(item, RenderedRequest)}

    def compared(
        self, where: dict[int, tuple[int, int, int]], pairs: list[tuple[int, int | None]], block: int
    ) -> list[tuple[int, TrafficRequest, TurnDiff | None]]:
        """Stage 2b: each (request, its match; None: cold) re-read, rendered and compared, as ``scan_log`` compares them."""
        rendered = self.rendered({i: where[i] for pair in pairs for i in pair if i is not None})
        return [(new, *compared_row(rendered.get(old), rendered[new], old, block)) for new, old in pairs]


@dataclass(frozen=True)
class LogCount:
    """Stage 1's first step over the whole log: each shard's first request number, the records skipped, the formats,
    the Langfuse traces' sessions, the order the report uses (``requests.ORDERS``) and what kept requests' records
    flag, numbered in that order."""

    first: list[int]
    total: int
    skipped: list[Skipped]
    formats: dict[str, int]
    sessions: dict[str, str]
    order: str
    indexes: np.ndarray | None  # each request's number in time order, by its number in the files' order (None: the same)
    untimed: int
    flagged: list[Flagged]

    @classmethod
    def of(cls, counts: Sequence[ShardCount]) -> LogCount:
        counts = sorted(counts, key=lambda count: count.number)
        first, total, formats, sessions, flagged = [], 0, {}, {}, []
        for count in counts:
            first.append(total + 1)
            flagged += [dataclasses.replace(item, request=item.request + total) for item in count.flagged]
            total += count.requests
            sessions |= count.sessions
            for name, n in count.formats.items():
                formats[name] = formats.get(name, 0) + n
        times = np.concatenate([count.timestamps for count in counts]) if counts else np.zeros(0)
        order = time_order(times)  # as one process orders the log (``reading.time_ordered``)
        indexes = order.numbers
        if indexes is not None:
            flagged = sorted((dataclasses.replace(item, request=int(indexes[item.request - 1])) for item in flagged), key=_by_request)
        skipped = [item for count in counts for item in count.skipped]
        return cls(first, total, skipped, formats, sessions, order.order, indexes, order.untimed, flagged)

    def shard_indexes(self, number: int, requests: int) -> np.ndarray | None:
        """Shard ``number``'s requests' numbers in time order (None: the files' order is the order)."""
        if self.indexes is None:
            return None
        start = self.first[number] - 1
        return self.indexes[start : start + requests]


def _by_request(item: Flagged) -> int:
    return item.request


AHEAD = 2  # shards in flight per tokenizer actor: one tokenized while the driver simulates the one before
LANE_STEPS = 2_000  # steps sent to the fleets' actors at a time (one object in Ray's store, read by every fleet)


def ray_scan(
    tokenizer: Any,
    log: LogFiles,
    settings: ScanSettings = ScanSettings(),
    *,
    model: str = "this model",
    workers: int = 2,
    sample: int = 0,
    shard_lines_: int = SHARD_LINES,
    progress: StepProgress = None,
) -> TrafficScan:
    """``scan_log`` of ``log`` with ``settings`` (its files: files, directories of shards, gzip'd JSONL; ``log.log`` is what one process
    reads of them) on the Ray cluster already started (``start_ray``), with ``workers`` tokenizer actors; the requests
    the model pass reads for ``sample`` turns per group (and the cold ones) are rendered on the driver afterwards."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 0))
    if workers > cpus:  # an actor without a CPU would never start, and the shards sent to it never come back
        raise RequestLogError(f"--workers {workers} tokenizer actors need a CPU each; the Ray cluster has {cpus} CPUs")
    shards, fmt = log.shards(shard_lines_), log.fmt
    actor_class = ray.remote(num_cpus=1, max_restarts=RETRIES, max_task_retries=RETRIES)(ShardTokenPass)
    # the tokenizer put once and held here until the actors are gone: an actor restarted after a fault (``RETRIES``)
    # reads it again, and Ray may free the constructor arguments it put itself once the actors exist (ray issue 53727)
    held = ray.put(tokenizer)
    actors = [actor_class.remote(held, fmt, settings, model) for _ in range(workers)]
    try:
        counts = list(in_order(actors, "count", list(enumerate(shards)), AHEAD))
        count = LogCount.of(counts)
        if count.total == 0 and not count.skipped:
            raise RequestLogError("the log is empty: paste one JSON request per line, or a JSON array of requests")
        sessions = ray.put(count.sessions)
        ray.get([actor.join.remote(sessions) for actor in actors])
        calls = [(n, shard, count.first[n], count.shard_indexes(n, counts[n].requests)) for n, shard in enumerate(shards)]
        # llama.cpp's mode where not named: the server's own slot choice, and the block as given (the driver sees no
        # request before it simulates, so it reads no block from the log's counts)
        unpinned = dataclasses.replace(settings, cache=settings.cache.for_log(pinned=False), block_given=True)
        lane_class = ray.remote(num_cpus=0)(FleetLane)  # bookkeeping beside the tokenizers: never waits for a CPU
        lanes = [lane_class.remote(unpinned.cache, fleet, end_of_turn_ids(tokenizer)) for fleet in unpinned.fleet]
        driver = _Driver(unpinned, end_of_turn_ids(tokenizer), reorder=count.indexes is not None, lanes=lanes)
        rendering: list[Skipped] = []
        received = 0
        with settling_heap() as settle:
            for shipped in in_order(actors, "shipped", calls, AHEAD):
                part: ShardTokens = pickle.loads(shipped)  # what this job's own actors pickled (``ShardTokenPass.shipped``)
                del shipped
                rendering += part.skipped
                received += len(part.records)
                driver.feed(part.records)
                del part
                settle()
                if progress:
                    progress(received, count.total)
            driver.finish()
    finally:
        for actor in actors:
            ray.kill(actor)
        del held
    reread = Rereader(tokenizer, shards, fmt, settings.limit, model, count.sessions)
    pending = driver.pending()
    if pending:
        driver.fill(reread.compared(driver.where, pending, settings.cache.block))
    try:
        scan = driver.scan(count.skipped + rendering, count, model)
    finally:
        for lane in driver.lanes:
            ray.kill(lane)
    driver.add_rendered(reread.rendered({i: driver.where[i] for i in _needed(scan, sample)}))
    return scan


def in_order(actors: Sequence[Any], method: str, calls: Sequence[tuple], ahead: int) -> Iterator[Any]:
    """Each call's result (``actor.method(*call)``), in the order of ``calls``, as soon as it and those before it are
    done: at most ``ahead`` calls per actor in flight, each new one sent to the actor with the fewest unfinished
    (the stream the driver simulates while the actors work on the calls after; what waits is bounded by ``ahead``)."""
    import ray

    sent: collections.deque[tuple[Any, int]] = collections.deque()  # (its result's reference, its actor), in order
    waiting = iter(calls)

    def send() -> None:
        call = next(waiting, None)
        if call is None:
            return
        unfinished = [0] * len(actors)
        refs = [ref for ref, _ in sent]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for ref, actor in sent:
            unfinished[actor] += ref not in done
        chosen = unfinished.index(min(unfinished))
        sent.append((getattr(actors[chosen], method).remote(*call), chosen))

    for _ in range(ahead * len(actors)):
        send()
    while sent:
        ref, _ = sent.popleft()
        result = ray.get(ref)
        del ref
        send()
        yield result


class FleetLane:
    """One fleet (replicas behind a router) simulated apart, on a Ray actor of its own: fed the driver's steps in time
    order (the replies each session's next turn resends included, as the driver's ``Simulation`` reads them)."""

    def __init__(self, settings: CacheSettings, fleet: tuple[int, str], end_ids: frozenset[int]):
        self.simulation = Simulation(settings, (fleet,), end_ids, serving=False)

    def feed(self, steps: list[Step]) -> None:
        for step in steps:
            self.simulation.step(step)

    def result(self) -> FleetResult:
        return self.simulation.fleets[0].result()


class _Driver:
    """Stage 2: the radix match, the engines, the hosted providers' caches and the fleets, in time order, over compact
    records (``reorder``: the files are not in time order, so every record is held until the last, then sorted)."""

    def __init__(self, settings: ScanSettings, end_ids: frozenset[int], reorder: bool = False, lanes: Sequence[Any] = ()):
        self.settings = settings
        self.simulation = Simulation(settings.cache, () if lanes else settings.fleet, end_ids)
        self.lanes = list(lanes)  # the fleets' actors (``FleetLane``), in ``settings.fleet``'s order; none: simulated here
        self._for_lanes: list[Step] = []
        self.rows: list[TrafficRequest] = []
        self.rendered: dict[int, RenderedRequest] = {}  # what the model pass reads, re-read once the pass is done (``with_rendered``)
        self.diffs = TurnDiffs(self.rendered, settings.cache.block)  # each diff kept as its match and kind, computed again when read
        self.where: dict[int, tuple[int, int, int]] = {}
        self.unmatched: dict[int, tuple[int | None, int, StepResult]] = {}  # request -> (its match, its row's place, its step)
        self.reported: list[Reported] = []
        self.served: list[dict[str, int]] = []  # per request, its hosted provider's reuse
        self.held: list[TokenRecord] | None = [] if reorder else None

    def feed(self, records: Iterator[TokenRecord] | list[TokenRecord]) -> None:
        """The records of the next shard: simulated now, or held until ``finish`` where the log is reordered."""
        if self.held is not None:
            self.held += records
            return
        for record in records:
            self._simulate(record)

    def finish(self) -> None:
        """The held records simulated in time order (nothing to do where the files were in time order)."""
        if self.held:
            for record in sorted(self.held, key=lambda record: record.index):
                self._simulate(record)
        self.held = None
        self.simulation.finish()
        self._send_lanes()

    def _simulate(self, record: TokenRecord) -> None:
        step = record.step()
        result = self.simulation.step(step)
        if self.lanes:
            self._for_lanes.append(step)
            if len(self._for_lanes) >= LANE_STEPS:
                self._send_lanes()
        self.served.append(result.hosted)
        self.reported.append(record.reported)
        self.where[record.index] = record.where
        if result.matched != record.guess:  # its match lies in an earlier shard, or a budget evicted the shard's guess
            self.unmatched[record.index] = (result.matched, len(self.rows), result)
            self.rows.append(record.row)  # a placeholder until stage 2b
            return
        self._keep(len(self.rows), record.row, record.diff, result, append=True)

    def _keep(self, at: int, row: TrafficRequest, diff: TurnDiff | None, result: StepResult, append: bool = False) -> None:
        row = dataclasses.replace(row, reused_tokens=result.reused, prompts_only_reused_tokens=result.prompts_only)
        if append:
            self.rows.append(row)
        else:
            self.rows[at] = row
        if diff is not None:
            self.diffs.add(row.request, result.matched, diff)

    def _send_lanes(self) -> None:
        """The steps gathered, to every fleet's actor at once (put once; each actor runs its calls in order)."""
        if not self._for_lanes:
            return
        import ray

        steps = ray.put(self._for_lanes)
        for lane in self.lanes:
            lane.feed.remote(steps)
        self._for_lanes = []

    def fleet_results(self) -> tuple[FleetResult, ...]:
        """Each fleet's result: from its actor, or from the driver's own simulation where there are none."""
        if not self.lanes:
            return tuple(simulated.result() for simulated in self.simulation.fleets)
        import ray

        return tuple(ray.get([lane.result.remote() for lane in self.lanes]))

    def pending(self) -> list[tuple[int, int | None]]:
        """(request, its match) pairs stage 2b compares."""
        return [(index, matched) for index, (matched, _, _) in self.unmatched.items()]

    def fill(self, results: list[tuple[int, TrafficRequest, TurnDiff | None]]) -> None:
        for index, row, diff in results:
            _, at, result = self.unmatched[index]
            self._keep(at, row, diff, result)

    def scan(self, skipped: list[Skipped], count: LogCount, model: str) -> TrafficScan:
        """The token pass's result, the log's reports read against the simulation (``traffic_scan.observed_rows``)."""
        settings, server = self.settings.for_log(self.reported)
        rows = observed_rows(self.rows, self.reported, self.served, settings, model)
        results = self.fleet_results()
        reading = log_reading(count.order, count.untimed, count.flagged, session_keys(self.reported))
        simulation = self.simulation
        return TrafficScan(
            tuple(rows),
            tuple(skipped),
            count.formats,
            settings,
            self.rendered,
            self.diffs,
            server.evidence,
            reading,
            fleet=results,
            replies=dict(simulation.replies),
            reply_from=dict(simulation.reply_from),
            cache_tokens=simulation.held(),
        )

    def add_rendered(self, rendered: dict[int, RenderedRequest]) -> None:
        """The requests the model pass reads, re-read and rendered once the pass is done, into the scan's ``rendered``
        (from which its ``diffs`` are computed when read)."""
        self.rendered.update(rendered)


def session_keys(reported: Sequence[Reported]) -> dict[str, int]:
    """Requests per record key their session was read from, in the order first met (as ``RequestLog.reading``)."""
    keys: dict[str, int] = {}
    for item in sorted(reported, key=lambda item: item.index):
        if item.session_key:
            keys[item.session_key] = keys.get(item.session_key, 0) + 1
    return keys


def _needed(scan: TrafficScan, sample: int) -> set[int]:
    """The requests the model pass and its report read: the sampled turns and their matches, and the cold requests."""
    matched = {row.request: row.matched_request for row in scan.requests}
    chosen = {index for group in sample_groups(scan, sample) for index in group.measured}
    return chosen | {matched[i] for i in chosen} | {row.request for row in scan.requests if row.matched_request is None}
