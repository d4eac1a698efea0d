"""KVScope engine: a model's KV cache as an editable, composable notebook (torch + transformers only).

The public API, what a notebook or script imports (``from engine import load_model, Scenario, ...``):

=====================  ==========================================================================================
``load_model``         a model by alias (``embedded``, ``smollm2``, ``tiny-<arch>``), local directory or HF id
``tiny_model``         a tiny random-weight model of one family, for exact cache-math checks
``Scenario``           a scenario file (TOML): context, fields, question, answers; ``bundled_scenarios()`` lists ours
``run_scenario``       prefill a scenario at given field values and read the decision (a ``ScenarioRun``)
``Notebook``           a context's K/V plus per-token ids, positions, segments and visibility; every cache operation
``Knockout``           positions (layers, heads) hidden from the decision
``EditExperiment``     one field change: stale, oracle, every repair strategy by name, into an ``EditReport``
``EditSettings``       the strategies' knobs (erratum wording, K and ranking of field_topk, chain-of-thought length)
``analyse_edit``       what the Notes tab shows for an edit: the report, the decision's attention, notes effects
``PROBES``             every probe by name (notes map, knockout, read heads, linear probe, attribution, ...)
``SkillStore``         compiled skill blocks (K/V computed once), in memory and optionally on disk
``compare``            splice skills into a context with a ``Remedy`` and compare with a full recompute
``calibrated_remedy``  this model's default remedy, measured once (``RemedyChoice``: numbers, frontier, reason)
``run_selftest``       the model's numeric check of re-rotation and splicing against its dtype's noise floor
``check_model``        the model's row of the support matrix: every operation against its own forward
``save_cache``         a notebook's K/V (transformers' layout) with positions, segments, visibility to safetensors
``load_cache``         a saved cache back into an exact notebook on the model that computed it
``to_dynamic_cache``   a notebook's visible entries as a transformers ``DynamicCache``, to continue generating
``KVScopeError``       the base of every error meant for the user
=====================  ==========================================================================================

Importing ``engine`` loads nothing and changes no process state: names resolve on first use, the CPU math
setting is applied by the first model load and the attention function is registered by the first forward.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "load_model": "engine.models",
    "tiny_model": "engine.models.tiny",
    "Scenario": "engine.scenario",
    "bundled_scenarios": "engine.scenario",
    "run_scenario": "engine.edit.runs",
    "Notebook": "engine.cache.notebook",
    "Knockout": "engine.cache.notebook",
    "EditExperiment": "engine.edit.experiment",
    "EditReport": "engine.edit.report",
    "EditSettings": "engine.edit.strategies",
    "analyse_edit": "engine.probes.analysis",
    "PROBES": "engine.probes.registry",
    "SkillStore": "engine.compose.skills",
    "Remedy": "engine.compose.splice",
    "compare": "engine.compose.splice",
    "calibrated_remedy": "engine.compose.choice",
    "run_selftest": "engine.cache.selftest",
    "check_model": "engine.checks.support",
    "save_cache": "engine.cache.interop",
    "load_cache": "engine.cache.interop",
    "to_dynamic_cache": "engine.cache.interop",
    "KVScopeError": "engine.errors",
}
__all__ = [
    "EditExperiment",
    "EditReport",
    "EditSettings",
    "KVScopeError",
    "Knockout",
    "Notebook",
    "PROBES",
    "Remedy",
    "Scenario",
    "SkillStore",
    "analyse_edit",
    "bundled_scenarios",
    "calibrated_remedy",
    "check_model",
    "compare",
    "load_cache",
    "load_model",
    "run_scenario",
    "run_selftest",
    "save_cache",
    "tiny_model",
    "to_dynamic_cache",
]

if TYPE_CHECKING:
    from engine.cache.interop import load_cache, save_cache, to_dynamic_cache
    from engine.cache.notebook import Knockout, Notebook
    from engine.cache.selftest import run_selftest
    from engine.checks.support import check_model
    from engine.compose.choice import calibrated_remedy
    from engine.compose.skills import SkillStore
    from engine.compose.splice import Remedy, compare
    from engine.edit.experiment import EditExperiment
    from engine.edit.report import EditReport
    from engine.edit.runs import run_scenario
    from engine.edit.strategies import EditSettings
    from engine.errors import KVScopeError
    from engine.models import load_model
    from engine.models.tiny import tiny_model
    from engine.probes.analysis import analyse_edit
    from engine.probes.registry import PROBES
    from engine.scenario import Scenario, bundled_scenarios


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
