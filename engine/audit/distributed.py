"""The token pass on Ray: the per-request work on many processes or machines, the cache simulation in one ordered pass.

The result is the single-process ``traffic.scan_log``'s, request for request (the same rows, causes, diffs, groups
and engines' reuse); only where the work runs differs:

- **Stage 1, on Ray Data** (``map_batches`` over the log's shards, ``shards.plan_shards``, with an actor pool of
  ``workers`` actors, each holding the tokenizer). A first pass counts each shard's requests (read and unwrap only,
  so every request gets its number in the whole log) and names the records skipped. The second reads, unwraps,
  renders and tokenizes each request, hashes its blocks (``caches.block_hashes``) and computes its row twice: as a
  cold request, and against its match among the shard's earlier requests (a radix tree of the shard alone;
  ``traffic.compared_row``: the diff and the causes, which need the texts).
- **Stage 2, on the driver**, in log order, over compact records: per request its token ids (int32, for the radix
  tree and the slots), its block hashes (int64) and its two candidate rows. The radix tree matches the request; when
  the match is none or the shard's own guess (nearly every request), the row computed on the worker is the row;
  otherwise the pair is left for stage 2b. The engines (and any ``fleet``) are fed here. The driver keeps
  each request's row, its diff (the changed values only) and where it is in the log, never a text.
- **Stage 2b, on the driver**: the pairs whose match was another request (a match in an earlier shard, or one the
  budget evicted; a few percent of a log with shards of thousands of lines): both requests re-read by file
  and line, rendered, and diffed by the same ``compared_row``. (On the driver, not as Ray tasks: a task process's
  start, importing the tokenizer's library, costs more than these few pairs on a small cluster.)
- **Stage 3, the model pass** (``traffic.audit_traffic``) on the few sampled turns: the requests it reads (the sampled
  turns, their matches, the cold requests) are re-read and rendered on the driver, and the turns measured by Ray actors
  that each hold the model (``ray_turns``), or on a serving endpoint (``endpoint_audit``) where one is given.

Faults: a shard that cannot be read (a truncated gzip, an unreadable file) is skipped from the line it failed at,
named by file and line, and the other shards go on; a worker that dies is restarted by Ray and its shard retried
(``RETRIES``: the actors' ``max_restarts`` and ``max_task_retries``). A log is streamed: each worker reads its
shard's lines, and the driver holds one shard's records at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.audit.caches import CacheSettings, Engines, RadixCache, block_hashes
from engine.audit.fields import TurnDiff
from engine.audit.fleet import Fleet
from engine.audit.formats import AUTO
from engine.audit.requests import ORDERS, RenderedRequest, Request, RequestLogError, Skipped, record_requests, render_batch
from engine.audit.shards import SHARD_LINES, Shard, count_shards, log_files, plan_shards, read_shard, shard_lines
from engine.audit.traffic import TrafficRequest, TrafficScan, compared_row, sample_groups
from engine.progress import StepProgress

RETRIES = 3  # restarts of a lost actor, retries of a lost task
LOCAL = "local"


def start_ray(address: str = LOCAL, workers: int = 2) -> None:
    """Join the Ray cluster at ``address``, or start a local one of ``workers`` CPUs (no dashboard, no usage
    statistics, its workers at the driver's priority)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    if workers < 1:
        raise RequestLogError(f"--workers must be at least 1, got {workers}")
    quiet = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address == LOCAL:
        # Ray starts its workers at nice 15 (for an interactive driver's sake); here they are the job's work, and on a
        # loaded machine a niced pool barely runs
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=workers, **quiet)
    else:
        ray.init(address=address, **quiet)


@dataclass(frozen=True)
class TokenRecord:
    """What stage 2 holds of one request: integers, and the two rows computed for it on a worker."""

    index: int
    session: str | None
    where: tuple[int, int, int]  # shard number, line, position among its record's requests
    ids: np.ndarray  # (tokens,) int32
    hashes: np.ndarray  # (blocks,) int64, chained
    cold: TrafficRequest  # its row without a match
    guess: int | None  # its match among the shard's earlier requests (a radix tree of the shard)
    against_guess: tuple[TrafficRequest, TurnDiff | None] | None  # its row and diff against that request
    timestamp: float | None = None  # when it was sent, where its record says


@dataclass(frozen=True)
class ShardTokens:
    """Stage 1's output for one shard: its records in order, the requests it could not render, or why it failed."""

    number: int
    records: list[TokenRecord]
    skipped: list[Skipped]


