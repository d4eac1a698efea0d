"""Observed cached tokens beside the simulation: shortfalls and excesses found exactly where a test put them, the
evidence each names, the per-log hit rates and equal share against counts written by hand, null counts never read as
zero, the hosted providers' caches against hand-computed reuse, and --fit-observed recovering the block size and
budget that generated the observed counts."""

import dataclasses
import json

import numpy as np
import pytest

from kvscope.engine.audit.changes.causes import Cause
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficRequest, TrafficScan, scan_log
from kvscope.engine.audit.simulate.caches import BlockCache
from kvscope.engine.audit.simulate.hosted import AnthropicCache, HostedRequest, OpenAICache, anthropic_minimum, openai_steps, provider_of
from kvscope.engine.audit.simulate.observed import fit_observed, hosted_summary, observed_summary
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.audit.simulate.radix import RadixCache, RadixTree
from kvscope.engine.models import load_model
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE, _chat, _interleaved
from tests.engine.test_cli import run_cli
from tests.shared import assert_valid_report


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def _observed(log: RequestLog, counts: dict[int, int | None], **values) -> RequestLog:
    """``log`` with request index -> observed cached tokens set (others left None), and any other Request fields."""
    requests = tuple(
        dataclasses.replace(r, observed_cached_tokens=counts.get(r.index), **{k: v[r.index] for k, v in values.items() if r.index in v})
        for r in log.requests
    )
    return dataclasses.replace(log, requests=requests)


def _named(scan: TrafficScan, name: str) -> dict[int, int]:
    return {row.request: cause.tokens for row in scan.requests for cause in row.causes if cause.name == name}


def test_shortfalls_and_excesses_are_found_exactly_where_put_and_nowhere_else(tokenizer):
    log = read_log(_interleaved())
    simulated = {row.request: row.reused_tokens["vllm"] for row in scan_log(tokenizer, log).requests}
    assert simulated[6] == 64 and simulated[10] == 48 and simulated[15] > 0
    counts: dict[int, int | None] = dict(simulated)
    counts |= {6: 48, 10: 0, 15: simulated[15] + 5}  # two shortfalls (16 and 48 tokens), one excess (5)
    counts |= {3: None, 8: None}  # not reported: never compared
    scan = scan_log(tokenizer, _observed(log, counts))
    assert _named(scan, "observed_shortfall") == {6: 16, 10: 48}
    assert _named(scan, "observed_excess") == {15: 5}
    assert [row.observed_cached_tokens for row in scan.requests if row.request in (3, 8)] == [None, None]
    summary = observed_summary(scan.requests, "vllm").as_dict()
    assert (summary["requests_with_count"], summary["requests_without_count"], summary["equal"]) == (38, 2, 35)
    assert summary["equal_share"] == pytest.approx(35 / 38, abs=1e-4)
    assert summary["shortfalls"] == {"requests": 2, "tokens": 64} and summary["excesses"] == {"requests": 1, "tokens": 5}
    # the same log compared with SGLang: its own simulated counts are the ground truth there
    sglang = {row.request: row.reused_tokens["sglang"] for row in scan.requests}
    against = scan_log(tokenizer, _observed(log, sglang), ScanSettings(observed_engine="sglang"))
    assert not _named(against, "observed_shortfall") and not _named(against, "observed_excess")
    assert observed_summary(against.requests, "sglang").as_dict()["equal_share"] == 1.0


def _row(index: int, tokens: int, reused: tuple[int, int, int], observed: int | None, causes=()) -> TrafficRequest:
    engines = dict(zip(("vllm", "sglang", "llama_cpp"), reused))
    return TrafficRequest(
        request=index,
        line=index,
        session="s",
        tokens=tokens,
        matched_request=None,
        common_prefix_tokens=0,
        appended_tokens=0,
        fields=(),
        causes=causes,
        reused_tokens=engines,
        signature="",
        observed_cached_tokens=observed,
    )


