"""The token pass on Ray (a local cluster of 2 CPUs, the tokenizer only) gives the single-process pass's JSON, request
for request: on the bundled logs read as one log of four files, and on a generated 50-session log in shards (plain,
gzip'd, and one corrupt file that both passes skip by name), with fleets and the requests the model pass reads."""

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
