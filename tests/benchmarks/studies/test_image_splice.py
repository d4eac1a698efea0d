"""The picture-splice benchmark: the JSON a small run writes (tiny random-weight Qwen2-VL)."""

from __future__ import annotations

import json

from benchmarks.studies import image_splice


def test_image_splice_writes_fidelity_and_speedup_per_shift_and_seam(tmp_path):
    data = image_splice.main(["--model", "tiny-qwen2_vl", "--shifts", "0,30", "--seams", "0,14", "--reps", "1", "--out", str(tmp_path)])
    stored = json.loads((tmp_path / "image-splice-tiny-qwen2_vl-cpu.json").read_text())
    assert stored["rows"] == json.loads(json.dumps(data["rows"])) and len(stored["rows"]) == 4
    by = {(row["seam"], row["shift"] > 0): row for row in stored["rows"]}
    assert by[(0, False)]["cosine"] > 1 - 1e-6 and by[(14, True)]["cosine"] > 1 - 1e-6  # own position, or every token recomputed
    assert by[(0, True)]["cosine"] < 1 - 1e-6 and by[(0, True)]["shift"] >= 30
    assert all(row["speedup"]["min"] <= row["speedup"]["median"] <= row["speedup"]["max"] for row in stored["rows"])
    assert stored["paper"]["cosine_shift_161"] == 0.99 and stored["model"] == "tiny-qwen2_vl"
