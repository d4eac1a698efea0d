"""The audit on Ray (a local cluster of 2 CPUs). The token pass (the tokenizer only) gives the single-process pass's
JSON, request for request: on the bundled logs read as one log of four files, on a generated 50-session log in shards
(plain, gzip'd, and one corrupt file that both passes skip by name), with fleets and the requests the model pass reads;
on every bundled export (observed counts, Langfuse traces in other shards), and on a shuffled log with a flag. The
model pass on Ray actors (a tiny model each) gives the in-process turns, its lanes keep a conversation on one actor,
and a model built in memory is refused; with --endpoint, --ray and --replicas give the one-process JSON. Every
server of the local cluster listens on loopback only."""

import contextlib
import functools
import gzip
import io
import ipaddress
import json
import os
import subprocess
import sys
import unittest.mock
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from benchmarks.studies.audit_scale import synthetic_log
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.shards import LogFiles
from kvscope.engine.audit.measure.settings import MeasureSettings, check_repairs, measure_settings
from kvscope.engine.audit.measure.traffic import TrafficReport, audit_traffic, turn_work
from kvscope.engine.audit.prompts.repair_requests import REPAIRS
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import sample_groups, scan_log
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.fleet import fleet_grid
from kvscope.engine.cli import main
from kvscope.engine.cli.parser import build_parser
from kvscope.engine.cli.scale import turn_pass
from kvscope.engine.models import ModelLoadError
from kvscope.engine.models.tiny import tiny_model, tiny_tokenizer
from tests.engine.audit.endpoint.test_endpoint import ORIGINAL
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE
from tests.fake_endpoint import FakeServer, serving

ray = pytest.importorskip("ray")
distributed = pytest.importorskip("kvscope.engine.audit.distributed.ray_scan")
ray_setup = pytest.importorskip("kvscope.engine.audit.distributed.ray_setup")
ray_turns = pytest.importorskip("kvscope.engine.audit.distributed.turns")

# the bundled exports' sessions, in time order (tests/engine/audit/logs/test_exports.py)
SESSIONS = ["s-alpha", "s-gamma", "s-alpha", "s-beta", "s-gamma", "s-alpha", "s-beta", "s-gamma", "s-alpha", "s-beta"]
INTERLEAVED = Path("demos/logs/traffic/interleaved_agents.jsonl")  # two sessions, their system prompts sharing a head
BUNDLED = sorted(Path("demos/logs").glob("*.jsonl")) + [INTERLEAVED]
TIMED = {"ttft_ms", "full_ttft_ms", "ttft_ratio"}  # each process's own clock


@pytest.fixture(scope="module")
def cluster():
    ray_setup.start_ray("local", 2)
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
    assert spread.cache_tokens == single.cache_tokens and single.cache_tokens  # what each engine's cache held at the end
    groups = sample_groups(single, sample)
    assert sample_groups(spread, sample) == groups
    # every diff's match and kind; the diffs themselves where the model pass reads them (computed from the rendered)
    assert set(spread.diffs) == set(single.diffs) and all(spread.diffs.flat(i) == single.diffs.flat(i) for i in single.diffs)
    chosen = {index for group in groups for index in group.measured}
    assert chosen and all(spread.diffs[i] == single.diffs[i] for i in chosen)
    for index in spread.rendered:  # what the model pass reads: the sampled turns, their matches, the cold requests
        assert spread.rendered[index].ids == single.rendered[index].ids
    matched = {row.request: row.matched_request for row in single.requests}
    assert chosen | {matched[i] for i in chosen} <= set(spread.rendered)


