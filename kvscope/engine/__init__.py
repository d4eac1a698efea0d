"""KVScope engine: a model's KV cache as an editable, composable notebook (torch + transformers only).

The public API is what a notebook, a script or the app imports (``from kvscope.engine import load_model, Scenario, ...``);
the app imports nothing else of the engine (an import contract in pyproject.toml holds it). docs/engine.md#the-public-api
describes every name by topic. The imports under ``TYPE_CHECKING`` below are its one declaration: type checkers read them,
and at run time the same lines, parsed, say where each name resolves on first use. Importing ``kvscope.engine`` loads
nothing and changes no process state.
"""

# ruff: noqa: F401 (the imports under TYPE_CHECKING are the public API's declaration, read by _declared)

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.engine.audit.changes.fields import candidate_spans
    from kvscope.engine.audit.ci.gate import budget_lines, rewrite_markdown
    from kvscope.engine.audit.endpoint.client import EndpointClient, EndpointSettings
    from kvscope.engine.audit.endpoint.served_measure import measure_rewrite_on_endpoint
    from kvscope.engine.audit.logs.reading import parse_prompt, read_log
    from kvscope.engine.audit.logs.render import RenderedRequest, render_request
    from kvscope.engine.audit.logs.requests import Request, RequestLogError
    from kvscope.engine.audit.measure.notes_scenario import NotesChoice, NotesScenario, notes_choices, notes_scenario, preferred_choice
    from kvscope.engine.audit.measure.repairs import REPAIR_SUMMARIES
    from kvscope.engine.audit.measure.settings import MeasureSettings, check_repairs, measure_settings
    from kvscope.engine.audit.measure.traffic import DEFAULT_SAMPLE, audit_traffic, pending_report
    from kvscope.engine.audit.measure.turn import AuditReport, audit_value, repaired_template, scenario_toml
    from kvscope.engine.audit.policy.build import policy_from_report
    from kvscope.engine.audit.policy.document import Policy
    from kvscope.engine.audit.policy.gateway import hook_config
    from kvscope.engine.audit.prompts.repair_requests import GRAINS, REPAIRS
    from kvscope.engine.audit.prompts.text_spans import appended_chars, candidate_menu, candidate_span, find_span, prefix_cache_stop
    from kvscope.engine.audit.rewrite.measure import apply_template, measure_rewrite
    from kvscope.engine.audit.scan.sampling import bounded_sample, traffic_scan
    from kvscope.engine.audit.scan.settings import ScanSettings
    from kvscope.engine.audit.simulate.budgets import ModelKV, ServerSize
    from kvscope.engine.audit.simulate.caches import CacheSettings
    from kvscope.engine.audit.simulate.fleet import fleet_grid
    from kvscope.engine.audit.simulate.observed import OBSERVED_ENGINES, fit_observed
    from kvscope.engine.audit.simulate.registry import DEFAULT_ENGINE, budgets
    from kvscope.engine.cache.budget import Cancelled, CancelToken, ComputeGate, WorkBudget, bounded, cancellable, waits_reported
    from kvscope.engine.cache.decision import DECISIVE_MARGIN
    from kvscope.engine.cache.footprint import tensor_bytes
    from kvscope.engine.cache.interop import load_cache, save_cache, to_dynamic_cache
    from kvscope.engine.cache.loaded import LoadedTokenizer
    from kvscope.engine.cache.lru import BudgetedLRU
    from kvscope.engine.cache.notebook import Knockout, Notebook
    from kvscope.engine.cache.selftest import SelfTestReport, run_selftest
    from kvscope.engine.cache.vision import check_vision_model
    from kvscope.engine.checks.support import SupportRow, check_model
    from kvscope.engine.comparison import compare_models
    from kvscope.engine.compose.agent import run_agent
    from kvscope.engine.compose.calibration import AUTO as AUTO_REMEDY
    from kvscope.engine.compose.calibration import (
        ModelRemedies,
        calibrated_remedy,
        cancel_calibration,
        model_remedies,
        resolve_remedy,
        stored_choice,
    )
    from kvscope.engine.compose.choice import RemedyChoice
    from kvscope.engine.compose.fidelity import compare
    from kvscope.engine.compose.keystone import keystone
    from kvscope.engine.compose.pictures import IMAGE_QUESTION, bundled_images, compare_image
    from kvscope.engine.compose.placing import PLACEMENTS, adhoc_scenario, compose_scenario
    from kvscope.engine.compose.remedy import DEFAULT_REMEDY, Remedy
    from kvscope.engine.compose.skills import SkillStore
    from kvscope.engine.compose.study import REMEDIES as STUDY_REMEDIES
    from kvscope.engine.compose.study import first_field_values, run_study, skill_prefixes
    from kvscope.engine.compose.ttft import TtftRow, ttft_by_length
    from kvscope.engine.edit.experiment import EditExperiment
    from kvscope.engine.edit.hybrid import read_scenario
    from kvscope.engine.edit.lora import LoraSettings
    from kvscope.engine.edit.report import EditReport
    from kvscope.engine.edit.rome import RomeSettings
    from kvscope.engine.edit.runs import ScenarioRun, run_scenario
    from kvscope.engine.edit.strategies import RENAMED as RENAMED_STRATEGIES
    from kvscope.engine.edit.strategies import STRATEGIES, EditSettings
    from kvscope.engine.edit.weight_edit import METHODS as WEIGHT_METHODS
    from kvscope.engine.edit.weight_edit import compare_edits
    from kvscope.engine.errors import KVScopeError, Unreachable
    from kvscope.engine.models import (
        DTYPES,
        HOST_OPT_IN_ALIASES,
        LoadedModel,
        accelerator_dtype,
        available_offline,
        dtype_name,
        expected_parameter_bytes,
        is_offline_alias,
        load_model,
        load_tokenizer,
        offline_aliases,
        resolve_device,
    )
    from kvscope.engine.models.tiny import tiny_model
    from kvscope.engine.once import SingleFlight
    from kvscope.engine.probes.analysis import DEFAULT_STRATEGIES, analyse_edit
    from kvscope.engine.probes.frontier import probe_frontier
    from kvscope.engine.probes.registry import PROBES
    from kvscope.engine.progress import MessageProgress, StepMessage, StepProgress, duration_words, fraction, rated
    from kvscope.engine.reproduce import Recipe, recipe_settings, script_text
    from kvscope.engine.reproduce import matches as recipe_matches
    from kvscope.engine.reproduce import notebook as recipe_notebook
    from kvscope.engine.scenario import Scenario, Skill, bundled_logs, bundled_scenarios, bundled_skills


def _declared() -> dict[str, str]:
    """Each public name -> its module, or "module:attribute" where the public name differs: the TYPE_CHECKING imports, parsed."""
    guard = next(node for node in ast.parse(Path(__file__).read_text(encoding="utf-8")).body if isinstance(node, ast.If))
    return {
        alias.asname or alias.name: f"{node.module}:{alias.name}" if alias.asname else str(node.module)
        for node in guard.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


_PUBLIC = _declared()
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvscope.engine' has no attribute {name!r}")
    module, _, attribute = _PUBLIC[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
