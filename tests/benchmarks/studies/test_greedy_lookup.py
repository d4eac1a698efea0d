"""The greedy_lookup benchmark on tiny-qwen2 and a bundled log: both decodings give the same tokens, lookup runs no more
forwards than a token a forward, and the times are written as min / median / max with the speedup between them."""

import json

from benchmarks.studies.greedy_lookup import main


def test_the_benchmark_writes_both_decodings_side_by_side(tmp_path):
    main(["--model", "tiny-qwen2", "--logs", "rag", "--tokens", "12", "--reps", "2", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "greedy_lookup-tiny-qwen2-cpu.json").read_text())["logs"]
    assert row["log"] == "rag" and row["prompts"] == 3 and row["same_tokens"] and row["differing"] == []
    assert 0 < row["lookup_forwards"] <= row["plain_forwards"] <= row["generated_tokens"]
    for key in ("plain_s", "lookup_s", "speedup"):
        assert set(row[key]) == {"min", "median", "max"} and row[key]["min"] <= row[key]["median"] <= row[key]["max"]
    assert row["lookup_tokens_per_forward"] >= 1
