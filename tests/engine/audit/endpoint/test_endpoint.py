"""The audit on an OpenAI-compatible endpoint, against a fake server that answers with a tiny model's own torch
log-probs (so the endpoint's numbers have a ground truth): the KL estimate within its stated bound of the exact KL,
the in-process verdicts reproduced, retries with backoff (Retry-After honoured), refusals by name, resume without
resending, the bound on requests in flight, sessions kept in order, and the API key never written."""

from __future__ import annotations

import contextlib
import io
import json
import math
import socket

import httpx
import pytest
import torch

from kvscope.engine.audit.ci.report import report_schema
from kvscope.engine.audit.endpoint.answers import Answer, EndpointError, Probe, read_answer
from kvscope.engine.audit.endpoint.client import EndpointClient, EndpointSettings, EndpointUnreachable, retry_after
from kvscope.engine.audit.endpoint.fidelity import compare, estimate_kl
from kvscope.engine.audit.endpoint.served_measure import measure_rewrite_on_endpoint
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.usage import answer_usage, observed_usage
from kvscope.engine.audit.rewrite.measure import measure_rewrite
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.cache.decision import kl_divergence
from kvscope.engine.cli import main
from kvscope.engine.errors import Unreachable
from tests.fake_endpoint import FakeServer, serving
from tests.shared import assert_valid_report

RULES = "Account tier: gold\nAnswer in one short paragraph. Never promise a refund above the tier's limit."
SYSTEM = "You are the support agent of Northwind.\nThe current time is {time}.\n" + RULES
HOISTED = "You are the support agent of Northwind.\n" + RULES
TOKENS = 4


def _request(system: str, question: str, session: str) -> str:
    return json.dumps({"user": session, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})


ORIGINAL = "\n".join(
    [
        _request(SYSTEM.format(time="2026-12-01 09:14"), "Where is my parcel?", "a"),
        _request(SYSTEM.format(time="2026-12-01 09:14"), "Hello?", "b"),
        _request(SYSTEM.format(time="2026-12-01 09:15"), "Can I return the boots?", "a"),
    ]
)
REWRITTEN = "\n".join(
    [
        _request(HOISTED, "Where is my parcel?\n\nThe current time is 2026-12-01 09:14.", "a"),
        _request(HOISTED, "Hello?\n\nThe current time is 2026-12-01 09:14.", "b"),
        _request(HOISTED, "Can I return the boots?\n\nThe current time is 2026-12-01 09:15.", "a"),
    ]
)


def _client(server: FakeServer, tmp_path=None, environ=None, **settings) -> EndpointClient:
    options = {"backoff_s": 0.0, "retries": 3, **settings}
    cache = tmp_path / "answers.jsonl" if tmp_path is not None else None
    return EndpointClient(EndpointSettings("http://fake/v1", cache_path=cache, **options), httpx.MockTransport(server), environ or {})


def _probe(ids: list[int], lane: str | None = None, tokens: int = 2) -> Probe:
    return Probe("/v1/completions", {"prompt": ids, "max_tokens": tokens, "temperature": 0.0, "logprobs": 5}, lane)


# ------------------------------------------------------------------------------------------------- the KL estimate
def _distribution(seed: int, vocab: int = 400, spread: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * spread, -1)


def _top(logprobs: torch.Tensor, k: int) -> dict[int, float]:
    top = logprobs.topk(k)
    return dict(zip(top.indices.tolist(), top.values.tolist()))


def test_the_estimate_is_the_tail_bucketed_kl_a_lower_bound_and_the_exact_kl_lies_within_its_bound():
    checked = 0
    for seed in range(20):
        p = _distribution(seed)
        noise = torch.randn(400, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64) * 0.3
        q = torch.log_softmax(p + noise, -1)  # a repair nudging every logit
        exact = kl_divergence(p, q)
        for k in (5, 20, 50):
            estimate = estimate_kl(_top(p, k), _top(q, k))
            assert estimate.kl <= exact + 1e-9  # the chain rule: coarsening never adds divergence
            assert exact <= estimate.kl + estimate.bound + 1e-9
            shared = [t for t in _top(p, k) if t in _top(q, k)]
            tail_p = 1 - float(p[shared].exp().sum())
            assert estimate.tail_mass == pytest.approx(tail_p, abs=1e-12)
            checked += 1
        full = estimate_kl(_top(p, 400), _top(q, 400))  # the whole vocabulary: exact, nothing to bound
        assert full.kl == pytest.approx(exact, abs=1e-9) and full.bound == 0.0
    assert checked == 60


