"""One reader for request logs given as many files, a directory of shards, or gzip'd JSONL, streamed line by line.

A JSONL file (plain or gzip'd) is never loaded whole: it is read a line at a time, and cut into shards of
``SHARD_LINES`` lines (a file, its first line and, for a plain file, the byte offset of that line, found by counting
newlines in 1 MiB blocks), which the distributed token pass reads on its workers. A file of one JSON document (an
array, or an API's page written over many lines) cannot be streamed: it is read whole, as one shard. Files are read in
the order given, a directory's files (``LOG_SUFFIXES``) in name order; requests are numbered across them in that order
(``reading.finished_log`` then puts them in time order where every one has a timestamp), lines within each file.
With more than one file, a record skipped is named by its file as well as its line.
``LogFiles`` is a log as given (paths and format), the one thing both token passes take: read whole in one process
(``LogFiles.log``), or planned into shards for the distributed pass (``LogFiles.shards``).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvscope.engine.audit.logs.formats import AUTO, RecordError
from kvscope.engine.audit.logs.reading import finished_log, log_records, read_log, record_requests
from kvscope.engine.audit.logs.requests import Flagged, Request, RequestLog, RequestLogError, Skipped
from kvscope.engine.audit.logs.sources import joined_records

LOG_SUFFIXES = (".jsonl", ".json", ".gz")
SHARD_LINES = 2_000  # lines per shard of the distributed token pass
WHOLE_TEXT_BYTES = 64 << 20  # a plain log file up to this size is read in one process as one text (``LogFiles.log``)
_BLOCK = 1 << 20  # bytes read at a time while counting lines
_UNTIL_IT_FAILS = 1 << 62  # the lines of a corrupt file's last shard: read until the error
# What marks an export whose records complete each other across lines (OpenTelemetry: a span's messages in log
# records, its conversation id on an ancestor span; ``sources.joined_records``): such a file is one shard, read whole.
LINKED = (b'"resourceSpans"', b'"resourceLogs"')


@dataclass(frozen=True)
class Shard:
    """A run of ``lines`` lines of one log file from ``first_line`` (1-based); ``offset``: where that line starts
    (bytes, plain files; None: a gzip'd file, read from its start); ``whole``: a file of one JSON document (an array,
    or an API's page written over many lines), read whole."""

    path: str
    first_line: int
    lines: int
    offset: int | None
    whole: bool = False
    named: bool = False  # records skipped here are named by the file too (the log has several files)
    linked: bool = False  # an export whose records complete each other across lines (``LINKED``): its file in one shard


def log_files(paths: Sequence[str | Path]) -> list[Path]:
    """The files of a log: each path a file, or a directory whose ``LOG_SUFFIXES`` files are read in name order."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(LOG_SUFFIXES))
            if not found:
                raise RequestLogError(f"{path} holds no log file (names ending in {', '.join(LOG_SUFFIXES)})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise RequestLogError(f"{path}: no such file or directory")
    if not files:
        raise RequestLogError("no log file given")
    return files


def _open(path: str | Path) -> IO[bytes]:
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")


def _is_whole(path: Path) -> bool:
    """Whether the file is one JSON document rather than JSONL: its first record opens a JSON array, or an object
    that its first line does not close (an API's page written over many lines)."""
    try:
        with _open(path) as stream:
            while chunk := stream.readline():
                stripped = chunk.strip()
                if stripped:
                    return stripped[:1] == b"[" or (stripped[:1] == b"{" and not _parses(stripped))
    except (OSError, EOFError, zlib.error):  # unreadable from its start: read as lines, to be named where it fails
        return False
    return False


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def plan_shards(files: Sequence[Path], lines_per_shard: int = SHARD_LINES) -> list[Shard]:
    """Every file cut into shards of ``lines_per_shard`` lines (a file of one JSON document, or of an export whose
    records complete each other across lines (``LINKED``): one shard), in order."""
    named = len(files) > 1
    shards: list[Shard] = []
    for path in files:
        if _is_whole(path):
            shards.append(Shard(str(path), 1, 0, None, whole=True, named=named))
            continue
        plain = not str(path).endswith(".gz")
        starts, lines, position, last, broken = [0], 0, 0, b"\n", False  # byte offsets of each shard's first line
        linked, tail = False, b""
        try:
            with _open(path) as stream:
                while block := stream.read(_BLOCK):
                    linked = linked or any(marker in tail + block for marker in LINKED)
                    tail = block[-32:]
                    at = -1
                    while (at := block.find(b"\n", at + 1)) >= 0:
                        lines += 1
                        if lines % lines_per_shard == 0:
                            starts.append(position + at + 1)
                    position += len(block)
                    last = block[-1:]
        except (OSError, EOFError, zlib.error):  # corrupt or truncated: the last shard reads on until it fails, and says where
            broken = True
        lines += last != b"\n"  # a last line without its newline
        if linked:
            shards.append(Shard(str(path), 1, _UNTIL_IT_FAILS if broken else lines, 0 if plain else None, named=named, linked=True))
            continue
        for number, start in enumerate(starts):
            first = number * lines_per_shard + 1
            if first <= lines or (broken and number == len(starts) - 1):
                count = _UNTIL_IT_FAILS if broken and number == len(starts) - 1 else min(lines_per_shard, lines - first + 1)
                shards.append(Shard(str(path), first, count, start if plain else None, named=named))
    return shards


def shard_lines(shard: Shard) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of each line of a JSONL shard, streamed."""
    with _open(shard.path) as stream:
        if shard.offset is not None:
            stream.seek(shard.offset)
        else:
            for _ in range(shard.first_line - 1):
                stream.readline()
        for number in range(shard.first_line, shard.first_line + shard.lines):
            raw = stream.readline()
            if not raw:
                return
            yield number, raw


@dataclass(frozen=True)
class ShardRead:
    """A shard's requests (numbered from ``first_index``), the records skipped, by line and key, and the sessions its
    records name for Langfuse traces (``reading.join_traces``: a trace's observations may lie in other shards)."""

    requests: list[Request]
    skipped: list[Skipped]
    sessions: dict[str, str]


def read_shard(shard: Shard, fmt: str = AUTO, first_index: int = 1) -> ShardRead:
    """The requests of one shard, numbered from ``first_index`` in the file's order; a malformed record is skipped by
    line and key."""
    requests: list[Request] = []
    skipped: list[Skipped] = []
    sessions: dict[str, str] = {}
    line = shard.first_line - 1
    try:
        for line, item in _shard_records(shard):
            try:
                read = record_requests(item, fmt, first_index + len(requests), line)
            except RecordError as error:
                skipped.append(_in_file(shard, Skipped(line, error.key, error.reason)))
                continue
            requests += read.requests
            skipped += [_in_file(shard, part) for part in read.skipped]
            sessions |= read.sessions
    except (OSError, EOFError, zlib.error) as error:  # a truncated or corrupt file: the lines read so far stand
        reason = f"cannot be read from here on ({type(error).__name__}: {error}) (in {Path(shard.path).name})"
        skipped.append(Skipped(line + 1, "", reason))
    return ShardRead(requests, skipped, sessions)


def _shard_records(shard: Shard) -> Iterator[tuple[int, Any]]:
    """(line, parsed record or why it is not one) of each record of a shard: a whole document's, or its lines'
    (joined to each other, ``sources.joined_records``, where the shard is a whole file)."""
    if shard.whole:
        with _open(shard.path) as stream:
            yield from joined_records(log_records(stream.read().decode("utf-8")))
        return
    if shard.linked:
        yield from joined_records(list(_line_records(shard)))
        return
    yield from _line_records(shard)


def _line_records(shard: Shard) -> Iterator[tuple[int, Any]]:
    for line, raw in shard_lines(shard):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            yield line, RecordError("", f"is not UTF-8 text (byte {error.start})")
            continue
        if text.strip():
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as error:
                yield line, error


@dataclass(frozen=True)
class ShardCount:
    """A shard's requests counted (read and unwrapped, not rendered), its skipped records, its formats' counts, the
    sessions it names for Langfuse traces, each request's timestamp (NaN: none), for the log's order, and its flags."""

    number: int
    requests: int
    skipped: list[Skipped]
    formats: dict[str, int]
    sessions: dict[str, str]
    timestamps: np.ndarray  # (requests,) float64
    flagged: list[Flagged]  # numbered within the shard, from 1


def count_shards(batch: dict[str, np.ndarray], fmt: str = AUTO) -> dict[str, np.ndarray]:
    """The distributed pass's first step on a batch of shards (columns ``number`` and ``shard``, its JSON): each
    shard's requests counted, so that every request gets its number in the whole log before it is rendered."""
    out = []
    for number, text in zip(batch["number"], batch["shard"]):
        read = read_shard(Shard(**json.loads(text)), fmt)
        formats = dict(Counter(request.format for request in read.requests))
        times = np.array([np.nan if r.timestamp is None else r.timestamp for r in read.requests], dtype=np.float64)
        flagged = [Flagged(r.index, r.line, key, reason) for r in read.requests for key, reason in r.flags]
        out.append(ShardCount(int(number), len(read.requests), read.skipped, formats, read.sessions, times, flagged))
    return {"count": np.array(out, dtype=object)}


def _in_file(shard: Shard, item: Skipped) -> Skipped:
    return dataclasses.replace(item, reason=f"{item.reason} (in {Path(shard.path).name})") if shard.named else item


def read_logs(paths: Sequence[str | Path], fmt: str = AUTO) -> RequestLog:
    """Every readable request of a log given as files, directories of shards or gzip'd JSONL, read in one process
    (one file: the same requests and skipped records as ``read_log`` on its text)."""
    requests: list[Request] = []
    skipped: list[Skipped] = []
    sessions: dict[str, str] = {}
    for shard in plan_shards(log_files(paths)):
        read = read_shard(shard, fmt, len(requests) + 1)
        requests += read.requests
        skipped += read.skipped
        sessions |= read.sessions
    if not requests and not skipped:
        raise RequestLogError("the log is empty: paste one JSON request per line, or a JSON array of requests")
    return finished_log(requests, skipped, sessions)


@dataclass(frozen=True)
class LogFiles:
    """A request log as given, the one thing both token passes take: its paths (files, directories of shards, gzip'd
    JSONL) and the format to read them in. One process reads it whole (``log``: one plain file as its text, as
    ``reading.read_log`` reads it; else ``read_logs``); the distributed pass plans it into shards (``shards``) that its
    workers read (``read_shard``). Both give the same requests, in the same order, with the same records skipped."""

    paths: tuple[str, ...]
    fmt: str = AUTO

    @classmethod
    def of(cls, paths: Sequence[str | Path], fmt: str = AUTO) -> LogFiles:
        return cls(tuple(str(path) for path in paths), fmt)

    @property
    def one_text(self) -> bool:
        """Whether the log is one plain file, read as text (else: many files, a directory, or gzip)."""
        return len(self.paths) == 1 and Path(self.paths[0]).is_file() and not self.paths[0].endswith(".gz")

    def text(self) -> str:
        """The text of a log of one plain file (``one_text``)."""
        try:
            return Path(self.paths[0]).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise RequestLogError(f"cannot read {self.paths[0]}: {error}") from None

    @functools.cached_property
    def log(self) -> RequestLog:
        """The log read in this process (once: kept for every later reader); a plain file over ``WHOLE_TEXT_BYTES`` is
        streamed line by line (``read_logs``: the same requests), not held whole as text and parsed records."""
        whole = self.one_text and Path(self.paths[0]).stat().st_size <= WHOLE_TEXT_BYTES
        return read_log(self.text(), self.fmt) if whole else read_logs(self.paths, self.fmt)

    def shards(self, lines_per_shard: int = SHARD_LINES) -> list[Shard]:
        """The log's files cut into the shards the distributed pass reads (``plan_shards``)."""
        return plan_shards(log_files(self.paths), lines_per_shard)
