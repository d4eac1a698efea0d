"""The forward_paths benchmark on tiny-qwen2: each fast path gives the replaced path's numbers bit for bit, and the
times are written as min / median / max with the speedup between them."""

import json

from benchmarks.studies.forward_paths import main


def test_the_benchmark_writes_both_paths_side_by_side_per_dtype(tmp_path):
    main(["--model", "tiny-qwen2", "--dtypes", "bfloat16,float32", "--chunk", "48", "--stored", "6", "--reps", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "forward_paths-tiny-qwen2-cpu.json").read_text())
    assert (data["chunk"], data["stored"]) == (48, 6) and set(data["dtypes"]) == {"bfloat16", "float32"}
    pairs = {"output_rows": ("slice", "fresh_view"), "causal_prefill": ("masked", "padded_causal")}
    for rows in data["dtypes"].values():
        for name, sides in pairs.items():
            row = rows[name]
            assert row["same"] and row["speedup"] > 0
            for side in sides:
                assert row[side]["reps"] == 2 and row[side]["min"] <= row[side]["median"] <= row[side]["max"]
