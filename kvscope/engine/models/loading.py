"""`load_model` and spec resolution: the GGUF aliases, "tiny-<arch>", a local directory or a Hugging Face id.

Also the user-facing device and dtype options (`resolve_device`, `parse_dtype`), what loads without network
(`available_offline`), and the one place safetensors weights are loaded (`_load_pretrained`: decoder-only causal
LMs only, never pickle weights, never `trust_remote_code`).
"""

from __future__ import annotations

import difflib
import logging
import re
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
)

from kvscope.engine.cache.loaded import (
    DTYPES,
    LoadedModel,
    LoadedTokenizer,
    ModelFingerprint,
    ModelLoadError,
    SpliceGate,
    config_hash,
    dtype_name,
)
from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.models import gguf
from kvscope.engine.models.cpu_math import keep_output_rows_dense, tune_cpu_math
from kvscope.engine.models.dtype import accelerator_dtype, load_with_cpu_dtype_choice
from kvscope.engine.models.store import cache_dir
from kvscope.engine.models.tiny import tiny_model, tiny_tokenizer_only
from kvscope.engine.progress import MessageProgress, reporter

logger = logging.getLogger(__name__)

TINY_PREFIX = "tiny-"

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_BARE_NAME = re.compile(r"[A-Za-z0-9][\w.-]*")  # an alias, or a legacy hub id like "gpt2"
_HUB_PROBE_TIMEOUT_S = 10.0


def load_model(
    spec: str = "embedded",
    device: str = "auto",
    dtype: str = "auto",
    progress: MessageProgress | None = None,
) -> LoadedModel:
    """Load a causal LM by alias ("embedded", "smollm2", "tiny-<arch>"), local directory or HF id."""
    tune_cpu_math()  # before torch's first kernel where possible (MKL reads its setting once)
    report = reporter(progress, logger)
    target = resolve_device(device)
    requested = parse_dtype(dtype)
    spec = spec.strip()
    if spec.startswith(TINY_PREFIX):
        return _load_tiny(spec[len(TINY_PREFIX) :], target, requested)
    if spec in gguf.ALIASES:
        copy, name, source = gguf.converted_alias(spec, report)
        return _load_pretrained(str(copy), name, source, target, requested, report)
    path = Path(spec).expanduser()
    if path.exists():
        directory = _check_local_dir(path, spec)
        return _load_pretrained(str(directory), str(directory), f"local directory {directory}", target, requested, report)
    return _load_hub(spec, target, requested, report)


def load_tokenizer(spec: str = "embedded", progress: MessageProgress | None = None) -> LoadedTokenizer:
    """The tokenizer and config of a model named as :func:`load_model` names it, without its weights (a token pass,
    ``audit --sample 0``); a hub id is read from the local HF cache only."""
    report = reporter(progress, logger)
    spec = spec.strip()
    if spec.startswith(TINY_PREFIX):
        return tiny_tokenizer_only(spec[len(TINY_PREFIX) :])
    if spec in gguf.ALIASES:
        copy, name, source = gguf.converted_alias(spec, report)
        location, local_only = str(copy), True
    elif Path(spec).expanduser().exists():
        location = str(_check_local_dir(Path(spec).expanduser(), spec))
        name, source, local_only = location, f"local directory {location}", True
    elif _in_hf_cache(spec):
        location, name, source, local_only = spec, spec, f"Hugging Face {spec} (local HF cache)", True
    else:
        raise ModelLoadError(f"{spec!r}: a tokenizer-only load reads an alias, a tiny model, a local directory or the local HF cache")
    report(f"loading the tokenizer of {name} (no weights: token pass only)")
    config = _causal_config(location, local_only)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    return LoadedTokenizer(name, tokenizer, config, source)


def available_offline() -> list[str]:
    """Specs that load without network: installed aliases, converted copies, local HF-cache ids."""
    found = gguf.installed_specs()
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


def parse_dtype(dtype: str) -> torch.dtype | None:
    """Parse "auto" (None: decide per device) or an explicit "float32" | "bfloat16" | "float16"."""
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use 'auto', {', '.join(repr(d) for d in DTYPES)}")
    return DTYPES[dtype]


# --------------------------------------------------------------------------------------------
# Local directories, hub ids and tiny models
# --------------------------------------------------------------------------------------------


def _check_local_dir(path: Path, spec: str) -> Path:
    """A local model directory with a config and safetensors weights (never pickle .bin); messages name the
    ``spec`` as given, never the path it resolves to."""
    if not path.is_dir():
        raise ModelLoadError(f"{spec!r} is a file; give the model directory (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{spec!r} has no config.json: not a transformers model directory")
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.glob("*.bin"))
        found = f" (found {', '.join(pickled)}; KVScope never loads pickle weights)" if pickled else ""
        raise ModelLoadError(f"{spec!r} has no *.safetensors weights{found}")
    return path.resolve()


