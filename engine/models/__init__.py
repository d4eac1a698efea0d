"""Model loading: the embedded default, packaged GGUFs, tiny models, any HF id or local directory; device and dtype.

- `loaded`: `LoadedModel`, `ModelFingerprint`, `ModelLoadError`, `config_hash`, `rope_summary`, `DTYPES`,
  `dtype_name` and progress reporting: what every loader, `engine.tiny` included, shares.
- `store`: the cache dir and its JSON stores.
- `gguf`: the `embedded` and `smollm2` aliases: GGUF assembly, sha256, conversion to safetensors, provenance.
- `dtype`: the "auto" dtype choice (measured float32 vs bfloat16 on CPU).
- `loading`: `load_model`, spec resolution, `resolve_device`, `parse_dtype`, `available_offline`.

`from engine.models import NAME` works for each name in `__all__`: it is looked up in its submodule when
asked for (PEP 562), not imported here. Importing any submodule runs this file first, and `engine.tiny` imports
`engine.models.loaded` while `engine.models.loading` imports `engine.tiny`: importing `loading` here would
close that into a cycle. Monkeypatch a name in the submodule that uses it, not here.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.models.gguf import EMBEDDED_PACKAGES, EMBEDDED_SHA256, embedded_gguf_path
    from engine.models.loaded import (
        DTYPES,
        LoadedModel,
        ModelFingerprint,
        ModelLoadError,
        config_hash,
        dtype_name,
        rope_summary,
    )
    from engine.models.loading import available_offline, load_model, parse_dtype, resolve_device
    from engine.models.store import cache_dir

_HOMES = {
    "loaded": (
        "DTYPES",
        "LoadedModel",
        "ModelFingerprint",
        "ModelLoadError",
        "config_hash",
        "dtype_name",
        "rope_summary",
    ),
    "store": ("cache_dir",),
    "gguf": ("EMBEDDED_PACKAGES", "EMBEDDED_SHA256", "embedded_gguf_path"),
    "loading": ("available_offline", "load_model", "parse_dtype", "resolve_device"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