def test_ray_gives_the_single_process_json(cluster, tokenizer, tmp_path):
    # the bundled logs, as one log of four files, with fleets
    grid = fleet_grid("2", None)
    files = LogFiles.of(BUNDLED)  # the one log both passes take: read here, or planned into shards for Ray
    single = scan_log(tokenizer, files.log, ScanSettings(fleet=grid))
    spread = distributed.ray_scan(tokenizer, files, ScanSettings(fleet=grid), sample=2, workers=2, shard_lines_=3)
    _same(single, spread, 2)
    assert len(spread.fleet) == 4 and spread.fleet == single.fleet

    # a generated 50-session log in shards of 40 lines (so sessions cross shards), under a KV budget
    generated = synthetic_log(160, 50)
    records = [json.dumps(record) for record in generated]
    (tmp_path / "1.jsonl").write_text("\n".join([*records[:60], "{broken", *records[60:100]]) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "2.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write("\n".join(records[100:]) + "\n")
    broken = gzip.compress(("\n".join(records[:20]) + "\n").encode())
    (tmp_path / "3.jsonl.gz").write_bytes(broken[: len(broken) // 3])
    settings = ScanSettings(CacheSettings(budget_tokens=6_000, budget_blocks=300))
    files = LogFiles.of([tmp_path])
    single = scan_log(tokenizer, files.log, settings)
    spread = distributed.ray_scan(tokenizer, files, settings, sample=3, workers=2, shard_lines_=40)
    _same(single, spread, 3)
    assert len(spread.requests) > 160 and spread.totals().reused_tokens["sglang"] > 0
    assert len({row.session for row in spread.requests}) == len({record["user"] for record in generated})
    assert any(row.matched_request is not None and row.matched_request < row.request - 1 for row in spread.requests)
    unparsed, corrupt = spread.skipped  # in the order read: file by file, line by line
    assert unparsed.line == 61 and "is not JSON" in unparsed.reason and "(in 1.jsonl)" in unparsed.reason
    assert "(in 3.jsonl.gz)" in corrupt.reason and "cannot be read" in corrupt.reason and corrupt.line >= 1


EXPORTS = sorted(path for path in Path("demos/logs/exports").iterdir() if path.is_file())  # the clients/ folder is its own test


def test_ray_reads_the_exports_as_one_process_does(cluster, tokenizer):
    # the 8 bundled exports as one log, one record per shard: a Langfuse observation's trace lies in another shard, the
    # observed counts and their causes and the hosted caches are compared on the driver (openai.jsonl has no times, so
    # the log keeps its files' order; the shuffled log below is put in time order)
    files = LogFiles.of(EXPORTS)
    single = scan_log(tokenizer, files.log, ScanSettings(observed_engine="sglang"))
    spread = distributed.ray_scan(tokenizer, files, ScanSettings(observed_engine="sglang"), sample=1, workers=2, shard_lines_=1)
    _same(single, spread, 1)
    report = _report(spread)
    assert report["observed"]["requests_with_count"] == 7 * 8 and len(spread.requests) == 8 * 10
    sessions = [row.session for row in spread.requests]  # each export's, as its trace records name them (no trace ids)
    assert all(sorted(sessions[k : k + 10]) == sorted(SESSIONS) for k in range(0, 80, 10))


def test_ray_reorders_a_shuffled_log_and_keeps_its_flags(cluster, tokenizer, tmp_path):
    records = [json.loads(line) for line in (Path("demos/logs/exports") / "gateway.jsonl").read_text().splitlines()]
    records[2]["response"]["usage"]["prompt_tokens_details"]["cached_tokens"] = -3  # flagged, the request kept
    shuffled = [records[k] for k in (7, 2, 9, 0, 4, 1, 8, 3, 6, 5)]
    path = tmp_path / "shuffled.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in shuffled) + "\n", encoding="utf-8")
    files = LogFiles.of([path])  # one plain file: read here as its text
    single = scan_log(tokenizer, files.log)
    spread = distributed.ray_scan(tokenizer, files, sample=2, workers=2, shard_lines_=3)
    _same(single, spread, 2)
    assert [row.line for row in spread.requests] == [4, 6, 2, 8, 5, 10, 9, 1, 7, 3]  # each line's place in time
    (flag,) = _report(spread)["flagged"]
    assert (flag["request"], flag["line"]) == (3, 2) and "negative" in flag["reason"]


def _audit(argv: list[str]) -> dict:
    """``audit ARGV --json``'s result, run in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["audit", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def _close(mine, theirs, where: str = "") -> None:
    """The same JSON, floats within 1e-4, timings skipped (and of a recommendation, whose words and KV alternative
    read the timings, its repair only)."""
    if isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), where
        if "repair" in mine and "kv_alternative" in mine:
            assert mine["repair"] == theirs["repair"], where
            return
        for key in mine.keys() - TIMED:
            _close(mine[key], theirs[key], f"{where}.{key}")
    elif isinstance(mine, list):
        assert len(mine) == len(theirs), where
        for n, (a, b) in enumerate(zip(mine, theirs)):
            _close(a, b, f"{where}[{n}]")
    elif isinstance(mine, float):
        assert mine == pytest.approx(theirs, abs=1e-4), where
    else:
        assert mine == theirs, where


def test_the_sampled_turns_measured_by_ray_actors_are_the_in_process_ones(cluster, lm):
    log = read_log(INTERLEAVED.read_text())
    single = audit_traffic(lm, log, sample=2, measure=measure_settings(tokens=4))
    ticks = []
    spec = ray_turns.ModelSpec.of("tiny-qwen2", lm)  # what the actors load: the conftest's tiny model, float32, CPU
    spread = audit_traffic(
        lm,
        log,
        sample=2,
        measure=measure_settings(tokens=4),
        progress=lambda *step: ticks.append(step),
        measure_turns=functools.partial(ray_turns.ray_measure_turns, spec, 2),
    )
    assert sorted(single.turns) == sorted(spread.turns) == [3, 4, 5, 6]
    assert ticks[-1] == (4 * 7, 4 * 7) and len(ticks) == 4 * 7 + 1  # recompute's reference and six repairs per turn
    _close(spread.as_dict(), single.as_dict())


def test_the_command_gives_the_actors_the_model_as_it_loaded_it(lm):
    args = build_parser().parse_args(["audit", "log.jsonl", "--model", "tiny-qwen2", "--ray", "--workers", "3"])
    with unittest.mock.patch("kvscope.engine.audit.distributed.ray_setup.start_ray") as start:
        measure = turn_pass(args, lm)
    start.assert_called_once_with("local", 3)
    assert measure.func is ray_turns.ray_measure_turns
    assert measure.args == (ray_turns.ModelSpec("tiny-qwen2", "cpu", "float32", lm.fingerprint), 3)
    assert turn_pass(build_parser().parse_args(["audit", "log.jsonl", "--ray", "--sample", "0"]), lm) is None


def test_lanes_keep_a_conversation_on_one_actor_and_balance_the_tokens(lm):
    records = [json.loads(line) for line in INTERLEAVED.read_text().splitlines()]
    with_sessions = read_log("\n".join(map(json.dumps, records)))
    without = read_log("\n".join(json.dumps({k: v for k, v in r.items() if k != "session_id"}) for r in records))
    for text, lanes in ((with_sessions, ["forge-1", "harbor-7", "forge-1", "harbor-7"]), (without, [1, 2, 1, 2])):
        scan = scan_log(lm.tokenizer, text)
        chosen = sorted(index for group in sample_groups(scan, 2) for index in group.measured)
        work = turn_work(scan, chosen)
        assert [item.request for item in work] == [3, 4, 5, 6] and [item.lane for item in work] == lanes
        (first,), (second,) = ray_turns.assign_lanes(work, 2)  # one conversation per actor, its turns in order
        assert {tuple(t.request for t in first), tuple(t.request for t in second)} == {(3, 5), (4, 6)}
        heavier = max((3, 5), (4, 6), key=lambda pair: sum(len(scan.rendered[i]) for i in pair))
        assert tuple(t.request for t in first) == heavier  # the most tokens go first, to actor 0
        assert [len(share) for share in ray_turns.assign_lanes(work, 3)] == [1, 1, 0]
        assert [[t.request for t in lane] for lane in ray_turns.assign_lanes(work, 1)[0]] == [[3, 5], [4, 6]]


def test_a_model_built_in_memory_or_one_the_actors_cannot_load_is_refused_by_name(cluster, tmp_path):
    other = tiny_model("qwen2", seed=1)  # what the actors load as "tiny-qwen2" has seed 0: other weights
    measure = functools.partial(ray_turns.ray_measure_turns, ray_turns.ModelSpec.of("tiny-qwen2", other), 1)
    log = read_log(INTERLEAVED.read_text())
    with pytest.raises(ModelLoadError, match="a model built in memory cannot be re-loaded by name"):
        audit_traffic(other, log, sample=1, measure=measure_settings(tokens=2), measure_turns=measure)
    spec = ray_turns.ModelSpec(str(tmp_path / "gone"), "cpu", "float32", other.fingerprint)  # a directory the node lacks
    measure = functools.partial(ray_turns.ray_measure_turns, spec, 1)
    with pytest.raises(ModelLoadError, match=r"a Ray actor could not load '.*gone'.*no such directory"):
        audit_traffic(other, log, sample=1, measure=measure_settings(tokens=2), measure_turns=measure)


def test_ray_and_replicas_with_an_endpoint_give_the_one_process_json(cluster, lm, tmp_path):
    (tmp_path / "log.jsonl").write_text(ORIGINAL)
    with serving(FakeServer(lm)) as url:
        argv = [str(tmp_path / "log.jsonl"), "--model", "tiny-qwen2", "--endpoint", url, "--tokens", "4", "--replicas", "2"]
        single, spread = _audit(argv), _audit([*argv, "--ray", "local", "--workers", "2"])
    assert spread == single
    assert [turn["request"] for turn in single["endpoint"]["turns"]] == [2, 3] and len(single["fleet"]) == 4


def test_the_token_pass_workers_import_no_torch():
    # each Ray worker imports the module its work lives in: the token pass stays on the tokenizer's imports
    code = "import sys, kvscope.engine.audit.distributed.ray_scan, kvscope.engine.audit.logs.shards; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@dataclass(frozen=True)
class Listener:
    """A process listening on a TCP port, and the address it bound."""

    pid: int
    name: str
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # gRPC's ::ffff:127.0.0.1 too


def _listening(pids: set[int]) -> list[Listener]:
    """The TCP sockets the processes ``pids`` listen on (a port may have several: one per address bound)."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            sockets = [c.laddr for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            found += [Listener(pid, process.name(), ip, port) for ip, port in sockets]
        except psutil.NoSuchProcess:  # a worker that ended meanwhile
            continue
    return found


@ray.remote
def _pid() -> int:
    return os.getpid()


def test_local_ray_listens_on_loopback_only(cluster):
    # the local cluster's processes: the driver, what ray.init started (GCS, raylet, monitor, dashboard head) and their
    # children (workers, the agents); a task first, so that a worker's own gRPC server is among them
    worker = ray.get(_pid.remote())
    node = ray._private.worker._global_node
    started = {info.process.pid for infos in node.all_processes.values() for info in infos}
    pids = {os.getpid()} | started | {child.pid for pid in started for child in psutil.Process(pid).children(recursive=True)}
    listening = _listening(pids)
    assert [listener for listener in listening if not listener.loopback] == []

    # the ports Ray names are among them: GCS, node manager, object manager, runtime-env agent; and with ray[default]
    # (not installed by .[scale]: there they are -1) the dashboard agent's gRPC and HTTP ports and its metrics exporter
    (info,) = ray.nodes()
    assert info["NodeManagerAddress"] == "127.0.0.1"
    named = {"GCS": int(node.gcs_address.rsplit(":", 1)[1])}
    named |= {key: info[key] for key in ("NodeManagerPort", "ObjectManagerPort", "RuntimeEnvAgentPort")}
    named |= {key: info[key] for key in ("MetricsExportPort", "MetricsAgentPort", "DashboardAgentListenPort") if info[key] > 0}
    by_port = {listener.port: listener.name for listener in listening}
    assert {key: port for key, port in named.items() if port not in by_port} == {}
    assert by_port[named["GCS"]] == "gcs_server" and by_port[info["NodeManagerPort"]] == "raylet"
    assert {os.getpid(), worker} <= {listener.pid for listener in listening}  # the driver's and a worker's gRPC servers
