"""The observed_fit benchmark on a small log with the tiny tokenizer: the fit reproduces every observed count made by
its server, the server's setting is among the best, and the times are written as min / median / max."""

import json

from benchmarks.studies.observed_fit import main
from kvscope.engine.models.tiny import tiny_tokenizer
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE


def test_the_benchmark_recovers_its_servers_setting_and_writes_its_times(tmp_path):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    main(["--requests", "60", "--sessions", "5", "--reps", "1", "--tokenizer", str(tmp_path / "tokenizer"), "--out", str(tmp_path)])
    data = json.loads((tmp_path / "observed_fit-cpu.json").read_text())
    assert data["recovered"]["matches"] == data["recovered"]["requests"] == 60 and data["server_setting_among_the_best"]
    assert data["settings_tried"] == 36 and data["server"]["block"] == 32
    assert set(data["fit_seconds"]) == {"min", "median", "max"} and len(data["load_average"]["before"]) == 3
