"""A serving engine's own prefix-cache counters, read from its Prometheus ``/metrics`` text: an observed aggregate for
fleets whose logs carry no usage, set beside the simulated engines' reuse over the same log.

| engine | hits (prompt tokens served from cache) | queries (prompt tokens looked up) |
|---|---|---|
| vLLM V1 (>= 0.9) | ``vllm:prefix_cache_hits_total`` | ``vllm:prefix_cache_queries_total`` |
| vLLM V1 (0.7-0.8) | ``vllm:gpu_prefix_cache_hits_total`` | ``vllm:gpu_prefix_cache_queries_total`` |
| SGLang | ``sglang:cached_tokens_total`` | ``sglang:prompt_tokens_total`` |

Counters count from the server's start, so a scrape taken before the log's window and one after it give the log's
share (their difference); one scrape alone is the server's whole life. Engines without counters export a running
hit-rate gauge (``vllm:gpu_prefix_cache_hit_rate``, ``sglang:cache_hit_rate``), reported as is. vLLM's hits equal the
sum of the per-answer ``cached_tokens``. The counts are in the served model's tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

from kvscope.engine.audit.report.records import OMITTED, Record
from kvscope.engine.errors import KVScopeError

# (hits, queries) counter pairs, in prompt tokens, newest naming first. Prometheus clients append "_total" to
# counters, so both spellings are looked up.
COUNTER_PAIRS = (
    ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
    ("sglang:cached_tokens", "sglang:prompt_tokens"),
)
RATE_GAUGES = ("vllm:gpu_prefix_cache_hit_rate", "sglang:cache_hit_rate")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


class MetricsError(KVScopeError, ValueError):
    """A metrics scrape that cannot be read; the message names the line and why."""


@dataclass(frozen=True)
class Sample:
    """One Prometheus sample: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative prefix-cache counters in prompt tokens: how many were looked up and how many hit."""

    hits: float
    queries: float

    def since(self, before: CacheCounters) -> CacheCounters:
        """What was counted between the scrape ``before`` and this one."""
        return CacheCounters(self.hits - before.hits, self.queries - before.queries)


def parse_prometheus(text: str) -> list[Sample]:
    """Parse Prometheus text format (comments skipped, labels unescaped, an optional timestamp dropped)."""
    samples = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise MetricsError(f"metrics line {number} is not a Prometheus sample: {line[:120]!r}")
        name, label_text, value = match.groups()
        labels = {key: _unescape(val) for key, val in _LABEL.findall(label_text or "")}
        try:
            samples.append(Sample(name, labels, float(value)))
        except ValueError:
            raise MetricsError(f"metrics line {number} has a non-numeric value {value!r}") from None
    return samples


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def metric_sum(samples: Sequence[Sample], name: str) -> float | None:
    """Sum of a metric over all its label sets (``name`` or ``name_total``); None if absent."""
    values = [s.value for s in samples if s.name in (name, f"{name}_total")]
    return sum(values) if values else None


def cache_counters(samples: Sequence[Sample]) -> CacheCounters | None:
    """The engine's prefix-cache hit/query counters, from the first known metric pair present."""
    for hits_name, queries_name in COUNTER_PAIRS:
        hits, queries = metric_sum(samples, hits_name), metric_sum(samples, queries_name)
        if hits is not None and queries is not None:
            return CacheCounters(hits, queries)
    return None


def cache_hit_rate_gauge(samples: Sequence[Sample]) -> float | None:
    """A running hit-rate gauge, for engines that export no counters (mean over label sets)."""
    for name in RATE_GAUGES:
        values = [s.value for s in samples if s.name == name]
        if values:
            return sum(values) / len(values)
    return None


@dataclass(frozen=True)
class ServerMetrics(Record):
    """``--metrics``: what the server's Prometheus scrapes say beside each engine's simulated hit rate (``hits`` and
    ``queries`` from counters; a hit-rate gauge gives the rate alone)."""

    source: str
    hits: Annotated[int | None, OMITTED]
    queries: Annotated[int | None, OMITTED]
    hit_rate: float | None
    simulated_hit_rate: dict[str, float]


def observed_aggregate(scrapes: Sequence[str], simulated_hit_rate: dict[str, float]) -> ServerMetrics:
    """What one or two scrapes say (two: after minus before, the log's window) beside each simulated engine's hit
    rate over the log; a ``MetricsError`` names a scrape with no known prefix-cache metric."""
    if not 1 <= len(scrapes) <= 2:
        raise MetricsError(f"--metrics takes one scrape, or two (before and after the log), got {len(scrapes)}")
    counted = []
    for number, text in enumerate(scrapes, 1):
        samples = parse_prometheus(text)
        counters = cache_counters(samples)
        if counters is None:
            gauge = cache_hit_rate_gauge(samples)
            if gauge is None or len(scrapes) == 2:
                names = ", ".join(f"{hits}_total / {queries}_total" for hits, queries in COUNTER_PAIRS)
                raise MetricsError(f"metrics scrape {number} has no prefix-cache counters ({names})")
            gauged = "hit-rate gauge (the server's running rate, not the log's)"
            return ServerMetrics(gauged, None, None, round(gauge, 4), simulated_hit_rate)
        counted.append(counters)
    hits, queries = counted[-1].hits - (counted[0].hits if len(counted) == 2 else 0), counted[-1].queries
    queries -= counted[0].queries if len(counted) == 2 else 0
    if hits < 0 or queries < 0:
        raise MetricsError("the second metrics scrape counts less than the first: the server restarted between them, or they are swapped")
    window = "the difference of two scrapes (the log's window)" if len(counted) == 2 else "one scrape (since the server started)"
    rate = round(hits / queries, 4) if queries else None
    return ServerMetrics(f"prefix-cache counters, {window}", int(hits), int(queries), rate, simulated_hit_rate)
