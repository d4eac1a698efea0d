"""The cross-model benchmark: calibration and the N-skill study per model, the CPU flags, one JSON the Benchmarks tab
draws (tiny random-weight models)."""

from __future__ import annotations

import json

from benchmarks.studies import compare_models
from kvscope.viz.results import result_figures


def test_compare_models_writes_each_model_and_the_cpu_flags(tmp_path):
    data = compare_models.main(
        [
            "--models",
            "tiny-qwen2,tiny-llama",
            "--scenarios",
            "refund_gate",
            "--skills",
            "account_gate",
            "--remedies",
            "splice,seam:1",
            "--out",
            str(tmp_path),
        ]
    )
    stored = json.loads((tmp_path / "compare_models-float32-cpu.json").read_text())
    assert stored["complete"] and stored["reps"] == 1 and stored["dtype"] == "float32"
    assert [row["spec"] for row in stored["models"]] == ["tiny-qwen2", "tiny-llama"] == [row["spec"] for row in data["models"]]
    assert {"avx2", "avx512_bf16", "cores", "model_name"} <= set(stored["cpu"])
    for row in stored["models"]:
        assert row["calibrate"]["total"] == 1 and row["study"]["cases"] == 2 and set(row["study"]["summary"]) == {"splice", "seam:1"}
        assert row["load_s"] >= 0 and row["calibrate"]["s"] >= 0 and row["parameters"] > 0
    (figure,) = result_figures({"compare_models-float32-cpu": stored})
    assert "Across models" in figure.layout.title.text


def test_a_resumed_run_keeps_the_rows_of_the_same_settings_and_reruns_on_other_settings(tmp_path):
    common = ["--scenarios", "refund_gate", "--skills", "account_gate", "--remedies", "splice", "--out", str(tmp_path)]
    first = compare_models.main(["--models", "tiny-qwen2", *common])
    resumed = compare_models.main(["--models", "tiny-qwen2,tiny-llama", "--resume", *common])
    assert resumed["resumed"] == ["tiny-qwen2"] and resumed["complete"]
    assert resumed["models"][0] == first["models"][0] and resumed["models"][1]["spec"] == "tiny-llama"
    other = compare_models.main(["--models", "tiny-qwen2", "--resume", *common[:-4], "--remedies", "seam:1", "--out", str(tmp_path)])
    assert other["resumed"] == [] and set(other["models"][0]["study"]["summary"]) == {"seam:1"}