class _ShardTokenPass:
    """Stage 1's actor: holds the tokenizer; per shard, its requests read, rendered, hashed and diffed."""

    def __init__(self, tokenizer: Any, fmt: str, limit: int, model: str, block: int):
        self.tokenizer, self.fmt, self.limit, self.model, self.block = tokenizer, fmt, limit, model, block

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = []
        for number, text, first in zip(batch["number"], batch["shard"], batch["first_index"]):
            out.append(self.tokens(int(number), Shard(**json.loads(text)), int(first)))
        return {"tokens": np.array(out, dtype=object)}

    def tokens(self, number: int, shard: Shard, first_index: int) -> ShardTokens:
        requests = read_shard(shard, self.fmt, first_index).requests
        rendered = render_batch(self.tokenizer, requests, self.limit, self.model)
        records, skipped, local, kept = [], [], RadixCache(), {}  # the shard's own radix tree, its rendered requests
        place = _places(requests)
        for request, item in zip(requests, rendered):
            if isinstance(item, RequestLogError):
                skipped.append(Skipped(request.line, "rendering", str(item)))
                continue
            _, guess = local.match(item.token_ids, request.session)
            local.insert(item.token_ids, request.index, request.session, len(kept) + 1)
            cold, _ = compared_row(None, item, None, self.block)
            against = compared_row(kept[guess], item, guess, self.block) if guess is not None else None
            records.append(
                TokenRecord(
                    request.index,
                    request.session,
                    (number, *place[request.index]),
                    item.token_ids,
                    block_hashes(item.token_ids, self.block),
                    cold,
                    guess,
                    against,
                    request.timestamp,
                )
            )
            kept[request.index] = item
        return ShardTokens(number, records, skipped)


def _places(requests: Sequence[Request]) -> dict[int, tuple[int, int]]:
    """Per request: its line and its position among the requests its record holds."""
    place, seen = {}, {}
    for request in requests:
        position = seen.get(request.line, 0)
        seen[request.line] = position + 1
        place[request.index] = (request.line, position)
    return place


def read_requests(shards: Sequence[Shard], where: dict[int, tuple[int, int, int]], fmt: str = AUTO) -> dict[int, Request]:
    """The requests at the given places (request -> shard, line, position), re-read without parsing other lines."""
    wanted: dict[int, dict[int, list[tuple[int, int]]]] = {}  # shard -> line -> [(request, position)]
    for index, (number, line, position) in where.items():
        wanted.setdefault(number, {}).setdefault(line, []).append((index, position))
    found: dict[int, Request] = {}
    for number, lines in wanted.items():
        shard = shards[number]
        if shard.array:
            requests = {r.index: r for r in read_shard(shard, fmt).requests}
            by_line = {line: [r for r in requests.values() if r.line == line] for line in lines}
            for line, items in lines.items():
                found |= {index: dataclasses.replace(by_line[line][pos], index=index) for index, pos in items}
            continue
        last = max(lines)
        for line, raw in shard_lines(shard):
            if line in lines:
                for index, position in lines[line]:
                    found[index] = record_requests(json.loads(raw), fmt, index - position, line)[0][position]
            if line == last:
                break
    return found


def compare_pairs(
    tokenizer: Any, shards: list[Shard], where: dict, pairs: list[tuple[int, int]], fmt: str, limit: int, model: str, block: int
) -> list[tuple[int, TrafficRequest, TurnDiff | None]]:
    """Stage 2b: each (request, its match) re-read, rendered and compared, as ``scan_log`` compares them."""
    rendered = render_requests(tokenizer, shards, where, {i for pair in pairs for i in pair}, fmt, limit, model)
    return [(new, *compared_row(rendered[old], rendered[new], old, block)) for new, old in pairs]


def render_requests(
    tokenizer: Any, shards: list[Shard], where: dict, indexes: set[int], fmt: str, limit: int, model: str
) -> dict[int, RenderedRequest]:
    """The requests ``indexes`` re-read from their shards and rendered."""
    requests = read_requests(shards, {i: where[i] for i in indexes}, fmt)
    order = sorted(requests)
    rendered = zip(order, render_batch(tokenizer, [requests[i] for i in order], limit, model))
    return {i: item for i, item in rendered if isinstance(item, RenderedRequest)}


def ray_scan(
    tokenizer: Any,
    paths: Sequence[str | Path],
    settings: CacheSettings = CacheSettings(),
    *,
    fmt: str = AUTO,
    limit: int = 32_768,
    model: str = "this model",
    workers: int = 2,
    sample: int = 0,
    fleet: Sequence[tuple[int, str]] = (),
    shard_lines_: int = SHARD_LINES,
    progress: StepProgress = None,
) -> TrafficScan:
    """``scan_log`` of the log in ``paths`` (files, directories of shards, gzip'd JSONL) on the Ray cluster already
    started (``start_ray``), with ``workers`` tokenizer actors; the requests the model pass reads for ``sample`` turns
    per group (and the cold ones) are rendered on the driver afterwards."""
    import ray
    import ray.data

    shards = plan_shards(log_files(paths), shard_lines_)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    items = [{"number": n, "shard": json.dumps(dataclasses.asdict(shard))} for n, shard in enumerate(shards)]
    counted = ray.data.from_items(items).map_batches(count_shards, batch_size=1, fn_kwargs={"fmt": fmt})
    counts = [row["count"] for row in counted.iter_rows()]
    counts.sort(key=lambda count: count.number)
    skipped = [item for count in counts for item in count.skipped]
    formats: dict[str, int] = {}
    first, total = [], 0
    for count in counts:
        first.append(total + 1)
        total += count.requests
        for name, n in count.formats.items():
            formats[name] = formats.get(name, 0) + n
    if total == 0 and not skipped:
        raise RequestLogError("the log is empty: paste one JSON request per line, or a JSON array of requests")
    for item, start in zip(items, first):
        item["first_index"] = start
    dataset = ray.data.from_items(items).map_batches(
        _ShardTokenPass,
        batch_size=1,
        fn_constructor_kwargs={"tokenizer": tokenizer, "fmt": fmt, "limit": limit, "model": model, "block": settings.block},
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=1,
        max_restarts=RETRIES,
        max_task_retries=RETRIES,
    )
    driver = _Driver(settings, fleet)
    rendering: list[Skipped] = []
    for row in dataset.iter_rows():
        part: ShardTokens = row["tokens"]
        rendering += part.skipped
        driver.feed(part.records)
        if progress:
            progress(driver.time, total)
    pending = driver.pending()
    if pending:
        driver.fill(compare_pairs(tokenizer, shards, driver.where, pending, fmt, limit, model, settings.block))
    scan = driver.scan(skipped + rendering, formats)
    rendered = render_requests(tokenizer, shards, driver.where, _needed(scan, sample), fmt, limit, model)
    return dataclasses.replace(scan, rendered=rendered)