def test_the_estimate_by_hand():
    """p = (0.5, 0.3 | tail 0.2), q = (0.4, 0.4 | tail 0.2), both lists holding tokens a and b."""
    p, q = {"a": math.log(0.5), "b": math.log(0.3)}, {"a": math.log(0.4), "b": math.log(0.4)}
    estimate = estimate_kl(p, q)
    kl = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)  # the tail bucket: 0.2 log(0.2/0.2) = 0
    most = math.log(0.4 / 0.3)  # the largest |log p/q| the lists show
    assert estimate.kl == pytest.approx(kl, abs=1e-12) and estimate.tail_mass == pytest.approx(0.2)
    assert estimate.bound == pytest.approx(0.2 * (most + math.log(0.2 / 0.2)), abs=1e-12)


# ------------------------------------------------------------------------------------------------------ answers
def test_both_logprob_shapes_are_read_with_the_servers_cache_report():
    legacy = {
        "choices": [
            {"text": " hi", "logprobs": {"tokens": ["token_id:7", " x"], "top_logprobs": [{"token_id:7": -0.1, "token_id:9": -2.5}]}}
        ],
        "usage": {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}},
    }
    answer = read_answer(legacy, "vllm")
    assert answer.top == {7: -0.1, 9: -2.5} and answer.generated == (7, " x") and answer.cached_tokens == 8 and answer.prompt_tokens == 12
    chat = {
        "choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"id": 3, "token": "Yes", "logprob": -0.2, "top_logprobs": [
            {"id": 3, "token": "Yes", "logprob": -0.2}, {"id": 4, "token": "No", "logprob": -1.8}]}]}}],
        "usage": {"prompt_tokens": 5}, "timings": {"cache_n": 4, "prompt_n": 1},
    }  # fmt: skip
    answer = read_answer(chat, "llama-server")
    assert answer.top == {3: -0.2, 4: -1.8} and answer.top1 == 3 and answer.text == "Yes" and answer.cached_tokens == 4
    no_report = read_answer({"choices": [{"text": "", "logprobs": {"content": [{"token": "a", "logprob": 0.0, "top_logprobs": [
        {"token": "a", "logprob": 0.0}]}]}}]}, "openai")  # fmt: skip
    assert no_report.cached_tokens is None and no_report.generated == ("a",)
    # vLLM skips its prefix cache for a request asking prompt log-probs: its count of 0 is not the server's reuse
    with_prompt_logprobs = {**legacy, "prompt_logprobs": [None, {"5": {"logprob": -1.0}}]}
    assert read_answer(with_prompt_logprobs, "probe").cached_tokens is None


def test_answers_and_logs_read_usage_in_one_place():
    # the answer shapes above, through ``usage.answer_usage``: the counters read_answer keeps, and what a log's
    # reader reads of the same usage object (``observed_usage``)
    shapes = [
        ({"usage": {"prompt_tokens": 12, "prompt_tokens_details": {"cached_tokens": 8}}}, (8, 12)),
        ({"usage": {"prompt_tokens": 5}, "timings": {"cache_n": 4, "prompt_n": 1}}, (4, 5)),  # llama-server's chat
        ({}, (None, None)),
        ({"timings": {"cache_n": 3, "prompt_n": 2}}, (3, 5)),  # llama-server's native route: no usage at all
    ]
    logprobs = {"content": [{"token": "a", "logprob": 0.0, "top_logprobs": [{"token": "a", "logprob": 0.0}]}]}
    for data, counts in shapes:
        usage = answer_usage(data)
        assert (usage.cached, usage.prompt) == counts and usage.flags == ()
        answer = read_answer({"choices": [{"text": "", "logprobs": logprobs}], **data}, "probe")
        assert (answer.cached_tokens, answer.prompt_tokens) == counts
        if "usage" in data:
            logged = observed_usage(data["usage"], "openai")
            assert (logged.cached, logged.prompt) == (counts[0] if "prompt_tokens_details" in data["usage"] else None, counts[1])


