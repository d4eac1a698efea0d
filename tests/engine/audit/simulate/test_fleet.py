"""Fleets behind each router, against counts worked out by hand on four requests of two sessions (block 4, 2 replicas):

    A1 = 1..9 (session a), B1 = 1 2 3 4 10..14 (session b: the same 4-token head), B2 = B1 + 30 31 32, A2 = A1 + 20 21 22

in the order A1, B1, B2, A2 (42 tokens). Each engine reuses at most all but the last token; vLLM whole blocks of 4."""

import gzip

import numpy as np
import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.fleet import Fleet, FleetError, fleet_grid
from kvscope.engine.audit.simulate.prefix_cache import CacheRequest
from kvscope.engine.models.tiny import tiny_tokenizer

A1 = list(range(1, 10))
B1 = [1, 2, 3, 4, 10, 11, 12, 13, 14]
LOG = [(A1, "a"), (B1, "b"), (B1 + [30, 31, 32], "b"), (A1 + [20, 21, 22], "a")]
SETTINGS = CacheSettings(block=4)

# routing: (replica of each request, sglang, vllm, llama_cpp reuse), by hand:
EXPECTED = {
    # A1->0, B1->1, B2->0 (holds A1: the 4-token head, one block), A2->1 (holds B1: the same); no slot of its session there
    "round_robin": ((0, 1, 0, 1), 4 + 4, 4 + 4, 0),
    # a->0, b->1: B2 and A2 find their own earlier request (9 tokens, 2 whole blocks, the slot's 9 tokens)
    "session": ((0, 1, 1, 0), 9 + 9, 8 + 8, 9 + 9),
    # A1: a tie (nothing cached) -> 0; B1: replica 0 holds its head (4) -> 0; B2 and A2: replica 0 holds 9 of each
    "prefix": ((0, 0, 0, 0), 4 + 9 + 9, 4 + 8 + 8, 9 + 9),
    # load = tokens computed: A1->0 (9), B1->1 (9), B2: tie -> 0 (reuses A1's head: +8), A2 -> 1 (9 < 17; B1's head)
    "least_loaded": ((0, 1, 0, 1), 4 + 4, 4 + 4, 0),
}


@pytest.mark.parametrize("routing", list(EXPECTED))
def test_each_routing_matches_the_hand_count(routing):
    fleet = Fleet(2, routing, SETTINGS)
    replicas = [fleet.insert(CacheRequest(np.array(ids, dtype=np.int32), number, session)) for number, (ids, session) in enumerate(LOG, 1)]
    order, sglang, vllm, llama = EXPECTED[routing]
    result = fleet.result().as_dict()
    assert tuple(replicas) == order
    assert result["reused_tokens"] == {"vllm": vllm, "sglang": sglang, "llama_cpp": llama}
    assert result["tokens"] == 42
    assert result["hit_rate"]["sglang"] == pytest.approx(sglang / 42, abs=1e-4)
    assert result["requests_per_replica"] == [order.count(0), order.count(1)]
    assert (result["replicas"], result["routing"]) == (2, routing)


def test_one_replica_is_the_single_engine_under_every_routing():
    tokenizer = tiny_tokenizer()
    log = read_log(open("demos/logs/traffic/interleaved_agents.jsonl", encoding="utf-8").read())
    grid = fleet_grid("1,3", None)
    scan = scan_log(tokenizer, log, ScanSettings(fleet=grid))
    single = scan.totals().reused_tokens
    assert [(r.replicas, r.routing) for r in scan.fleet] == grid
    for result in scan.fleet:
        assert result.tokens == scan.totals().tokens
        if result.replicas == 1:
            assert result.reused_tokens == single
        else:
            assert all(result.reused_tokens[e] <= single[e] for e in single)  # a fleet never reuses more than one shared server
            assert sum(result.requests_per_replica) == len(scan.requests)


def test_bad_fleets_are_refused_by_name():
    with pytest.raises(FleetError, match="--routing 'random'"):
        fleet_grid("2", "session,random")
    with pytest.raises(FleetError, match="at least 1"):
        fleet_grid("0", None)
    with pytest.raises(FleetError, match="replica counts"):
        fleet_grid("two", None)
    assert fleet_grid("2,4", "prefix") == [(2, "prefix"), (4, "prefix")]


def test_the_cli_reads_many_files_and_reports_the_fleets(tmp_path):
    from tests.engine.test_cli import run_cli
    from tests.shared import assert_valid_report

    lines = open("demos/logs/traffic/interleaved_agents.jsonl", encoding="utf-8").read().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:3]) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write("\n".join(lines[3:]) + "\n")
    args = ("--model", "tiny-qwen2", "--sample", "0")
    code, whole = run_cli("audit", "demos/logs/traffic/interleaved_agents.jsonl", *args, "--replicas", "1,2", "--routing", "session,prefix")
    assert_valid_report(whole)
    assert code == 0 and [(f["replicas"], f["routing"]) for f in whole["fleet"]] == [
        (1, "session"),
        (1, "prefix"),
        (2, "session"),
        (2, "prefix"),
    ]
    assert whole["fleet"][0]["reused_tokens"] == whole["engines"]["reused_tokens"]
    code, shards = run_cli("audit", str(tmp_path), *args)
    assert code == 0 and "fleet" not in shards
    assert [row["tokens"] for row in shards["requests"]] == [row["tokens"] for row in whole["requests"]]
    assert shards["engines"] == whole["engines"]
    code, error = run_cli("audit", str(tmp_path), *args, "--routing", "prefix")
    assert code == 2 and "add --replicas" in error["error"]
