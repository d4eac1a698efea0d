"""KVScope for notebooks and scripts: ``from kvscope import load_model, Scenario, EditExperiment, ...``.

``kvscope`` is the import name of an installed KVScope (``pip install -e .``): it re-exports the engine's public
API, the same names and objects as ``engine`` (``kvscope.load_model is engine.load_model``), documented by topic in
``engine``'s docstring (``help(engine)``): models and scenarios, notebooks, edits and probes, composing skills,
auditing request logs, checks, files and reproduction, and what a server shares between requests. Figures are in
``viz`` (plotly; they display inline in Jupyter).

Like ``engine``, importing ``kvscope`` loads nothing (no torch, no model) and changes no process state: each
name resolves on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import engine

__all__ = list(engine.__all__)

if TYPE_CHECKING:
    from engine import *  # noqa: F403 (the engine's public API, as engine.__all__ lists it)


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
    value = getattr(engine, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
