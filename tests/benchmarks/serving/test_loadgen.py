"""The load generator: Poisson arrivals, statistics, loopback-only refusal, Prometheus parsing, streaming."""

from __future__ import annotations

import asyncio
import json
import random
import statistics

import httpx
import numpy as np
import pytest

from benchmarks.serving.loadgen import (
    Load,
    LoadgenError,
    RequestResult,
    arrival_times,
    require_loopback,
    run_load,
    stream_completion,
    summarize,
    usage_counters,
)
from kvscope.engine.audit.simulate.metrics import (
    CacheCounters,
    MetricsError,
    cache_counters,
    cache_hit_rate_gauge,
    metric_sum,
    parse_prometheus,
)

# --------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------


def test_poisson_gaps_have_exponential_mean_and_variance():
    rate = 2.0
    times = arrival_times(Load(rate, max_requests=20_000, max_duration_s=1e9), random.Random(7))
    gaps = np.diff([0.0, *times])
    assert len(times) == 20_000
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() == pytest.approx(1 / rate**2, rel=0.06)  # exponential: variance = mean²
    assert all(gap > 0 for gap in gaps)


def test_arrivals_are_reproducible_for_a_seed():
    load = Load(0.5, max_requests=10, max_duration_s=1e6)
    assert arrival_times(load, random.Random(3)) == arrival_times(load, random.Random(3))
    assert arrival_times(load, random.Random(3)) != arrival_times(load, random.Random(4))


def test_arrivals_stop_at_the_request_bound():
    assert len(arrival_times(Load(100.0, max_requests=5, max_duration_s=1e6), random.Random(0))) == 5


def test_arrivals_stop_at_the_duration_bound():
    times = arrival_times(Load(10.0, max_requests=10_000, max_duration_s=30.0), random.Random(1))
    assert times and max(times) <= 30.0
    assert len(times) == pytest.approx(300, abs=4 * 300**0.5)  # Poisson count: mean = variance = rate · T


@pytest.mark.parametrize(
    "kwargs",
    [
        {"offered_rps": 0.0, "max_requests": 1, "max_duration_s": 1.0},
        {"offered_rps": float("inf"), "max_requests": 1, "max_duration_s": 1.0},
        {"offered_rps": 1.0, "max_requests": 0, "max_duration_s": 1.0},
        {"offered_rps": 1.0, "max_requests": 1, "max_duration_s": 0.0},
    ],
)
def test_unbounded_or_empty_loads_are_refused(kwargs):
    with pytest.raises(LoadgenError):
        Load(**kwargs)


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def _result(index: int, sent: float, ttft: float | None, latency: float | None, tokens: int = 4, error=None):
    return RequestResult(index, sent, sent, ttft, latency, tokens, "yes", error)


def test_summarize_percentiles_throughput_and_errors():
    ttfts = [0.1, 0.2, 0.3, 0.4, 1.0]
    results = [_result(i, sent=float(i), ttft=t, latency=t + 0.5) for i, t in enumerate(ttfts)]
    results.append(_result(5, sent=5.0, ttft=None, latency=None, tokens=0, error="timeout after 1 s"))
    stats = summarize(results)
    assert (stats.requests, stats.completed, stats.errors) == (6, 5, 1)
    assert stats.ttft_p50_ms == pytest.approx(np.percentile(ttfts, 50) * 1000, abs=0.05)
    assert stats.ttft_p90_ms == pytest.approx(np.percentile(ttfts, 90) * 1000, abs=0.05)
    assert stats.ttft_p99_ms == pytest.approx(np.percentile(ttfts, 99) * 1000, abs=0.05)
    span = (4.0 + 1.5) - 0.0  # last finish - first send
    assert stats.throughput_rps == pytest.approx(5 / span, abs=1e-4)
    assert stats.output_tokens_per_s == pytest.approx(20 / span, abs=0.01)


def test_summarize_with_nothing_completed():
    stats = summarize([_result(0, 0.0, None, None, 0, error="HTTPError")])
    assert stats.completed == 0 and stats.ttft_p90_ms is None and stats.throughput_rps is None