def test_hit_rates_and_equal_share_against_counts_written_by_hand():
    gap = (Cause("observed_shortfall", "", 32),)
    rows = (
        _row(1, 100, (0, 0, 0), 0),
        _row(2, 200, (96, 120, 100), 64, gap),
        _row(3, 300, (288, 290, 290), 288),
        _row(4, 400, (384, 399, 399), None),  # not reported: out of every rate, not a zero
    )
    summary = observed_summary(rows, "vllm").as_dict()
    # over requests 1-3 (600 tokens): observed 0 + 64 + 288 = 352; vLLM 384; SGLang 410; llama.cpp 390
    assert summary["hit_rate"] == {"observed": round(352 / 600, 4), "vllm": 0.64, "sglang": round(410 / 600, 4), "llama_cpp": 0.65}
    assert (summary["requests_with_count"], summary["requests_without_count"], summary["equal"]) == (3, 1, 2)
    assert summary["equal_share"] == round(2 / 3, 4)
    assert summary["shortfalls"] == {"requests": 1, "tokens": 32}
    silent = observed_summary(rows[3:], "vllm").as_dict()
    assert silent["hit_rate"]["observed"] is None and silent["equal_share"] is None and silent["requests_with_count"] == 0


def test_each_gap_names_the_evidence_the_log_holds(tokenizer):
    system = "You are the help desk.\nPolicy: refunds within 30 days, exchanges within 60 days.\nBe brief and exact."
    lines = [
        _chat(system, ("user", "Where is my parcel?"), session="a"),  # 1
        _chat(system, ("user", "Where is my parcel?"), ("assistant", "On its way."), ("user", "When?"), session="a"),  # 2: TTL
        _chat(system, ("user", "Can I return shoes bought in May?"), session="b"),  # 3: matched in session a: a replica
        _chat(
            system,
            ("user", "Where is my parcel?"),
            ("assistant", "On its way."),
            ("user", "When?"),
            ("assistant", "Soon."),
            ("user", "Thanks"),
            session="a",
        ),  # 4: more cached than simulated
    ]
    log = read_log("\n".join(lines))
    first = {row.request: row for row in scan_log(tokenizer, log).requests}
    assert first[3].matched_request in (1, 2) and first[4].matched_request == 2
    usable = min(first[4].common_prefix_tokens, first[4].tokens - 1)
    assert usable % 16 > 3
    counts = {1: 0, 2: 0, 3: 0, 4: first[4].reused_tokens["vllm"] + 3}
    times = {1: 1_000.0, 2: 1_000.0 + 3_600, 3: 1_000.0 + 3_601, 4: 1_000.0 + 3_602}
    scan = scan_log(tokenizer, _observed(log, counts, timestamp=times))
    causes = {row.request: [c for c in row.causes if c.name.startswith("observed_")] for row in scan.requests}
    assert causes[1] == []  # a cold prefill: observed 0 equals the simulation
    assert [c.name for c in causes[2]] == ["observed_shortfall"] and "a time-to-live: 3,600 s since the matched request 1" in causes[2][
        0
    ].detail
    assert "another replica: the matched request" in causes[3][0].detail and "time-to-live" not in causes[3][0].detail
    assert [c.name for c in causes[4]] == ["observed_excess"] and causes[4][0].tokens == 3
    assert f"a smaller block: {counts[4]:,} of the {usable:,} shared tokens" in causes[4][0].detail
    # more cached than any earlier request of the log shares: another tokenizer, or requests the log does not hold
    cold = scan_log(tokenizer, _observed(log, {1: 10})).requests[0]
    assert [(c.name, c.tokens) for c in cold.causes] == [("new_prefix", cold.tokens), ("observed_excess", 10)]
    assert "more than the 0 tokens any earlier prompt of the log shares with it" in cold.causes[1].detail
    with pytest.raises(RequestLogError, match="observed counts are compared with one of vllm, sglang, llama_cpp, got 'tgi'"):
        scan_log(tokenizer, log, ScanSettings(observed_engine="tgi"))
    # a shortfall that is the shared prefix in whole 64-token blocks (and 32-token ones: the smallest is named), on a log
    # naming a hosted model
    whole = first[4].reused_tokens["vllm"] // 64 * 64
    assert first[4].reused_tokens["vllm"] != whole and usable // 64 * 64 == whole
    named = scan_log(tokenizer, _observed(log, {4: whole}, model={4: "gpt-4o"}), model="tiny").requests[3]
    detail = next(c.detail for c in named.causes if c.name == "observed_shortfall")
    assert usable // 32 * 32 == whole
    assert f"another block size: {whole:,} is the {usable:,} shared tokens in whole 32-token blocks" in detail
    assert "a tokenizer that is not the served model's: the log names gpt-4o, the audit counts tiny's tokens" in detail


