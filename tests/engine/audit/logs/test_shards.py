"""One reader for a log in many files: the same requests as ``read_log`` on one file, numbered across files and shards,
gzip'd or plain, with a corrupt shard named by file and line while the rest is read."""

import gzip
import json
from pathlib import Path

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.logs.shards import log_files, plan_shards, read_logs, read_shard

BUNDLED = sorted(Path("demos/logs").glob("*.jsonl")) + [Path("demos/logs/traffic/interleaved_agents.jsonl")]


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_one_file_reads_as_read_log_reads_its_text(path):
    assert read_logs([path]) == read_log(path.read_text(encoding="utf-8"))


def test_shards_of_plain_and_gzip_files_number_requests_across_files(tmp_path):
    lines = [json.dumps({"prompt": f"request {n}"}) for n in range(1, 26)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:10]) + "\n\n", encoding="utf-8")  # a blank line: not a record
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write("\n".join(lines[10:]))  # no newline at the end
    (tmp_path / "notes.txt").write_text("not a log")
    files = log_files([tmp_path])
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl.gz"]
    shards = plan_shards(files, lines_per_shard=4)
    # a.jsonl: 11 lines (10 records, a blank one) in shards of 4; b: 15 lines from its start (gzip: no offset)
    assert [(Path(s.path).name, s.first_line, s.lines) for s in shards] == [
        ("a.jsonl", 1, 4), ("a.jsonl", 5, 4), ("a.jsonl", 9, 3), ("b.jsonl.gz", 1, 4), ("b.jsonl.gz", 5, 4),
        ("b.jsonl.gz", 9, 4), ("b.jsonl.gz", 13, 3),
    ]  # fmt: skip
    assert shards[1].offset == sum(len(line) + 1 for line in lines[:4]) and shards[3].offset is None
    log = read_logs([tmp_path])
    assert [r.prompt for r in log.requests] == [f"request {n}" for n in range(1, 26)]
    assert [r.index for r in log.requests] == list(range(1, 26))
    assert [r.line for r in log.requests][8:12] == [9, 10, 1, 2]  # lines within each file
    assert read_shard(shards[4], first_index=15).requests[0].index == 15


def test_a_corrupt_shard_is_named_by_file_and_line_and_the_rest_is_read(tmp_path):
    good = [json.dumps({"prompt": f"p{n}"}) for n in range(6)]
    (tmp_path / "1.jsonl").write_text("\n".join(good[:3]) + "\nnot json\n", encoding="utf-8")
    data = gzip.compress(("\n".join(good[3:]) + "\n").encode() * 400)
    (tmp_path / "2.jsonl.gz").write_bytes(data[: len(data) // 2])  # truncated mid-stream
    (tmp_path / "3.jsonl").write_text(good[0] + "\n", encoding="utf-8")
    log = read_logs([tmp_path])
    first, second = log.skipped
    assert (first.line, first.reason) == (4, "is not JSON: Expecting value (column 1) (in 1.jsonl)")
    assert "cannot be read" in second.reason and "(in 2.jsonl.gz)" in second.reason and second.line > 1
    read_before = second.line - 1  # every line before the failure was read
    assert len(log.requests) == 3 + read_before + 1
    assert log.requests[-1].prompt == "p0" and log.requests[-1].line == 1


def test_missing_paths_and_empty_directories_are_refused(tmp_path):
    with pytest.raises(RequestLogError, match="no such file"):
        log_files([tmp_path / "absent.jsonl"])
    with pytest.raises(RequestLogError, match="holds no log file"):
        log_files([tmp_path])


@pytest.mark.parametrize("lines", [1, 3])
def test_the_log_files_give_one_process_the_log_the_distributed_pass_sees(tmp_path, lines):
    # the one log both passes take: what one process reads (``LogFiles.log``) is what the shards the distributed pass
    # plans hold (read shard by shard, counted, then finished as one log), skipped records and time order included
    from kvscope.engine.audit.distributed.ray_scan import LogCount
    from kvscope.engine.audit.logs.reading import finished_log, join_traces
    from kvscope.engine.audit.logs.shards import LogFiles, count_shards

    records = [json.loads(line) for line in Path("demos/logs/exports/gateway.jsonl").read_text().splitlines()]
    shuffled = [json.dumps(records[k]) for k in (7, 2, 9, 0, 4, 1, 8, 3, 6, 5)]
    (tmp_path / "a.jsonl").write_text("\n".join([*shuffled[:5], "{broken"]) + "\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as stream:
        stream.write("\n".join(shuffled[5:]) + "\n")
    for files in (
        LogFiles.of([tmp_path]),
        LogFiles.of(["demos/logs/support_agent.jsonl"]),
        LogFiles.of(sorted(Path("demos/logs/exports").glob("*.json*"))),
    ):
        shards = files.shards(lines)
        reads, first = [], 1
        for shard in shards:
            reads.append(read_shard(shard, files.fmt, first))
            first += len(reads[-1].requests)
        sessions = {key: value for read in reads for key, value in read.sessions.items()}
        requests = join_traces([request for read in reads for request in read.requests], sessions)
        seen = finished_log(requests, [item for read in reads for item in read.skipped], sessions)
        assert files.log == seen and files.log is files.log  # read once
        items = [{"number": n, "shard": json.dumps(shard.__dict__)} for n, shard in enumerate(shards)]
        count = LogCount.of([row for item in items for row in count_shards({k: [v] for k, v in item.items()}, files.fmt)["count"]])
        assert (count.total, count.order, count.skipped, count.formats) == (
            len(seen.requests),
            seen.order,
            list(seen.skipped),
            seen.formats,
        )
    assert LogFiles.of([tmp_path]).log.order == "timestamps" and len(LogFiles.of([tmp_path]).log.skipped) == 1
