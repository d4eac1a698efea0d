"""The Ray comparison's summary: min/median/max per pass, the ratio of the medians (one process over Ray), whether
every run gave one answer, and a comparison cut short after one pass."""

from benchmarks.studies.audit_scale_ray import _summary


def _run(seconds: float, reused: int = 10) -> dict:
    return {"seconds": seconds, "command_seconds": seconds + 5, "peak_rss_mb": 100.0, "totals": {"reused": reused}, "causes": {}}


def test_the_summary_gives_the_ratio_of_the_medians(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("{}\n")
    runs = {"single": [_run(30), _run(10), _run(20)], "ray": [_run(8), _run(12), _run(10)]}
    summary = _summary(100, 5, 2, log, runs)
    assert summary["summary"]["single"]["seconds"] == {"min": 10, "median": 20, "max": 30}
    assert summary["ratio"] == {"seconds": 2.0, "command_seconds": 1.67}  # 20 / 10, 25 / 15
    assert summary["same_totals_and_causes"] and summary["repeats"] == {"single": 3, "ray": 3}
    assert "totals" not in summary["runs"]["ray"][0]
    runs["ray"][1] = _run(12, reused=11)
    assert not _summary(100, 5, 2, log, runs)["same_totals_and_causes"]
    cut = _summary(100, 5, 2, log, {"single": [_run(30)], "ray": []})
    assert cut["ratio"] == {"seconds": None, "command_seconds": None} and list(cut["summary"]) == ["single"]
