"""The N-skill study and keystone benchmark scripts: the JSON a small run writes (tiny random-weight model)."""

from __future__ import annotations

import json

from benchmarks.studies import compose_long, compose_many, keystone


def test_compose_many_writes_tie_aware_summaries_and_a_figure(tmp_path):
    data = compose_many.main(
        [
            "--model",
            "tiny-qwen2",
            "--scenarios",
            "refund_gate",
            "--skills",
            "account_gate,user_memory",
            "--placements",
            "start,end",
            "--remedies",
            "splice,seam:10000,prefix+ape:0.9,0.9",
            "--out",
            str(tmp_path),
        ]
    )
    stored = json.loads((tmp_path / "compose_many-tiny-qwen2-cpu.json").read_text())
    assert list(stored["summary"]) == ["splice", "seam:10000", "prefix+ape:0.9,0.9"]  # ape:T,S keeps its comma
    assert set(stored["keystone"]["gaps"]) <= set(stored["summary"]) and stored["total_s"] > 0 and stored["load_average"]["after"]
    assert (tmp_path / "compose_many-tiny-qwen2-cpu.html").exists()
    assert stored["summary"] == json.loads(json.dumps(data["summary"]))
    assert len(stored["cases"]) == 2 * (2 * 2 + 1)  # both values × (N = 1, 2 at two placements + the pair reversed)
    assert [case["skills"] for case in stored["cases"]][-1] == ["user_memory", "account_gate"]
    exact = stored["summary"]["seam:10000"]
    assert exact["cases"] == 10 and exact["decisive"] + exact["ties"] == 10 and exact["mean_abs_margin_error"] < 1e-3
    assert set(exact["by_n"]) == {"1", "2"} and stored["summary"]["splice"]["recomputed_fraction"] == 0.0
    assert stored["best"] in ("splice", "seam:10000") and stored["dtype"] and stored["model"] == "tiny-qwen2"
    assert stored["default"] == stored["choice"]["remedy"] in stored["summary"] and stored["keystone"]["scenario"] == "keystone_safety"
    assert set(stored["choice"]["goal"]) == {"agreement", "speed_share_of_splice", "keystone_max_gap"}
    assert stored["reps"] == 1 and "avx512_bf16" in stored["cpu"]
    path = str(tmp_path / "compose_many-tiny-qwen2-cpu.json")
    drawn = compose_many.main(["--frontiers", f"{path},{path}", "--out", str(tmp_path)])
    assert drawn["studies"] == ["compose_many-tiny-qwen2-cpu.json"] * 2 and (tmp_path / "compose_frontiers.html").exists()


def test_the_long_study_writes_each_length_the_default_and_the_environment(tmp_path):
    data = compose_long.main(
        [
            "--model",
            "tiny-qwen2",
            "--lengths",
            "48,96",
            "--compositions",
            "1:start,2:end",
            "--skills",
            "tone_guide,tool_specs",
            "--remedies",
            "splice,seam:1,seam:10000",
            "--keystone",
            "",
            "--out",
            str(tmp_path),
        ]
    )
    stored = json.loads((tmp_path / "compose_many-long-tiny-qwen2-cpu.json").read_text())
    assert stored["lengths"] == [48, 96] and stored["compositions"] == ["1:start", "2:end"] and stored["reps"] == 1
    assert len(stored["cases"]) == 2 * 2 * 2 and [case["length"] for case in stored["cases"]] == [48] * 4 + [96] * 4
    assert [case["skills"] for case in stored["cases"][:3:2]] == [["tone_guide_48"], ["tone_guide_24", "tool_specs_24"]]
    for name, row in stored["summary"].items():
        assert set(row["by_length"]) == {"48", "96"} and sum(group["cases"] for group in row["by_length"].values()) == row["cases"] == 8
    exact = stored["summary"]["seam:10000"]
    assert exact["recomputed_fraction"] == 1.0 and exact["mean_abs_margin_error"] < 1e-3
    assert stored["default"] == (stored["choice"] or {}).get("remedy") and {"avx2", "avx512_bf16"} <= set(stored["cpu"])
    assert stored["keystone"] == {"scenario": None, "delta_margin": None, "gaps": {}} and data["summary"].keys() == stored["summary"].keys()


def test_keystone_script_reports_gaps_per_remedy(tmp_path):
    data = keystone.main(["--model", "tiny-qwen2", "--remedies", "seam:1,prefix+seam:1", "--out", str(tmp_path)])
    stored = json.loads((tmp_path / "keystone-tiny-qwen2-cpu.json").read_text())
    assert set(stored["remedies"]) == {"seam:1", "prefix+seam:1"} == set(data["remedies"])
    row = stored["remedies"]["seam:1"]
    assert {"delta_margin", "max_recovery_gap", "strategies"} <= set(row) and "erratum" in row["strategies"]
