"""Open-loop load generator for an OpenAI-compatible streaming completions endpoint, loopback only.

Requests arrive as a Poisson process at an offered load (requests/s) whether or not earlier ones have
finished, the way independent users arrive at a server; both the count and the arrival window are bounded,
and every request has a deadline. Each request is a ``POST /v1/completions`` with ``stream: true``; its
time to first token (TTFT) is the time from sending to the first streamed chunk that carries a choice.
Only loopback URLs are accepted and proxies from the environment are ignored, so no load leaves the machine.

The engine's own prefix-cache statistics come from its Prometheus ``/metrics`` text (vLLM, SGLang), read by
``kvscope.engine.audit.simulate.metrics`` (the audit reads a scrape the same way).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.common import percentile
from kvscope.engine.audit.logs.usage import answer_usage
from kvscope.engine.audit.simulate.metrics import CacheCounters

_LOOPBACK_NAMES = frozenset({"localhost"})


class LoadgenError(ValueError):
    """A load-generator input is invalid; the message names it."""


# --------------------------------------------------------------------------------------------
# Where load may go
# --------------------------------------------------------------------------------------------


def require_loopback(url: str) -> str:
    """Return ``url`` (without a trailing slash) if its host is a loopback address; refuse anything else."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https"):
        raise LoadgenError(f"refusing {url!r}: only http(s) URLs on 127.0.0.1/::1/localhost are allowed")
    host = parsed.host
    if host not in _LOOPBACK_NAMES:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise LoadgenError(f"refusing {url!r}: load goes to loopback only (127.0.0.1, ::1 or localhost)")
    return url.rstrip("/")


def loopback_client(timeout_s: float, connections: int = 64) -> httpx.AsyncClient:
    """An HTTP client that ignores proxy variables (so loopback traffic stays on loopback)."""
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=timeout_s, trust_env=False, limits=limits)


# --------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """An offered load and its bounds: at most ``max_requests`` arrivals within ``max_duration_s``."""

    offered_rps: float
    max_requests: int
    max_duration_s: float

    def __post_init__(self) -> None:
        if not (self.offered_rps > 0 and math.isfinite(self.offered_rps)):
            raise LoadgenError(f"offered load must be a positive number of requests/s, got {self.offered_rps}")
        if self.max_requests < 1:
            raise LoadgenError(f"max_requests must be >= 1, got {self.max_requests}")
        if not (self.max_duration_s > 0 and math.isfinite(self.max_duration_s)):
            raise LoadgenError(f"max_duration_s must be a positive number of seconds, got {self.max_duration_s}")


def arrival_times(load: Load, rng: random.Random) -> list[float]:
    """Poisson arrival offsets (s): exponential gaps of mean 1/rate, cut at the count or the window."""
    times: list[float] = []
    now = rng.expovariate(load.offered_rps)
    while len(times) < load.max_requests and now <= load.max_duration_s:
        times.append(now)
        now += rng.expovariate(load.offered_rps)
    return times


# --------------------------------------------------------------------------------------------
# One streamed request, and a run of them
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestResult:
    """One request's timing (s, from the run's start) and output; ``error`` is None when it completed."""

    index: int
    scheduled_s: float
    sent_s: float
    ttft_s: float | None
    latency_s: float | None
    completion_tokens: int
    text: str
    error: str | None = None
    prompt_tokens: int | None = None  # the server's usage report, when it sends one
    cached_tokens: int | None = None  # prompt tokens it served from its prefix cache (usage.prompt_tokens_details)

    @property
    def finished_s(self) -> float | None:
        return None if self.latency_s is None else self.sent_s + self.latency_s


@dataclass(frozen=True)
class Streamed:
    """What one streamed completion returned: timings (s), tokens, text and the server's usage report."""

    ttft_s: float | None
    latency_s: float
    completion_tokens: int
    text: str
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


