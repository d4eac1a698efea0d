"""The token pass on Ray (a local cluster of 2 CPUs, the tokenizer only) gives the single-process pass's JSON, request
for request: on the bundled logs read as one log of four files, on a generated 50-session log in shards (plain,
gzip'd, and one corrupt file that both passes skip by name), with fleets and the requests the model pass reads; on
every bundled export (observed counts, Langfuse traces in other shards), and on a shuffled log with a flag."""

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.studies.audit_scale import synthetic_log
from engine.audit.audit import MeasureSettings, check_repairs
from engine.audit.caches import CacheSettings
from engine.audit.fleet import fleet_grid
from engine.audit.repairs import REPAIRS
from engine.audit.shards import read_logs
from engine.audit.traffic import TrafficReport, sample_groups, scan_log
from engine.models.tiny import tiny_tokenizer
from tests.engine.audit.test_traffic import QWEN_TEMPLATE

ray = pytest.importorskip("ray")
distributed = pytest.importorskip("engine.audit.distributed")

# the bundled exports' sessions, in time order (tests/engine/audit/test_exports.py)
SESSIONS = ["s-alpha", "s-gamma", "s-alpha", "s-beta", "s-gamma", "s-alpha", "s-beta", "s-gamma", "s-alpha", "s-beta"]
BUNDLED = sorted(Path("demos/logs").glob("*.jsonl")) + [Path("demos/logs/traffic/interleaved_agents.jsonl")]


@pytest.fixture(scope="module")
def cluster():
    distributed.start_ray("local", 2)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def _report(scan) -> dict:
    """The audit's JSON of a token pass (no model pass: --sample 0)."""
    measure = MeasureSettings(check_repairs(REPAIRS))
    return TrafficReport("m", "float32", scan, tuple(sample_groups(scan, 0)), {}, measure, 0).as_dict()


def _same(single, spread, sample: int) -> None:
    assert _report(spread) == _report(single)
    assert spread.diffs == single.diffs
    groups = sample_groups(single, sample)
    assert sample_groups(spread, sample) == groups
    for index in spread.rendered:  # what the model pass reads: the sampled turns, their matches, the cold requests
        assert spread.rendered[index].ids == single.rendered[index].ids
    matched = {row.request: row.matched_request for row in single.requests}
    chosen = {index for group in groups for index in group.measured}
    assert chosen | {matched[i] for i in chosen} <= set(spread.rendered)


def test_ray_gives_the_single_process_json(cluster, tokenizer, tmp_path):
    # the bundled logs, as one log of four files, with fleets
    grid = fleet_grid("2", None)
    single = scan_log(tokenizer, read_logs(BUNDLED), fleet=grid)
    spread = distributed.ray_scan(tokenizer, BUNDLED, fleet=grid, sample=2, workers=2, shard_lines_=3)
    _same(single, spread, 2)
    assert len(spread.fleet) == 4 and spread.fleet == single.fleet

    # a generated 50-session log in shards of 40 lines (so sessions cross shards), under a KV budget
    generated = synthetic_log(160, 50)
    records = [json.dumps(record) for record in generated]
    (tmp_path / "1.jsonl").write_text("\n".join(records[:100]) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "2.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write("\n".join(records[100:]) + "\n")
    broken = gzip.compress(("\n".join(records[:20]) + "\n").encode())
    (tmp_path / "3.jsonl.gz").write_bytes(broken[: len(broken) // 3])
    settings = CacheSettings(budget_tokens=6_000, budget_blocks=300)
    single = scan_log(tokenizer, read_logs([tmp_path]), settings)
    spread = distributed.ray_scan(tokenizer, [tmp_path], settings, sample=3, workers=2, shard_lines_=40)
    _same(single, spread, 3)
    assert len(spread.requests) > 160 and spread.totals()["reused_tokens"]["sglang"] > 0
    assert len({row.session for row in spread.requests}) == len({record["user"] for record in generated})
    assert any(row.matched_request is not None and row.matched_request < row.request - 1 for row in spread.requests)
    (skipped,) = spread.skipped
    assert "(in 3.jsonl.gz)" in skipped.reason and "cannot be read" in skipped.reason and skipped.line >= 1


EXPORTS = sorted(Path("demos/logs/exports").iterdir())


@pytest.mark.parametrize("export", EXPORTS, ids=[path.name for path in EXPORTS])
def test_ray_reads_each_export_as_one_process_does(cluster, tokenizer, export):
    # one record per shard: a Langfuse observation's trace lies in another shard, and exports logged out of time order
    # are put in time order from the count pass; the observed counts and their causes, the hosted caches, equal
    single = scan_log(tokenizer, read_logs([export]), observed_engine="sglang")
    spread = distributed.ray_scan(tokenizer, [export], sample=1, workers=2, shard_lines_=1, observed_engine="sglang")
    _same(single, spread, 1)
    report, plain = _report(spread), export.name == "openai.jsonl"  # the plain log: no counts, no times
    assert report["observed"]["requests_with_count"] == (0 if plain else 8)
    assert report["order"] == ("log" if plain else "timestamps")
    assert [row.session for row in spread.requests] == SESSIONS


def test_ray_reorders_a_shuffled_log_and_keeps_its_flags(cluster, tokenizer, tmp_path):
    records = [json.loads(line) for line in (Path("demos/logs/exports") / "gateway.jsonl").read_text().splitlines()]
    records[2]["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] = -3  # flagged, the request kept
    shuffled = [records[k] for k in (7, 2, 9, 0, 4, 1, 8, 3, 6, 5)]
    path = tmp_path / "shuffled.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in shuffled) + "\n", encoding="utf-8")
    single = scan_log(tokenizer, read_logs([path]))
    spread = distributed.ray_scan(tokenizer, [path], sample=2, workers=2, shard_lines_=3)
    _same(single, spread, 2)
    assert [row.line for row in spread.requests] == [4, 6, 2, 8, 5, 10, 9, 1, 7, 3]  # each line's place in time
    (flag,) = _report(spread)["flagged"]
    assert (flag["request"], flag["line"]) == (3, 2) and "negative" in flag["reason"]
