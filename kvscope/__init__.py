"""KVScope for notebooks and scripts: ``from kvscope import load_model, Scenario, EditExperiment, ...``.

``kvscope`` is the import name of an installed KVScope (``pip install -e .``): it re-exports the engine's public
API, the same names and objects as ``engine`` (``kvscope.load_model is engine.load_model``), documented in
``engine``'s docstring (``help(engine)``): ``load_model``, ``tiny_model``, ``Scenario``, ``bundled_scenarios``,
``run_scenario``, ``Notebook``, ``Knockout``, ``EditExperiment``, ``EditReport``, ``EditSettings``, ``analyse_edit``, ``PROBES``,
``SkillStore``, ``Remedy``, ``compare``, ``calibrated_remedy``, ``run_selftest``, ``check_model``, ``save_cache``, ``load_cache``,
``to_dynamic_cache``, ``KVScopeError``. Figures are in ``viz`` (plotly; they display inline in Jupyter).

Like ``engine``, importing ``kvscope`` loads nothing (no torch, no model) and changes no process state: each
name resolves on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import engine

__all__ = list(engine.__all__)

if TYPE_CHECKING:
    from engine import (  # noqa: F401
        PROBES,
        EditExperiment,
        EditReport,
        EditSettings,
        Knockout,
        KVScopeError,
        Notebook,
        Remedy,
        Scenario,
        SkillStore,
        analyse_edit,
        bundled_scenarios,
        calibrated_remedy,
        check_model,
        compare,
        load_cache,
        load_model,
        run_scenario,
        run_selftest,
        save_cache,
        tiny_model,
        to_dynamic_cache,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvscope' has no attribute {name!r}")
    value = getattr(engine, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)
