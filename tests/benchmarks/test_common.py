"""The benchmarks' shared helpers: the one percentile definition (numpy's 'linear'), the CPU a number was measured on,
each folder's results, and where the stored serving and soak results say which percentile they hold."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import CPU_FLAGS, PERCENTILE, ROOT, cpu_info, percentile, results_dir, spread
from benchmarks.studies import keystone

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx2 fma avx512f
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx2 fma avx512f
"""


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    data = [float(x) for x in np.random.default_rng(0).lognormal(3.0, 1.0, size=37)]
    assert percentile(data, q) == pytest.approx(float(np.percentile(data, q, method="linear")), rel=1e-12)


def test_percentile_on_known_data_and_bad_input():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([10.0], 99) == 10.0
    assert percentile([5, 1, 3], 0) == 1 and percentile([5, 1, 3], 100) == 5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="within 0..100, got 101"):
        percentile([1.0], 101)


def test_spread_rounds_min_median_and_max_and_keeps_the_runs_when_asked():
    assert spread([3.14159, 1.0, 2.71828, 10.0]) == {"min": 1.0, "median": 2.93, "max": 10.0}
    assert spread([1.234, 5.678], digits=1, runs=True) == {"min": 1.2, "median": 3.5, "max": 5.7, "runs": [1.234, 5.678]}
    with pytest.raises(ValueError, match="no values"):
        spread([])


def test_cpu_info_reads_the_model_the_cores_and_each_flag(tmp_path):
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    info = cpu_info(tmp_path / "cpuinfo")
    assert info["model_name"] == "AMD EPYC 7B13" and info["cores"] == 2
    assert {flag for flag in CPU_FLAGS if info[flag]} == {"avx2", "fma", "avx512f"}
    absent = cpu_info(tmp_path / "none")
    assert absent["cores"] is None and not any(absent[flag] for flag in CPU_FLAGS)


def test_a_script_writes_to_its_own_folders_results():
    assert results_dir(keystone.__file__) == ROOT / "benchmarks" / "studies" / "results"


STORED = [
    *(ROOT / "benchmarks" / "serving" / "results").glob("serving-*.json"),
    *(ROOT / "benchmarks" / "app" / "results").glob("soak-*.json"),
]


@pytest.mark.parametrize("path", STORED, ids=lambda path: path.name)
def test_every_stored_serving_and_soak_result_names_its_percentile(path: Path):
    data = json.loads(path.read_text())
    assert data["percentile"] == PERCENTILE or data["percentile"].startswith("nearest rank"), path


def test_a_result_of_a_hub_model_is_written_in_the_folder_named_not_below_its_slash(tmp_path):
    from types import SimpleNamespace

    import torch

    from benchmarks.common import write_result

    lm = SimpleNamespace(
        fingerprint=SimpleNamespace(name="Qwen/Qwen2-VL-2B-Instruct:abc", dtype="float32"),
        device=torch.device("cpu"),
    )
    path = write_result("study", lm, {"x": 1}, tmp_path)
    assert path == tmp_path / "study-Qwen_Qwen2-VL-2B-Instruct-cpu.json" and path.exists()