def test_providers_and_minimums_are_read_from_model_names():
    assert [provider_of(m) for m in ("gpt-4o", "o3-mini", "o1", "chatgpt-4o-latest", "openai/gpt-4.1", "claude-sonnet-4-5")] == [
        "openai",
        "openai",
        "openai",
        "openai",
        "openai",
        "anthropic",
    ]
    assert [provider_of(m) for m in ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "llama-3", None, "")] == [None] * 4
    assert [
        anthropic_minimum(m)
        for m in ("claude-sonnet-4-5", "claude-opus-4-1", "claude-3-5-haiku-20241022", "claude-haiku-4-5", "claude-opus-4-6")
    ] == [1024, 1024, 2048, 4096, 4096]


def _ids(*parts) -> np.ndarray:
    return np.concatenate([np.asarray(part, dtype=np.int32) for part in parts])


def test_openai_caches_prompts_of_1024_tokens_and_more_in_128_token_steps():
    assert [openai_steps(n) for n in (0, 1023, 1024, 1151, 1152, 1279, 1280)] == [0, 0, 1024, 1024, 1152, 1152, 1280]
    base, other = np.arange(2_000), np.arange(50_000, 50_400)
    cache = OpenAICache()
    prompts = [
        base[:1300],  # cold
        _ids(base[:1100], other[:100]),  # shares 1,100: 1,024
        _ids(base[:1151], other[200:300]),  # shares 1,151: 1,024
        _ids(base[:1152], other[300:400]),  # shares 1,152: 1,152
        _ids(base[:1000], other[:100] + 7),  # shares 1,000: under 1,024, nothing
        base[:1300],  # identical: all but its last token (1,299): 1,280
    ]
    requests = [CacheRequest(ids, n, hosted=HostedRequest("openai", n)) for n, ids in enumerate(prompts, 1)]
    assert [cache.insert(request) for request in requests] == [0, 1024, 1024, 1152, 0, 1280]


def _anthropic(cache, ids, mark, ends, minimum, timestamp):
    """The tokens ``cache`` reads of ``ids`` with one breakpoint at ``mark`` (``ends``: the block boundaries)."""
    return cache.insert(CacheRequest(ids, 0, hosted=HostedRequest("anthropic", 0, (mark,), tuple(ends), minimum, timestamp)))


def test_anthropic_reads_at_breakpoints_with_a_20_block_lookback_and_a_5_minute_ttl():
    ids, ends = np.arange(3_000), [500, 1000, 1500, 2000, 2500]
    cache = AnthropicCache()
    assert _anthropic(cache, ids, 1500, ends, 1024, 0.0) == 0  # written up to 1,500
    assert _anthropic(cache, ids, 2000, ends, 1024, 100.0) == 1500  # found one block back; 2,000 written
    assert _anthropic(cache, ids, 2000, ends, 1024, 400.0) == 2000  # exactly 5 minutes after its last use: alive, refreshed
    assert _anthropic(cache, ids, 2000, ends, 1024, 701.0) == 0  # 5 minutes and 1 second: both expired
    changed = ids.copy()
    changed[10] = -1
    assert _anthropic(cache, changed, 2000, ends, 1024, 702.0) == 0  # another prefix
    short = AnthropicCache()
    assert [_anthropic(short, ids, 1000, ends, 1024, t) for t in (0.0, 1.0)] == [0, 0]  # under the minimum: never cached
    assert [_anthropic(short, ids, 1000, ends, 512, t) for t in (2.0, 3.0)] == [0, 1000]
    fine = list(range(1100, 1400, 10))  # a block every 10 tokens
    lookback = AnthropicCache()
    assert _anthropic(lookback, ids, 1100, fine, 1024, None) == 0
    assert _anthropic(lookback, ids, 1300, fine, 1024, None) == 1100  # 20 blocks back reaches 1,100
    far = AnthropicCache()
    _anthropic(far, ids, 1100, fine, 1024, None)
    assert _anthropic(far, ids, 1310, fine, 1024, None) == 0  # 21 blocks back: out of the lookback