def _load_hub(spec: str, device: torch.device, dtype: torch.dtype | None, report: MessageProgress) -> LoadedModel:
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
    choices = [*gguf.ALIASES, f"{TINY_PREFIX}<arch>"]
    close = difflib.get_close_matches(spec, gguf.ALIASES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown model {spec!r}: not an alias, a local directory or a Hugging Face id ('owner/name'). Aliases: {', '.join(choices)}.{hint}"
    )


def _in_hf_cache(spec: str) -> bool:
    """Whether the id's config is already in the local HF cache (no network)."""
    try:
        AutoConfig.from_pretrained(spec, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        return False
    return True


def _probe_hub(spec: str, report: MessageProgress) -> None:
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
    """Delegate "tiny-<arch>" to kvscope.engine.models.tiny (random weights; float32 unless asked otherwise)."""
    loaded = tiny_model(arch, dtype=dtype or torch.float32)
    loaded.dtype_reason = f"{dtype_name(dtype)} as requested" if dtype else "float32 (tiny random-weight models are float32 unless asked)"
    if loaded.device != device:
        loaded.model.to(device)
        loaded.device = device
    return loaded


# --------------------------------------------------------------------------------------------
# Loading safetensors weights
# --------------------------------------------------------------------------------------------


def _load_pretrained(
    location: str,
    name: str,
    source: str,
    device: torch.device,
    dtype: torch.dtype | None,
    report: MessageProgress,
    local_only: bool = False,
) -> LoadedModel:
    """Load config, tokenizer and safetensors weights; pick the dtype; return a frozen eval model."""
    config = _causal_config(location, local_only)
    auto_class, mapping = (
        (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING)
        if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
        else (AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)
    )
    model_class = mapping[type(config)]
    attention = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"

    label = "safetensors copy" if Path(location).parent == cache_dir() / "converted" else name

    def load(torch_dtype: torch.dtype) -> PreTrainedModel:
        report(f"loading {label} ({dtype_name(torch_dtype)})")
        model = auto_class.from_pretrained(
            location,
            dtype=torch_dtype,
            attn_implementation=attention,
            trust_remote_code=False,
            use_safetensors=True,
            local_files_only=local_only,
        )
        model.eval().requires_grad_(False)
        keep_output_rows_dense(model)
        return model.to(device)

    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    image_processor = _image_processor(location, local_only) if auto_class is AutoModelForImageTextToText else None

    def loaded(model: PreTrainedModel, reason: str) -> LoadedModel:
        chosen = next(model.parameters()).dtype
        fingerprint = ModelFingerprint(name=name, config_hash=config_hash(model.config), dtype=dtype_name(chosen))
        return LoadedModel(
            name,
            model,
            tokenizer,
            device,
            chosen,
            source,
            fingerprint,
            reason,
            image_processor=image_processor,
            splice_gate=SpliceGate(run_selftest),
        )

    if dtype is not None:
        result = loaded(load(dtype), f"{dtype_name(dtype)} as requested")
    elif device.type != "cpu":
        chosen = accelerator_dtype(device)
        result = loaded(load(chosen), f"auto on {device.type}: {dtype_name(chosen)} (what this GPU computes natively)")
    else:
        result = load_with_cpu_dtype_choice(load, loaded, name, config, report)
    logger.info("loaded %s on %s as %s (%s)", name, device, dtype_name(result.dtype), source)
    return result


def _image_processor(location: str, local_only: bool) -> Any:
    """A vision-language model's own image processor, or None where its directory has none (text use only)."""
    try:
        return AutoImageProcessor.from_pretrained(location, local_files_only=local_only, trust_remote_code=False)
    except (OSError, ValueError) as error:
        logger.info("no image processor for %s (%s): images are refused, text works", location, error)
        return None


def _causal_config(location: str, local_only: bool) -> PretrainedConfig:
    """The model's config, refusing remote code and anything that is not a decoder-only causal LM (a
    vision-language model's text decoder counts: KVScope feeds it text)."""
    try:
        config = AutoConfig.from_pretrained(location, trust_remote_code=False, local_files_only=local_only)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the config of {location!r} (remote code is never run): {error}") from error
    archs = config.architectures or []
    causal = (
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING
        and (not archs or any(_is_causal_class(arch) for arch in archs))
    )
    vision_language = type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and any(
        arch.endswith("ForConditionalGeneration") for arch in archs
    )
    if config.is_encoder_decoder or not (causal or vision_language):
        described = f"model_type {config.model_type!r}" + (f" ({', '.join(archs)})" if archs else "")
        raise ModelLoadError(f"{location!r} is {described}, not a causal LM: KVScope needs a decoder-only causal LM")
    return config


def _is_causal_class(class_name: str) -> bool:
    return class_name.endswith(("ForCausalLM", "LMHeadModel"))
