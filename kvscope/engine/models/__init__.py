"""Model loading: the embedded default, packaged GGUFs, tiny models, any HF id or local directory; device and dtype.

- `kvscope.engine.cache.loaded` (beside this package): `LoadedModel`, `ModelFingerprint`, `ModelLoadError`, `config_hash`,
  `rope_summary`, `DTYPES`, `dtype_name`: what every loader, `kvscope.engine.models.tiny` included, shares. It lives outside
  the package so that `kvscope.engine.models.tiny` imports it without importing the loader, which imports `kvscope.engine.models.tiny`.
- `store`: the cache dir and its JSON stores.
- `gguf`: the `embedded`, `smollm2` and optional `qwen-1.5b` aliases: GGUF assembly, sha256, conversion to
  safetensors, provenance.
- `dtype`: the "auto" dtype choice (measured float32 vs bfloat16 on CPU, gated by the cache self-test; on a GPU,
  `accelerator_dtype`).
- `loading`: `load_model`, `load_tokenizer` (no weights: a token pass), spec resolution, `resolve_device`,
  `parse_dtype`, `available_offline`.
- here: `offline_aliases` and `is_offline_alias`, the specs that name a packaged or tiny model (what a host offers);
  `HOST_OPT_IN_ALIASES`, those a public host offers only when it names them; `expected_parameter_bytes`, a model's
  size before it loads.

Monkeypatch a name in the submodule that uses it, not here.
"""

from __future__ import annotations

from kvscope.engine.cache.loaded import (
    DTYPES,
    LoadedModel,
    ModelFingerprint,
    ModelLoadError,
    config_hash,
    dtype_name,
    rope_summary,
)
from kvscope.engine.models import gguf
from kvscope.engine.models.dtype import accelerator_dtype
from kvscope.engine.models.gguf import EMBEDDED_PACKAGES, EMBEDDED_SHA256, QWEN_1_5B, embedded_gguf_path
from kvscope.engine.models.loading import (
    TINY_PREFIX,
    available_offline,
    load_model,
    load_tokenizer,
    parse_dtype,
    resolve_device,
)
from kvscope.engine.models.store import cache_dir
from kvscope.engine.models.tiny import FAMILIES

__all__ = [
    "DTYPES",
    "EMBEDDED_PACKAGES",
    "EMBEDDED_SHA256",
    "HOST_OPT_IN_ALIASES",
    "QWEN_1_5B",
    "LoadedModel",
    "ModelFingerprint",
    "ModelLoadError",
    "accelerator_dtype",
    "available_offline",
    "cache_dir",
    "config_hash",
    "dtype_name",
    "embedded_gguf_path",
    "expected_parameter_bytes",
    "is_offline_alias",
    "load_model",
    "load_tokenizer",
    "offline_aliases",
    "parse_dtype",
    "resolve_device",
    "rope_summary",
]

HOST_OPT_IN_ALIASES = gguf.HOST_OPT_IN
"""Offline aliases too large to offer on a public server unless its host names them (``KVSCOPE_ALLOWED_MODELS``)."""

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 4}  # auto: float32 is the most it can choose


def expected_parameter_bytes(spec: str, dtype: str = "auto") -> int | None:
    """A GGUF alias's parameter bytes in ``dtype`` before it loads (for making room first); None for any other spec."""
    parameters = gguf.alias_parameters(spec)
    return None if parameters is None else parameters * _DTYPE_BYTES.get(dtype, 4)


def offline_aliases() -> tuple[str, ...]:
    """Every alias that names a model shipped with KVScope: the GGUF aliases, then ``tiny-<arch>`` for each tiny
    architecture (hybrids included)."""
    return (*gguf.ALIASES, *(f"{TINY_PREFIX}{arch}" for arch in FAMILIES))


def is_offline_alias(spec: str) -> bool:
    """Whether ``spec`` is a GGUF alias or a ``tiny-`` spec (any architecture name) rather than a Hugging Face id or
    a local directory."""
    return spec in gguf.ALIASES or spec.startswith(TINY_PREFIX)
