"""KVScope, one installed package: ``from kvscope import load_model, Scenario, EditExperiment, ...``.

Its layers are subpackages: ``kvscope.engine`` (torch and transformers, no UI), ``kvscope.viz`` (plotly figures)
and ``kvscope.app`` (the Gradio explorer); ``python -m kvscope`` is the CLI (``kvscope`` once installed).

``kvscope`` re-exports the engine's public API, the same names and objects as ``kvscope.engine``
(``kvscope.load_model is kvscope.engine.load_model``), described by topic in docs/engine.md#the-public-api. Figures
are in ``kvscope.viz`` (plotly; they display inline in Jupyter).

Like ``kvscope.engine``, importing ``kvscope`` loads nothing (no torch, no model) and changes no process state: each
name resolves on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import kvscope.engine as engine

__all__ = list(engine.__all__)

if TYPE_CHECKING:
    from kvscope.engine import *  # noqa: F403 (the engine's public API, as kvscope.engine.__all__ lists it)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
    value = getattr(engine, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