# --------------------------------------------------------------------------------------------
# Loopback only
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.3.2.1:1/", "http://[::1]:8080", "http://localhost:9000"])
def test_loopback_urls_are_accepted(url):
    assert require_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.7:8000",
        "http://0.0.0.0:8000",
        "http://example.com",
        "http://127.0.0.1.example.com:80",
        "https://192.168.1.2",
        "ftp://127.0.0.1/",
        "http://[2001:db8::1]:80",
    ],
)
def test_other_urls_are_refused(url):
    with pytest.raises(LoadgenError, match="refusing"):
        require_loopback(url)


def test_run_load_refuses_before_sending():
    with pytest.raises(LoadgenError, match="loopback"):
        asyncio.run(run_load("http://10.1.2.3:8000", [{"prompt": "x"}], [0.0], request_timeout_s=1.0))


# --------------------------------------------------------------------------------------------
# Prometheus text
# --------------------------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 8192.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 1808.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 7936.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 1664.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
vllm:odd_label{path="a \\"quoted\\" {brace}",empty=""} NaN 1712345678000
"""


def test_parse_prometheus_labels_values_and_escapes():
    samples = parse_prometheus(VLLM_METRICS)
    assert len(samples) == 7
    running = samples[0]
    assert running.name == "vllm:num_requests_running" and running.value == 3.0
    assert running.labels == {"engine": "0", "model_name": "Qwen/Qwen2.5-7B-Instruct"}
    assert samples[5].labels["le"] == "+Inf"
    odd = samples[6]
    assert odd.labels == {"path": 'a "quoted" {brace}', "empty": ""}
    assert odd.value != odd.value  # NaN; the trailing timestamp is dropped


def test_metric_sum_over_label_sets_and_total_suffix():
    samples = parse_prometheus(VLLM_METRICS)
    assert metric_sum(samples, "vllm:prefix_cache_queries") == 10000.0
    assert metric_sum(samples, "vllm:absent") is None


def rate_between(before: CacheCounters, after: CacheCounters) -> float | None:
    """Hit rate of the tokens looked up between two snapshots; None if none were."""
    queries = after.queries - before.queries
    return (after.hits - before.hits) / queries if queries > 0 else None


def test_cache_counters_and_rate_between_snapshots():
    before = cache_counters(parse_prometheus(VLLM_METRICS))
    assert before == CacheCounters(hits=9600.0, queries=10000.0)
    after_text = VLLM_METRICS.replace("8192.0", "18192.0").replace("7936.0", "17786.0")
    after = cache_counters(parse_prometheus(after_text))
    assert rate_between(before, after) == pytest.approx(9850 / 10000)
    assert rate_between(before, before) is None


def test_older_vllm_and_sglang_metric_names():
    older = "vllm:gpu_prefix_cache_queries_total 100\nvllm:gpu_prefix_cache_hits_total 40\n"
    assert cache_counters(parse_prometheus(older)) == CacheCounters(40.0, 100.0)
    sglang = 'sglang:prompt_tokens_total{model_name="m"} 200\nsglang:cached_tokens_total{model_name="m"} 150\n'
    assert cache_counters(parse_prometheus(sglang)) == CacheCounters(150.0, 200.0)
    gauge_only = 'sglang:cache_hit_rate{model_name="m"} 0.25\nvllm:num_requests_running 0\n'
    samples = parse_prometheus(gauge_only)
    assert cache_counters(samples) is None and cache_hit_rate_gauge(samples) == 0.25
    assert cache_hit_rate_gauge(parse_prometheus(older)) is None


def test_parse_prometheus_rejects_garbage():
    with pytest.raises(MetricsError, match="line 2"):
        parse_prometheus("ok_metric 1\nthis is not a sample\n")


# --------------------------------------------------------------------------------------------
# Streaming against an in-process SSE server on 127.0.0.1
# --------------------------------------------------------------------------------------------

FIRST_TOKEN_S = 0.15
TOKEN_GAP_S = 0.05
TOKENS = ("Yes", ",", " approve")


async def _sse_server(requests_seen: list[dict]) -> asyncio.Server:
    """A minimal HTTP/1.1 server that streams three completion chunks per request, then [DONE]."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
            requests_seen.append(json.loads(await reader.readexactly(length)))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            writer.write(b": ping\r\n\r\n")  # a comment line, as sse servers send
            await asyncio.sleep(FIRST_TOKEN_S)
            for token in TOKENS:
                writer.write(f"data: {json.dumps({'choices': [{'text': token, 'index': 0}]})}\r\n\r\n".encode())
                await writer.drain()
                await asyncio.sleep(TOKEN_GAP_S)
            writer.write(b"data: [DONE]\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass  # the client gave up (deadline test)
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_run_load_is_open_loop_and_times_each_stream():
    seen: list[dict] = []

    async def scenario():
        server = await _sse_server(seen)
        port = server.sockets[0].getsockname()[1]
        async with server:
            arrivals = [0.0, 0.05, 0.1]
            payloads = [{"prompt": f"p{i}", "max_tokens": 3} for i in range(3)]
            return await run_load(f"http://127.0.0.1:{port}", payloads, arrivals, request_timeout_s=5.0)

    results = asyncio.run(scenario())
    assert [r.error for r in results] == [None, None, None]
    assert sorted(p["prompt"] for p in seen) == ["p0", "p1", "p2"] and all(p["stream"] for p in seen)
    for result in results:
        assert result.text == "".join(TOKENS) and result.completion_tokens == 3
        assert FIRST_TOKEN_S <= result.ttft_s < FIRST_TOKEN_S + 0.5
        assert result.latency_s >= FIRST_TOKEN_S + 2 * TOKEN_GAP_S
    # open loop: the third request was sent on schedule, before the first one finished
    assert results[2].sent_s < results[0].finished_s
    assert statistics.mean(r.sent_s - r.scheduled_s for r in results) < 0.05


def test_request_deadline_is_recorded_as_an_error():
    async def scenario():
        server = await _sse_server([])
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await run_load(f"http://127.0.0.1:{port}", [{"prompt": "p"}], [0.0], request_timeout_s=0.05)

    (result,) = asyncio.run(scenario())
    assert result.error == "timeout after 0.05 s" and result.ttft_s is None
    assert summarize([result]).errors == 1


def test_stream_completion_asks_for_usage_and_reads_the_cache_hit():
    chunks = [
        {"choices": [{"text": "No", "index": 0}]},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 8}}},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    sent = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, text=body)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await stream_completion(client, "http://127.0.0.1:1", {"prompt": "x"})

    streamed = asyncio.run(scenario())
    assert streamed.text == "No" and streamed.completion_tokens == 7 and 0 <= streamed.ttft_s <= streamed.latency_s
    assert (streamed.prompt_tokens, streamed.cached_tokens) == (10, 8)
    assert sent == [{"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}]


def test_a_stream_without_usage_counts_its_chunks():
    body = "".join(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n" for t in ("Y", "es")) + "data: [DONE]\n\n"

    async def scenario():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_completion(client, "http://127.0.0.1:1", {"prompt": "x"})

    streamed = asyncio.run(scenario())
    assert (streamed.text, streamed.completion_tokens, streamed.prompt_tokens, streamed.cached_tokens) == ("Yes", 2, None, None)


def test_usage_counters_sum_completed_requests_and_need_every_report():
    def result(prompt, cached, error=None):
        return RequestResult(0, 0.0, 0.0, 0.1, 0.2, 1, "", error, prompt, cached)

    assert usage_counters([result(100, 90), result(100, 10), result(None, None, "timeout")]) == CacheCounters(100.0, 200.0)
    assert usage_counters([result(100, 90), result(100, None)]) is None  # one request did not say
    assert usage_counters([result(None, None, "timeout")]) is None