def test_the_comparison_counts_agreement_as_the_in_process_audit_does():
    a = Answer({1: -0.1, 2: -2.4}, (1, 5, 6, 7), "x", 10, 0)
    b = Answer({2: -0.2, 1: -1.7}, (1, 5, 9, 7), "y", 10, 0)
    measured = compare(a, b)
    assert not measured.fidelity.top1_agree and measured.fidelity.generation_agreement == 0.75
    assert measured.fidelity.generated_common_prefix == 2 and not measured.same_text and measured.top_k == 2


# ---------------------------------------------------------------------------------------------------- the client
def test_429_and_5xx_are_retried_with_backoff_honouring_retry_after(lm):
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    server = FakeServer(lm)
    server.failures = [(429, "2"), (503, None), (502, None)]
    client = _client(server, backoff_s=0.5)
    client.sleep = sleep
    (answer,) = client.answer([_probe([5, 6, 7])])
    assert waits == [2.0, 1.0, 2.0]  # Retry-After, then 0.5 · 2^1 and 0.5 · 2^2
    assert len(server.completions) == 1 and client.sent == 1 and answer.top
    server.failures = [(500, None)] * 4  # one more than the retries
    with pytest.raises(EndpointError, match=r"failed 4 times; the last: HTTP 500"):
        client.answer([_probe([5, 6, 8])])
    server.failures = [(400, None)]
    with pytest.raises(EndpointError, match="HTTP 400"):  # a client error is not retried
        client.answer([_probe([5, 6, 9])])
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0 and retry_after("1.5") == 1.5 and retry_after("soon") is None


def test_a_refused_connection_is_final_at_once_and_names_the_url():
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = EndpointClient(EndpointSettings(f"http://127.0.0.1:{port}/v1"), environ={})
    client.sleep = sleep
    with pytest.raises(EndpointUnreachable, match=rf"nothing answers at http://127.0.0.1:{port} .*start the server there"):
        client.connect()
    assert waits == []  # not retried
    assert isinstance(EndpointUnreachable("x"), Unreachable)  # the app shows it as information, not an error


def test_a_server_without_logprobs_or_serving_another_model_is_refused_by_name(lm):
    with pytest.raises(EndpointError, match="returned no log-probabilities"):
        _client(FakeServer(lm, logprobs=False)).answer([_probe([5, 6])])
    other = FakeServer(lm, model="llama-70b")
    with pytest.raises(EndpointError, match=r"serves llama-70b, not qwen-7b"):
        _client(other, model="qwen-7b").answer([_probe([5, 6])])
    assert other.completions == []  # refused before any completion was sent


def test_an_interrupted_run_resumes_without_resending_any_request(lm, tmp_path):
    probes = [_probe([5, 6, n]) for n in range(10, 16)]
    server = FakeServer(lm)
    server.refuse_after = 4  # the run dies on the fifth request
    with pytest.raises(EndpointError):
        _client(server, tmp_path, concurrency=1).answer(probes)
    assert len(server.completions) == 4
    server.refuse_after = None
    resumed = _client(server, tmp_path).answer(probes)
    assert len(server.completions) == 6 and [body["prompt"][-1] for body in server.completions] == list(range(10, 16))
    again = _client(server, tmp_path)
    assert again.answer(probes) == resumed and again.sent == 0 and len(server.completions) == 6
    twice = _client(FakeServer(lm))
    twice.answer([_probe([5, 6]), _probe([5, 6], lane="b")])
    assert twice.sent == 1  # the same request, asked twice in one run


def test_requests_in_flight_stay_within_the_bound_and_a_sessions_requests_never_overlap(lm):
    server = FakeServer(lm, delay=0.02)
    probes = [_probe([5, n % 7 + 8, n], lane=f"s{n % 5}", tokens=1) for n in range(20)]
    _client(server, concurrency=3).answer(probes)
    assert server.most_in_flight == 3 and not server.lane_overlap
    sent = [(body["prompt"][-1]) for body in server.completions]
    for lane in range(5):  # each session's requests in log order
        own = [n for n in sent if n % 5 == lane]
        assert own == sorted(own)