async def stream_completion(client: httpx.AsyncClient, base_url: str, payload: dict[str, Any]) -> Streamed:
    """POST a streaming completion (asking for the usage report) and read it to the end.

    Tokens are the streamed chunks with a choice, unless the server reports ``usage.completion_tokens``;
    ``usage.prompt_tokens_details.cached_tokens`` (llama-server, vLLM with prompt-token details, SGLang) is the
    request's own prefix-cache hit, read as the audit reads usage (``kvscope.engine.audit.logs.usage.answer_usage``).
    """
    url = f"{require_loopback(base_url)}/v1/completions"
    started = time.perf_counter()
    ttft, chunks, usage, pieces = None, 0, {}, []
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            message = f"HTTP {response.status_code}: {text}"
            raise httpx.HTTPStatusError(message, request=response.request, response=response)
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - started
                chunks += 1
                pieces.append(chunk["choices"][0].get("text") or "")
            if chunk.get("usage"):
                usage = chunk["usage"]
    reported = answer_usage({"usage": usage})  # the usage object alone, as the audit reads a log's or an answer's
    return Streamed(
        ttft_s=ttft,
        latency_s=time.perf_counter() - started,
        completion_tokens=usage.get("completion_tokens", chunks),
        text="".join(pieces),
        prompt_tokens=reported.prompt,
        cached_tokens=reported.cached,
    )


async def run_load(
    base_url: str,
    payloads: Sequence[dict[str, Any]],
    arrivals: Sequence[float],
    request_timeout_s: float,
) -> list[RequestResult]:
    """Send ``payloads[i]`` at ``arrivals[i]`` s after the start (open loop); one result per arrival.

    A request that has not finished ``request_timeout_s`` after it was sent is cancelled and recorded as an
    error, so a run lasts at most ``arrivals[-1] + request_timeout_s``.
    """
    require_loopback(base_url)
    if len(payloads) < len(arrivals):
        raise LoadgenError(f"{len(arrivals)} arrivals but only {len(payloads)} payloads")

    async def one(index: int, at: float, client: httpx.AsyncClient, start: float) -> RequestResult:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        sent = time.perf_counter() - start
        try:
            streamed = await asyncio.wait_for(stream_completion(client, base_url, payloads[index]), request_timeout_s)
        except (TimeoutError, asyncio.TimeoutError):
            return RequestResult(index, at, sent, None, None, 0, "", error=f"timeout after {request_timeout_s} s")
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return RequestResult(index, at, sent, None, None, 0, "", error=f"{type(e).__name__}: {e}")
        return RequestResult(
            index,
            at,
            sent,
            streamed.ttft_s,
            streamed.latency_s,
            streamed.completion_tokens,
            streamed.text,
            None,
            streamed.prompt_tokens,
            streamed.cached_tokens,
        )

    async with loopback_client(request_timeout_s, connections=max(1, len(arrivals))) as client:
        start = time.perf_counter()  # after the client is built (its TLS context takes ~0.1 s)
        return list(await asyncio.gather(*(one(i, at, client, start) for i, at in enumerate(arrivals))))


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunStats:
    """Latency percentiles (ms; :data:`benchmarks.common.PERCENTILE`) over completed requests, and throughput over the run."""

    requests: int
    completed: int
    errors: int
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    throughput_rps: float | None
    output_tokens_per_s: float | None


def summarize(results: Sequence[RequestResult]) -> RunStats:
    """Percentiles of TTFT and latency, and completed requests (and tokens) per second.

    Throughput divides by the time from the first request sent to the last one finished.
    """
    done = [r for r in results if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s * 1000 for r in done]
    latency = [r.latency_s * 1000 for r in done]
    span = max(r.finished_s for r in done) - min(r.sent_s for r in results) if done else 0.0

    def pct(values: list[float], q: float) -> float | None:
        return round(percentile(values, q), 1) if values else None

    return RunStats(
        requests=len(results),
        completed=len(done),
        errors=len(results) - len(done),
        ttft_p50_ms=pct(ttft, 50),
        ttft_p90_ms=pct(ttft, 90),
        ttft_p99_ms=pct(ttft, 99),
        latency_p50_ms=pct(latency, 50),
        latency_p90_ms=pct(latency, 90),
        throughput_rps=round(len(done) / span, 4) if span > 0 else None,
        output_tokens_per_s=round(sum(r.completion_tokens for r in done) / span, 2) if span > 0 else None,
    )


def usage_counters(results: Sequence[RequestResult]) -> CacheCounters | None:
    """Prefix-cache hits summed over the completed requests' own usage reports; None unless every one
    reported its cached tokens."""
    done = [r for r in results if r.error is None]
    if not done or any(r.cached_tokens is None or r.prompt_tokens is None for r in done):
        return None
    return CacheCounters(float(sum(r.cached_tokens for r in done)), float(sum(r.prompt_tokens for r in done)))
