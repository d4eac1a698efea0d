"""Stage 1 of the token pass on Ray (``ray_scan`` says the whole plan): an actor that holds the tokenizer reads,
unwraps, renders and tokenizes a shard's requests, hashes their blocks and computes each row against its match among
the shard's earlier requests (``ShardTokenPass``), returning compact records (``TokenRecord``, ``ShardTokens``)."""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.engine.audit.changes.fields import TurnDiff
from kvscope.engine.audit.logs.reading import join_traces
from kvscope.engine.audit.logs.render import render_batch
from kvscope.engine.audit.logs.requests import Request, RequestLogError, Skipped
from kvscope.engine.audit.logs.shards import Shard, ShardCount, count_shards, read_shard
from kvscope.engine.audit.paged_blocks import block_hashes
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficRequest, compared_row
from kvscope.engine.audit.simulate.hosted import HostedRequest, hosted_request
from kvscope.engine.audit.simulate.observed import Reported
from kvscope.engine.audit.simulate.radix import RadixTree
from kvscope.engine.audit.simulate.step import Step


@dataclass(frozen=True)
class TokenRecord:
    """What stage 2 holds of one request: integers, the two rows computed for it on a worker, and what its record
    reports (the observed count, when and to which model it was sent, what a hosted provider's cache reads)."""

    index: int
    session: str | None
    where: tuple[int, int, int]  # shard number, line, position among its record's requests
    ids: np.ndarray  # (tokens,) int32
    hashes: np.ndarray  # (blocks,) int64, chained
    guess: int | None  # its match among the shard's earlier requests (a radix tree of the shard; None: none there)
    row: TrafficRequest  # its row against that match (cold without one)
    diff: TurnDiff | None
    reported: Reported
    hosted: HostedRequest | None = None
    reply: np.ndarray | None = None  # (tokens,) int32: the logged reply's tokens the server computed (None: no reply logged)

    def step(self) -> Step:
        """The record as the simulated caches take it (``hashes``: of its tokens and its reply's)."""
        logged = self.reply is not None
        reply = self.reply if logged else np.zeros(0, dtype=np.int32)
        return Step(self.ids, reply, self.index, self.session, logged, self.hosted, self.hashes)


@dataclass(frozen=True)
class ShardTokens:
    """Stage 1's output for one shard: its records in order, the requests it could not render, or why it failed."""

    number: int
    records: list[TokenRecord]
    skipped: list[Skipped]


class ShardTokenPass:
    """Stage 1's actor: holds the tokenizer; per shard, its requests counted (``count``), or read, numbered in the
    log's order, rendered, hashed and diffed with the token pass's ``settings`` (``tokens``; ``shipped``: pickled for
    the driver). ``sessions``: the Langfuse traces' sessions named anywhere in the log (``join``, once counted)."""

    def __init__(self, tokenizer: Any, fmt: str, settings: ScanSettings, model: str, sessions: dict[str, str] | None = None):
        self.tokenizer, self.fmt, self.settings, self.model = tokenizer, fmt, settings, model
        self.sessions = sessions or {}

    def count(self, number: int, shard: Shard) -> ShardCount:
        """The shard's requests counted (read and unwrapped, not rendered: ``shards.count_shards``)."""
        (count,) = count_shards({"number": [number], "shard": [json.dumps(dataclasses.asdict(shard))]}, self.fmt)["count"]
        return count

    def join(self, sessions: dict[str, str]) -> None:
        """The Langfuse traces' sessions the whole log names, for the shards tokenized from now on."""
        self.sessions = sessions

    def shipped(self, number: int, shard: Shard, first_index: int, indexes: np.ndarray | None) -> bytes:
        """``tokens`` pickled here: bytes that Ray stores as they are (token ids, int32 arrays, pickled as their
        buffers), which the driver unpickles into arrays of its own (not views that would pin the object store)."""
        part = self.tokens(number, shard, first_index, None if indexes is None else indexes.tolist())
        return pickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)

    def tokens(self, number: int, shard: Shard, first_index: int, indexes: list[int] | None) -> ShardTokens:
        """The shard's records; ``indexes``: each request's number in the log's time order (None: the files' order)."""
        requests = join_traces(read_shard(shard, self.fmt, first_index).requests, self.sessions)
        place = _places(requests)  # by the files' numbering, which ``where`` re-reads by
        if indexes is not None:
            requests = [dataclasses.replace(request, index=index) for request, index in zip(requests, indexes, strict=True)]
        rendered = render_batch(self.tokenizer, requests, self.settings.limit, self.model)
        records, skipped, local, kept = [], [], RadixTree(), {}  # the shard's own radix tree, its rendered requests
        for request, item, at in zip(requests, rendered, place):
            if isinstance(item, RequestLogError):
                skipped.append(Skipped(request.line, "rendering", str(item)))
                continue
            _, guess = local.match(item.token_ids, request.session)
            local.insert(item.token_ids, request.index, request.session, len(kept) + 1, item.held)
            row, diff = compared_row(kept.get(guess), item, guess, self.settings.cache.block)
            records.append(
                TokenRecord(
                    request.index,
                    request.session,
                    (number, *at),
                    item.token_ids,
                    block_hashes(item.held, self.settings.cache.block),
                    guess,
                    row,
                    diff,
                    Reported.of(request),
                    hosted_request(item, [mark.token for mark in row.breakpoints]),
                    item.reply_ids if request.reply is not None else None,
                )
            )
            kept[request.index] = item
        return ShardTokens(number, records, skipped)


def _places(requests: Sequence[Request]) -> list[tuple[int, int]]:
    """Per request: its line and its position among the requests its record holds."""
    places, seen = [], {}
    for request in requests:
        position = seen.get(request.line, 0)
        seen[request.line] = position + 1
        places.append((request.line, position))
    return places