def test_a_log_to_a_hosted_api_gets_its_providers_engine(tokenizer):
    system = "Policy line that is long enough to matter. " * 120
    record = {
        "model": "claude-sonnet-4-5",
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Where is my parcel?"}],
    }
    later = json.loads(json.dumps(record))
    later["messages"][0]["content"] = "Can I return it?"
    log = read_log("\n".join(json.dumps(r) for r in (record, later, later)))
    models = {1: "claude-sonnet-4-5", 2: "claude-sonnet-4-5", 3: "gpt-4o"}
    scan = scan_log(tokenizer, _observed(log, {}, model=models, timestamp={1: 0.0, 2: 60.0, 3: 61.0}))
    mark = scan.requests[0].breakpoints[0].token
    assert mark >= 1024 and scan.requests[1].breakpoints[0].token == mark
    assert [row.hosted_reused_tokens for row in scan.requests] == [{"anthropic": 0}, {"anthropic": mark}, {"openai": 0}]
    tokens = [row.tokens for row in scan.requests]
    hosted = hosted_summary(scan.requests)
    assert hosted["anthropic"].as_dict() | {"rule": ""} == {
        "rule": "",
        "requests": 2,
        "tokens": tokens[0] + tokens[1],
        "reused_tokens": mark,
        "hit_rate": round(mark / (tokens[0] + tokens[1]), 4),
    }
    assert hosted["openai"].requests == 1 and hosted["openai"].reused_tokens == 0 and "not the provider's" in hosted["note"]
    assert scan.requests[1].as_dict()["hosted_reused_tokens"] == {"anthropic": mark}
    # five minutes and a second later the system prompt's cache has expired
    late = scan_log(tokenizer, _observed(log, {}, model=models, timestamp={1: 0.0, 2: 301.0, 3: 302.0}))
    assert [row.hosted_reused_tokens for row in late.requests][:2] == [{"anthropic": 0}, {"anthropic": 0}]