class _Driver:
    """Stage 2: the radix match, the engines and the fleets, in log order, over compact records."""

    def __init__(self, settings: CacheSettings, fleet: Sequence[tuple[int, str]]):
        self.settings = settings
        self.engines = Engines(settings)
        self.fleets = [Fleet(replicas, routing, settings) for replicas, routing in fleet]
        self.rows: list[TrafficRequest] = []
        self.diffs: dict[int, TurnDiff] = {}
        self.where: dict[int, tuple[int, int, int]] = {}
        self.unmatched: dict[int, tuple[int, int, dict[str, int]]] = {}  # request -> (its match, its row's place, reuse)
        self.time = 0
        self.timestamps: list[float | None] = []

    def feed(self, records: Iterator[TokenRecord] | list[TokenRecord]) -> None:
        for record in records:
            self.time += 1
            self.timestamps.append(record.timestamp)
            _, matched = self.engines.radix.match(record.ids, record.session)
            for simulated in self.fleets:
                simulated.insert(record.ids, record.index, record.session, record.hashes)
            reused = self.engines.insert(record.ids, record.index, record.session, self.time, record.hashes)
            self.where[record.index] = record.where
            if matched is None:
                row, diff = record.cold, None
            elif matched == record.guess:
                row, diff = record.against_guess
            else:
                self.unmatched[record.index] = (matched, len(self.rows), reused)
                self.rows.append(record.cold)  # a placeholder until stage 2b
                continue
            self._keep(len(self.rows), row, diff, reused, append=True)

    def _keep(self, at: int, row: TrafficRequest, diff: TurnDiff | None, reused: dict[str, int], append: bool = False) -> None:
        row = dataclasses.replace(row, reused_tokens=reused)
        if append:
            self.rows.append(row)
        else:
            self.rows[at] = row
        if diff is not None:
            self.diffs[row.request] = diff

    def pending(self) -> list[tuple[int, int]]:
        """(request, its match) pairs stage 2b compares."""
        return [(index, matched) for index, (matched, _, _) in self.unmatched.items()]

    def fill(self, results: list[tuple[int, TrafficRequest, TurnDiff | None]]) -> None:
        for index, row, diff in results:
            _, at, reused = self.unmatched[index]
            self._keep(at, row, diff, reused)

    def scan(self, skipped: list[Skipped], formats: dict[str, int]) -> TrafficScan:
        results = tuple(simulated.result() for simulated in self.fleets)
        diffs = dict(sorted(self.diffs.items()))
        scan = TrafficScan(tuple(self.rows), tuple(skipped), formats, self.settings, {}, diffs, fleet=results)
        return dataclasses.replace(scan, reading=self.reading())

    def reading(self) -> dict:
        """How the log was read (``RequestLog.reading``'s keys). The pass keeps the files' order, which is the order
        one process uses unless the timestamps say otherwise: a log out of time order is refused, not reordered."""
        times = self.timestamps
        timed = bool(times) and all(time is not None for time in times)
        if timed and any(later < earlier for earlier, later in zip(times, times[1:])):
            first = next(n for n, (a, b) in enumerate(zip(times, times[1:]), 2) if b < a)
            raise RequestLogError(
                f"request {first} was sent before the one logged ahead of it: --ray reads the files in their order; "
                "sort the log by time first, or audit it without --ray"
            )
        order = "timestamps" if timed else "log"
        untimed = sum(time is None for time in times)
        return {"order": order, "order_reason": ORDERS[order], "untimed_requests": untimed, "flagged": []}


def _needed(scan: TrafficScan, sample: int) -> set[int]:
    """The requests the model pass and its report read: the sampled turns and their matches, and the cold requests."""
    matched = {row.request: row.matched_request for row in scan.requests}
    chosen = {index for group in sample_groups(scan, sample) for index in group.measured}
    return chosen | {matched[i] for i in chosen} | {row.request for row in scan.requests if row.matched_request is None}
