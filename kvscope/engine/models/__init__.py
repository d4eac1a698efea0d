"""Model loading: the embedded default, packaged GGUFs, tiny models, any HF id or local directory; device and dtype.

A module per job (docs/engine.md, "The layers"); here, what a host asks before loading: the offline aliases and a
model's size. ``LoadedModel`` and what every loader shares live in ``kvscope.engine.cache.loaded``, outside this
package, so that ``tiny`` imports them without importing the loader, which imports ``tiny``. Monkeypatch a name in
the submodule that uses it, not here.
"""

from __future__ import annotations

from kvscope.engine.cache.loaded import (
    DTYPES,
    LoadedModel,
    ModelFingerprint,
    ModelLoadError,
    config_hash,
    dtype_name,
)
from kvscope.engine.models import gguf
from kvscope.engine.models.dtype import accelerator_dtype
from kvscope.engine.models.gguf import EMBEDDED_PACKAGES, EMBEDDED_SHA256, embedded_gguf_path
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