def test_fit_observed_recovers_the_block_size_and_budget_that_made_the_counts(tokenizer):
    log = read_log(_interleaved(seed=3, sessions=8, requests=80))
    scan = scan_log(tokenizer, log)
    radix = RadixTree()
    for time, row in enumerate(scan.requests, 1):
        radix.insert(scan.held(row.request), row.request, None, time)
    working = radix.tokens  # an unbounded token cache's size after the log: the distinct prefixes
    for block, budget in ((32, working // 4), (64, working // 2)):
        server = BlockCache(block, budget // block)
        counts = {
            row.request: server.insert(CacheRequest(scan.rendered[row.request].token_ids, row.request, held=scan.held(row.request)))
            for row in scan.requests
        }
        counts[5] = None  # one request without a count
        observed = scan_log(tokenizer, _observed(log, counts))
        fit = fit_observed(observed.requests, observed.held).as_dict()
        assert fit["working_set_tokens"] == working
        assert fit["best"] == {"block": block, "budget_tokens": budget, "matches": 79, "share": 1.0}
        assert fit["tied"] == [{"block": block, "budget_tokens": budget, "matches": 79}]
        assert len(fit["tried"]) == 6 * 6


def test_fit_observed_recovers_sglangs_page_size_and_budget(tokenizer):
    log = read_log(_interleaved(seed=5, sessions=6, requests=60))
    scan = scan_log(tokenizer, log)
    working = fit_observed(_observed_rows(scan, {}), scan.held, "sglang").working_set_tokens
    server = RadixCache(working // 4, page=16)
    counts = {
        row.request: server.insert(
            CacheRequest(scan.rendered[row.request].token_ids, row.request, row.session, n, held=scan.held(row.request))
        )
        for n, row in enumerate(scan.requests, 1)
    }
    fit = fit_observed(_observed_rows(scan, counts), scan.held, "sglang").as_dict()
    assert fit["engine"] == "sglang" and len(fit["tried"]) == 4 * 6
    assert {"page": 16, "budget_tokens": working // 4, "matches": 60} in fit["tied"] and fit["best"]["share"] == 1.0


def _observed_rows(scan: TrafficScan, counts: dict[int, int]) -> list[TrafficRequest]:
    """The scan's rows with these observed counts (every other request: 0)."""
    return [dataclasses.replace(row, observed_cached_tokens=counts.get(row.request, 0)) for row in scan.requests]


def gateway_log(counts: list[int | None], sessions: int = 1) -> str:
    """A gateway log (request, response with OpenAI usage, timestamp a minute apart) of ``sessions`` help-desk
    sessions, interleaved, each growing turn by turn; request k reports ``counts[k - 1]`` cached tokens (None: no
    count in its usage)."""
    system = "You are the help desk.\nPolicy: refunds within 30 days, exchanges within 60 days.\nBe brief and exact."
    lines, history = [], {}
    for number, cached in enumerate(counts, 1):
        session = f"s{(number - 1) % sessions + 1}"
        messages = [*history.get(session, [{"role": "system", "content": system}])]
        messages.append({"role": "user", "content": f"Question {number}: where is parcel {number}?"})
        usage = {"prompt_tokens": 500} | ({} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}})
        request = {"model": "Qwen/Qwen2.5-0.5B-Instruct", "messages": messages, "user": session}
        lines.append(json.dumps({"request": request, "response": {"usage": usage}, "timestamp": 1_764_000_000 + 60 * number}))
        history[session] = [*messages, {"role": "assistant", "content": f"Parcel {number} is on its way."}]
    return "\n".join(lines)


def test_the_cli_compares_a_gateway_logs_observed_counts_and_fits_them(tmp_path):
    counts = [0, 0, None, 0]
    text = gateway_log(counts)
    if all(request.observed_cached_tokens is None for request in read_log(text).requests):
        pytest.skip("read_log does not yet read a gateway record's response usage (the exports readers fill it)")
    path = tmp_path / "gateway.jsonl"
    path.write_text(text)
    lm = load_model("tiny-qwen2")
    simulated = {row.request: row.reused_tokens["sglang"] for row in scan_log(lm.tokenizer, read_log(text)).requests}
    code, audit = run_cli("audit", str(path), "--model", "tiny-qwen2", "--sample", "0", "--observed-engine", "sglang", "--fit-observed")
    assert_valid_report(audit)
    assert code == 0
    assert [row["observed_cached_tokens"] for row in audit["requests"]] == counts
    short = {row["request"]: c["tokens"] for row in audit["requests"] for c in row["causes"] if c["name"] == "observed_shortfall"}
    assert short == {index: simulated[index] for index in (1, 2, 4) if simulated[index] > 0} and len(short) == 2
    observed = audit["observed"]
    assert (observed["engine"], observed["requests_with_count"], observed["requests_without_count"]) == ("sglang", 3, 1)
    assert observed["hit_rate"]["observed"] == 0.0 and observed["equal"] == 1  # the cold first request
    assert observed["fit"]["requests_with_count"] == 3 and observed["fit"]["best"]["matches"] >= 1


def test_fit_observed_refuses_a_log_without_observed_counts_and_ray(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(_chat("You are brief.", ("user", "Hi")))
    code, result = run_cli("audit", str(path), "--model", "tiny-qwen2", "--sample", "0", "--fit-observed")
    assert code == 2 and "no request of the log reports a cached count" in result["error"]
    # under --ray the driver never holds the log's tokens: refused by name, before any Ray starts
    code, result = run_cli("audit", str(path), "--model", "tiny-qwen2", "--sample", "0", "--fit-observed", "--ray")
    assert code == 2 and "--fit-observed" in result["error"] and "drop --ray" in result["error"]