# ------------------------------------------------------------------------------------------ against the torch audit
def test_a_rewrite_measured_on_the_endpoint_gives_the_in_process_verdicts(lm):
    original, rewritten = read_log(ORIGINAL), read_log(REWRITTEN)
    local = measure_rewrite(lm, original, rewritten, tokens=TOKENS)
    options = {"tokenizer": lm.tokenizer, "settings": ScanSettings(), "tokens": TOKENS, "model": lm.name}
    for k, tight in ((600, True), (20, False)):  # the whole vocabulary, then the top 20 of 600
        measured = measure_rewrite_on_endpoint(_client(FakeServer(lm), top_k=k), original, rewritten, **options)
        for row, mine in zip(local.requests, measured.report.requests):
            assert mine.fidelity.top1_agree == row.fidelity.top1_agree
            assert mine.fidelity.generation_agreement == row.fidelity.generation_agreement
            assert mine.fidelity.generated_common_prefix == row.fidelity.generated_common_prefix
            assert (mine.original_text, mine.rewritten_text) == (row.original_text, row.rewritten_text)
            assert mine.fidelity.kl <= row.fidelity.kl + 1e-5 <= mine.fidelity.kl + mine.kl_bound + 2e-5
            if tight:
                assert mine.fidelity.kl == pytest.approx(row.fidelity.kl, abs=1e-5) and mine.kl_bound == 0.0
        assert measured.report.verdict() == local.verdict()


@pytest.fixture
def http_server(lm):
    """The fake on a real port of 127.0.0.1, as the command line reaches it."""
    fake = FakeServer(lm)
    with serving(fake) as url:
        yield fake, url


def test_the_command_gives_the_fidelity_keys_the_endpoint_top_k_and_the_bound_and_never_the_key(http_server, tmp_path, monkeypatch):
    fake, url = http_server
    (tmp_path / "log.jsonl").write_text(ORIGINAL)
    (tmp_path / "rewritten.jsonl").write_text(REWRITTEN)
    monkeypatch.setenv("KVSCOPE_ENDPOINT_KEY", "sk-never-written-7f3a")
    cache = tmp_path / "answers.jsonl"
    argv = ["audit", str(tmp_path / "log.jsonl"), "--rewritten", str(tmp_path / "rewritten.jsonl"), "--model", "tiny-qwen2"]
    argv += ["--endpoint", url, "--endpoint-cache", str(cache), "--tokens", str(TOKENS), "--grain", "date", "--json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    text = out.getvalue()
    result = json.loads(text)
    assert_valid_report(result)  # every key of the endpoint's turns and rewritten rows, of its type
    assert result["endpoint"]["model"] == "served" and result["endpoint"]["top_k"] == 20 and "kl_bound" in result["endpoint"]
    assert result["endpoint"]["sent_as"].startswith("token ids") and set(result["endpoint"]["not_measurable"]) == {
        "field_only",
        "field_erratum",
    }
    rows, parts = result["rewrite"], report_schema()["$defs"]
    assert len(rows) == 3 and all(set(row) == set(parts["EndpointRewrittenRequest"]["properties"]) for row in rows)
    assert rows[0]["server_cached_tokens_before"] == 0 and rows[0]["simulated_engine"] == "vllm"
    turns = {turn["request"]: turn for turn in result["endpoint"]["turns"]}
    assert sorted(turns) == [2, 3] and turns[3]["matched_request"] == 1  # request 3: session a's clock changed
    erratum = turns[3]["repairs"]["erratum"]
    assert erratum["applicable"] and set(erratum) == set(parts["EndpointFidelity"]["required"])
    assert "already in the last message" in turns[3]["repairs"]["hoist"]["reason"]  # the question changed too
    assert all(header.get("authorization") == "Bearer sk-never-written-7f3a" for header in fake.headers)
    assert "sk-never-written" not in text and "sk-never-written" not in cache.read_text()
    sent = len(fake.completions)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0
    assert len(fake.completions) == sent  # the rerun took every answer from the cache file
