"""The N-skill study and keystone benchmark scripts: the JSON a small run writes (tiny random-weight model)."""

from __future__ import annotations

import json

from benchmarks import compose_many, keystone


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
            "splice,seam:10000",
            "--out",
            str(tmp_path),
        ]
    )
    stored = json.loads((tmp_path / "compose_many-tiny-qwen2-cpu.json").read_text())
    assert (tmp_path / "compose_many-tiny-qwen2-cpu.html").exists()
    assert stored["summary"] == json.loads(json.dumps(data["summary"]))
    assert len(stored["cases"]) == 2 * (2 * 2 + 1)  # both values × (N = 1, 2 at two placements + the pair reversed)
    assert [case["skills"] for case in stored["cases"]][-1] == ["user_memory", "account_gate"]
    exact = stored["summary"]["seam:10000"]
    assert exact["cases"] == 10 and exact["decisive"] + exact["ties"] == 10 and exact["mean_abs_margin_error"] < 1e-3
    assert set(exact["by_n"]) == {"1", "2"} and stored["summary"]["splice"]["recomputed_fraction"] == 0.0
    assert stored["best"] in ("splice", "seam:10000") and stored["dtype"] and stored["model"] == "tiny-qwen2"


def test_keystone_script_reports_gaps_per_remedy(tmp_path):
    data = keystone.main(["--model", "tiny-qwen2", "--remedies", "seam:1,prefix+seam:1", "--out", str(tmp_path)])
    stored = json.loads((tmp_path / "keystone-tiny-qwen2-cpu.json").read_text())
    assert set(stored["remedies"]) == {"seam:1", "prefix+seam:1"} == set(data["remedies"])
    row = stored["remedies"]["seam:1"]
    assert {"delta_margin", "max_recovery_gap", "strategies"} <= set(row) and "erratum" in row["strategies"]
