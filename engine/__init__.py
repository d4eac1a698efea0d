"""KVScope engine: a model's KV cache as an editable, composable notebook (torch + transformers only).

The public API, what a notebook, a script or the app imports (``from engine import load_model, Scenario, ...``); the
app imports nothing else of the engine (an import contract in pyproject.toml holds it):

Models and scenarios

=========================  ======================================================================================
``load_model``             a model by alias (``embedded``, ``smollm2``, ``tiny-<arch>``), local directory or HF id
``LoadedModel``            a loaded model: tokenizer, config, device, dtype, fingerprint, ``info()``, its splice gate
``load_tokenizer``         a model's tokenizer and config without its weights (``LoadedTokenizer``: a token pass)
``tiny_model``             a tiny random-weight model of one family, for exact cache-math checks
``DTYPES``                 the dtypes a model loads in, by name; ``dtype_name`` names a torch dtype
``accelerator_dtype``      the dtype "auto" picks on a GPU (bfloat16 where supported, else float16)
``expected_parameter_bytes``  a model's parameter bytes before it loads (None when unknown)
``available_offline``      the specs that load without the hub; ``offline_aliases``, ``is_offline_alias``: the aliases
``HOST_OPT_IN_ALIASES``    aliases a public host offers only when it names them
``resolve_device``         ``auto``, ``cpu`` or ``cuda[:n]`` as a torch device
``Scenario``               a scenario file (TOML): context, fields, question, answers; ``bundled_scenarios()`` lists ours
``Skill``                  a skill file (TOML): a reusable block of context; ``bundled_skills()`` lists ours
``bundled_images``         the demo pictures; ``bundled_logs``: the demo request logs (by file stem)
``run_scenario``           prefill a scenario at given field values and read the decision (a ``ScenarioRun``)
``read_scenario``          a scenario's decision read on a hybrid (recurrent-layer) model's own cache
``DECISIVE_MARGIN``        a reference margin closer to 0 than this is a tie
=========================  ======================================================================================

Notebooks, edits and probes

=========================  ======================================================================================
``Notebook``               a context's K/V plus per-token ids, positions, segments and visibility; every cache operation
``Knockout``               positions (layers, heads) hidden from the decision
``EditExperiment``         one field change: stale, oracle, every repair strategy by name, into an ``EditReport``
``EditSettings``           the strategies' knobs (erratum wording, K and ranking of field_topk, chain-of-thought length)
``STRATEGIES``             every edit strategy by name; ``DEFAULT_STRATEGIES``: those an edit runs by default
``analyse_edit``           what the Notes tab shows for an edit: the report, the decision's attention, notes effects
``PROBES``                 every probe by name (notes map, knockout, read heads, linear probe, attribution, ...)
``probe_frontier``         recovery against computed tokens: field_topk over K and the strategies
``compare_edits``          weight editing (``LoraSettings``, ``RomeSettings``; ``WEIGHT_METHODS``) beside the erratum
``compare_models``         one edit on several models side by side, beside the paper's 7–9B values
=========================  ======================================================================================

Composing: skills spliced into contexts

=========================  ======================================================================================
``SkillStore``             compiled skill blocks (K/V computed once), in memory and optionally on disk
``Remedy``                 a splice's repair, parsed from its spec (``prefix+seam:1``); ``DEFAULT_REMEDY``, ``AUTO_REMEDY``
``compare``                splice skills into a context with a ``Remedy`` and compare with a full recompute
``compose_scenario``       literal text, skills and a bundled scenario (or ``adhoc_scenario``: a generic question)
``calibrated_remedy``      this model's default remedy, measured once (``RemedyChoice``: numbers, frontier, reason)
``resolve_remedy``         a remedy spec for a model (empty: the default, ``auto``: calibrated); ``stored_choice``,
                           ``cancel_calibration``: the calibration kept, and a running one stopped
``model_remedies``         a model's own menu (``ModelRemedies``): its stored study's default and numbers, else its
                           calibration, else ``DEFAULT_REMEDY``
``run_study``              the N-skill study (``skill_prefixes``, ``PLACEMENTS``, ``first_field_values``,
                           ``STUDY_REMEDIES``)
``keystone``               edit the field inside a spliced skill: composed vs recomputed per strategy
``run_agent``              a multi-turn episode with errata on a cached, composed context
``compare_image``          a picture's K/V spliced behind text vs a recompute from pixels (``check_vision_model``,
                           ``IMAGE_QUESTION``)
``ttft_by_length``         time to first token, splice vs full prefill, by skill length (``TtftRow``)
=========================  ======================================================================================

Auditing request logs

=========================  ======================================================================================
``read_log``               a request log (JSONL or a JSON array, many formats); ``parse_prompt``: one prompt
``Request``                one request; ``render_request`` renders it with the model's chat template (``RenderedRequest``)
``audit_traffic``          a log as traffic: the token pass, then every repair on a sample (``DEFAULT_SAMPLE``)
``fleet_grid``             the fleets (replicas, routing) a log is also simulated on, behind each router
``traffic_scan``           the token pass alone, as ``audit_traffic`` makes it (``pending_report``: shown while the
                           model pass runs on ``measure_settings``)
``bounded_sample``         the largest sample whose measured turns fit a host's bound
``audit_value``            one prompt with one value changed (``candidate_spans``, ``candidate_menu``,
                           ``candidate_span``, ``find_span``: where)
``AuditReport``            the measured turns; ``MeasureSettings``: repairs, greedy tokens and the bars, with defaults
``REPAIRS``                every audit repair by name (``REPAIR_SUMMARIES``: each in a line); ``GRAINS``: date-time grains
``CacheSettings``          the simulated engines' settings (vLLM blocks, SGLang budget, llama.cpp slots)
``OBSERVED_ENGINES``       the engines a log's observed cached tokens are compared with; ``fit_observed``: the cache
                           settings that reproduce them
``prefix_cache_stop``      where an exact prefix cache stops in a turn's text; ``appended_chars``: what was appended
``notes_scenario``         the scenario the Notes tab studies from an audit (``NotesScenario``); ``scenario_toml``
``notes_choices``          every changed field with its pre-check (``NotesChoice``); ``preferred_choice``: the default
``repaired_template``      the prompt template that keeps the cached prefix stable
``measure_rewrite``        a rewritten log (or ``apply_template``) against the original; ``rewrite_markdown``
``measure_rewrite_on_endpoint``  the same on an OpenAI-compatible endpoint (``EndpointClient``, ``EndpointSettings``)
``RequestLogError``        a log, prompt or audit refused, with the line and the reason
=========================  ======================================================================================

Checks, files and reproduction

=========================  ======================================================================================
``run_selftest``           the model's numeric check of re-rotation and splicing (``SelfTestReport``)
``check_model``            the model's row of the support matrix (``SupportRow``): every operation against its forward
``save_cache``             a notebook's K/V (transformers' layout) with positions, segments, visibility to safetensors
``load_cache``             a saved cache back into an exact notebook on the model that computed it
``to_dynamic_cache``       a notebook's visible entries as a transformers ``DynamicCache``, to continue generating
``Recipe``                 what computed a result; ``script_text`` and ``recipe_notebook`` rerun it,
                           ``recipe_matches`` says whether it computed a given result, ``recipe_settings``
``KVScopeError``           the base of every error meant for the user
``Unreachable``            a service the user named answers nothing (a ``KVScopeError``): final, reported at once
=========================  ======================================================================================

Serving: what a server shares between requests

=========================  ======================================================================================
``WorkBudget``             a request's bound on model work; ``bounded`` runs within it, taking turns at a ``ComputeGate``
``Cancelled``              work a person stopped between two forwards (a ``KVScopeError``: its message says what was kept)
``waits_reported``         within: each wait at the gate reported as a message
``cancellable``            within: every forward first checks a ``CancelToken``, raising ``Cancelled`` once it is cancelled
``BudgetedLRU``            entries kept within a byte budget, least recently used dropped first (``tensor_bytes``)
``SingleFlight``           computed-once entries: one computation, concurrent callers wait for it
``MessageProgress``        a progress callback taking messages; ``StepProgress``: (done, total); ``StepMessage``,
                           ``fraction``: a message that says how far its work is
=========================  ======================================================================================

Importing ``engine`` loads nothing and changes no process state: names resolve on first use, the CPU math
setting is applied by the first model load and the attention function is registered by the first forward.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module defining it, or "module:attribute" where the public name differs from the module's own
_PUBLIC = {
    "AUTO_REMEDY": "engine.compose.calibration:AUTO",
    "AuditReport": "engine.audit.measure.turn",
    "BudgetedLRU": "engine.cache.lru",
    "CacheSettings": "engine.audit.simulate.caches",
    "CancelToken": "engine.cache.budget",
    "Cancelled": "engine.cache.budget",
    "ComputeGate": "engine.cache.budget",
    "DECISIVE_MARGIN": "engine.cache.decision",
    "DEFAULT_REMEDY": "engine.compose.remedy",
    "DEFAULT_SAMPLE": "engine.audit.measure.traffic",
    "DEFAULT_STRATEGIES": "engine.probes.analysis",
    "DTYPES": "engine.models",
    "EditExperiment": "engine.edit.experiment",
    "EditReport": "engine.edit.report",
    "EditSettings": "engine.edit.strategies",
    "EndpointClient": "engine.audit.endpoint.client",
    "EndpointSettings": "engine.audit.endpoint.client",
    "GRAINS": "engine.audit.measure.repairs",
    "HOST_OPT_IN_ALIASES": "engine.models",
    "IMAGE_QUESTION": "engine.compose.pictures",
    "KVScopeError": "engine.errors",
    "Unreachable": "engine.errors",
    "Knockout": "engine.cache.notebook",
    "LoadedModel": "engine.models",
    "LoadedTokenizer": "engine.cache.loaded",
    "LoraSettings": "engine.edit.lora",
    "MeasureSettings": "engine.audit.measure.settings",
    "MessageProgress": "engine.progress",
    "Notebook": "engine.cache.notebook",
    "NotesScenario": "engine.audit.measure.notes",
    "OBSERVED_ENGINES": "engine.audit.simulate.observed",
    "NotesChoice": "engine.audit.measure.notes",
    "PLACEMENTS": "engine.compose.placing",
    "PROBES": "engine.probes.registry",
    "REPAIRS": "engine.audit.measure.repairs",
    "REPAIR_SUMMARIES": "engine.audit.measure.repairs",
    "Recipe": "engine.reproduce",
    "Remedy": "engine.compose.remedy",
    "RemedyChoice": "engine.compose.choice",
    "ModelRemedies": "engine.compose.calibration",
    "RenderedRequest": "engine.audit.logs.render",
    "Request": "engine.audit.logs.requests",
    "RequestLogError": "engine.audit.logs.requests",
    "RomeSettings": "engine.edit.rome",
    "STRATEGIES": "engine.edit.strategies",
    "RENAMED_STRATEGIES": "engine.edit.strategies:RENAMED",
    "STUDY_REMEDIES": "engine.compose.study:REMEDIES",
    "Scenario": "engine.scenario",
    "ScenarioRun": "engine.edit.runs",
    "SelfTestReport": "engine.cache.selftest",
    "SingleFlight": "engine.once",
    "Skill": "engine.scenario",
    "SkillStore": "engine.compose.skills",
    "StepMessage": "engine.progress",
    "StepProgress": "engine.progress",
    "SupportRow": "engine.checks.support",
    "TtftRow": "engine.compose.ttft",
    "WEIGHT_METHODS": "engine.edit.weight_edit:METHODS",
    "WorkBudget": "engine.cache.budget",
    "accelerator_dtype": "engine.models",
    "adhoc_scenario": "engine.compose.placing",
    "analyse_edit": "engine.probes.analysis",
    "appended_chars": "engine.audit.prompts.text_spans",
    "apply_template": "engine.audit.rewrite.measure",
    "audit_traffic": "engine.audit.measure.traffic",
    "audit_value": "engine.audit.measure.turn",
    "available_offline": "engine.models",
    "bounded": "engine.cache.budget",
    "cancellable": "engine.cache.budget",
    "bounded_sample": "engine.audit.scan.sampling",
    "traffic_scan": "engine.audit.scan.sampling",
    "pending_report": "engine.audit.measure.traffic",
    "measure_settings": "engine.audit.measure.settings",
    "bundled_images": "engine.compose.pictures",
    "bundled_logs": "engine.scenario",
    "bundled_scenarios": "engine.scenario",
    "bundled_skills": "engine.scenario",
    "calibrated_remedy": "engine.compose.calibration",
    "cancel_calibration": "engine.compose.calibration",
    "candidate_menu": "engine.audit.prompts.text_spans",
    "check_repairs": "engine.audit.measure.settings",
    "candidate_span": "engine.audit.prompts.text_spans",
    "candidate_spans": "engine.audit.changes.fields",
    "check_model": "engine.checks.support",
    "check_vision_model": "engine.cache.vision",
    "compare": "engine.compose.fidelity",
    "compare_edits": "engine.edit.weight_edit",
    "compare_image": "engine.compose.pictures",
    "compare_models": "engine.comparison",
    "compose_scenario": "engine.compose.placing",
    "dtype_name": "engine.models",
    "expected_parameter_bytes": "engine.models",
    "find_span": "engine.audit.prompts.text_spans",
    "fit_observed": "engine.audit.simulate.observed",
    "first_field_values": "engine.compose.study",
    "fleet_grid": "engine.audit.simulate.fleet",
    "fraction": "engine.progress",
    "is_offline_alias": "engine.models",
    "keystone": "engine.compose.keystone",
    "load_cache": "engine.cache.interop",
    "load_model": "engine.models",
    "load_tokenizer": "engine.models",
    "measure_rewrite": "engine.audit.rewrite.measure",
    "measure_rewrite_on_endpoint": "engine.audit.endpoint.model_pass",
    "notes_scenario": "engine.audit.measure.notes",
    "notes_choices": "engine.audit.measure.notes",
    "preferred_choice": "engine.audit.measure.notes",
    "offline_aliases": "engine.models",
    "parse_prompt": "engine.audit.logs.reading",
    "prefix_cache_stop": "engine.audit.prompts.text_spans",
    "probe_frontier": "engine.probes.frontier",
    "read_log": "engine.audit.logs.reading",
    "read_scenario": "engine.edit.hybrid",
    "recipe_matches": "engine.reproduce:matches",
    "recipe_notebook": "engine.reproduce:notebook",
    "recipe_settings": "engine.reproduce",
    "render_request": "engine.audit.logs.render",
    "repaired_template": "engine.audit.measure.turn",
    "resolve_device": "engine.models",
    "resolve_remedy": "engine.compose.calibration",
    "model_remedies": "engine.compose.calibration",
    "rewrite_markdown": "engine.audit.report.gate",
    "run_agent": "engine.compose.agent",
    "run_scenario": "engine.edit.runs",
    "run_selftest": "engine.cache.selftest",
    "run_study": "engine.compose.study",
    "save_cache": "engine.cache.interop",
    "scenario_toml": "engine.audit.measure.turn",
    "script_text": "engine.reproduce",
    "skill_prefixes": "engine.compose.study",
    "stored_choice": "engine.compose.calibration",
    "tensor_bytes": "engine.cache.footprint",
    "tiny_model": "engine.models.tiny",
    "to_dynamic_cache": "engine.cache.interop",
    "ttft_by_length": "engine.compose.ttft",
    "waits_reported": "engine.cache.budget",
}
__all__ = [
    "AUTO_REMEDY",
    "AuditReport",
    "BudgetedLRU",
    "CacheSettings",
    "CancelToken",
    "Cancelled",
    "ComputeGate",
    "DECISIVE_MARGIN",
    "DEFAULT_REMEDY",
    "DEFAULT_SAMPLE",
    "DEFAULT_STRATEGIES",
    "DTYPES",
    "EditExperiment",
    "EditReport",
    "EditSettings",
    "EndpointClient",
    "EndpointSettings",
    "GRAINS",
    "HOST_OPT_IN_ALIASES",
    "IMAGE_QUESTION",
    "KVScopeError",
    "Knockout",
    "LoadedModel",
    "LoadedTokenizer",
    "LoraSettings",
    "MeasureSettings",
    "MessageProgress",
    "ModelRemedies",
    "Notebook",
    "NotesChoice",
    "NotesScenario",
    "OBSERVED_ENGINES",
    "PLACEMENTS",
    "PROBES",
    "RENAMED_STRATEGIES",
    "REPAIRS",
    "REPAIR_SUMMARIES",
    "Recipe",
    "Remedy",
    "RemedyChoice",
    "RenderedRequest",
    "Request",
    "RequestLogError",
    "RomeSettings",
    "STRATEGIES",
    "STUDY_REMEDIES",
    "Scenario",
    "ScenarioRun",
    "SelfTestReport",
    "SingleFlight",
    "Skill",
    "SkillStore",
    "StepMessage",
    "StepProgress",
    "SupportRow",
    "TtftRow",
    "Unreachable",
    "WEIGHT_METHODS",
    "WorkBudget",
    "accelerator_dtype",
    "adhoc_scenario",
    "analyse_edit",
    "appended_chars",
    "apply_template",
    "audit_traffic",
    "audit_value",
    "available_offline",
    "bounded",
    "bounded_sample",
    "bundled_images",
    "bundled_logs",
    "bundled_scenarios",
    "bundled_skills",
    "calibrated_remedy",
    "cancel_calibration",
    "cancellable",
    "candidate_menu",
    "candidate_span",
    "candidate_spans",
    "check_model",
    "check_repairs",
    "check_vision_model",
    "compare",
    "compare_edits",
    "compare_image",
    "compare_models",
    "compose_scenario",
    "dtype_name",
    "expected_parameter_bytes",
    "find_span",
    "first_field_values",
    "fit_observed",
    "fleet_grid",
    "fraction",
    "is_offline_alias",
    "keystone",
    "load_cache",
    "load_model",
    "load_tokenizer",
    "measure_rewrite",
    "measure_rewrite_on_endpoint",
    "measure_settings",
    "model_remedies",
    "notes_choices",
    "notes_scenario",
    "offline_aliases",
    "parse_prompt",
    "pending_report",
    "preferred_choice",
    "prefix_cache_stop",
    "probe_frontier",
    "read_log",
    "read_scenario",
    "recipe_matches",
    "recipe_notebook",
    "recipe_settings",
    "render_request",
    "repaired_template",
    "resolve_device",
    "resolve_remedy",
    "rewrite_markdown",
    "run_agent",
    "run_scenario",
    "run_selftest",
    "run_study",
    "save_cache",
    "scenario_toml",
    "script_text",
    "skill_prefixes",
    "stored_choice",
    "tensor_bytes",
    "tiny_model",
    "to_dynamic_cache",
    "traffic_scan",
    "ttft_by_length",
    "waits_reported",
]

if TYPE_CHECKING:
    from engine.audit.changes.fields import candidate_spans
    from engine.audit.endpoint.client import EndpointClient, EndpointSettings
    from engine.audit.endpoint.model_pass import measure_rewrite_on_endpoint
    from engine.audit.logs.reading import parse_prompt, read_log
    from engine.audit.logs.render import RenderedRequest, render_request
    from engine.audit.logs.requests import Request, RequestLogError
    from engine.audit.measure.notes import NotesChoice, NotesScenario, notes_choices, notes_scenario, preferred_choice
    from engine.audit.measure.repairs import GRAINS, REPAIR_SUMMARIES, REPAIRS
    from engine.audit.measure.settings import MeasureSettings, check_repairs, measure_settings
    from engine.audit.measure.traffic import DEFAULT_SAMPLE, audit_traffic, pending_report
    from engine.audit.measure.turn import AuditReport, audit_value, repaired_template, scenario_toml
    from engine.audit.prompts.text_spans import appended_chars, candidate_menu, candidate_span, find_span, prefix_cache_stop
    from engine.audit.report.gate import rewrite_markdown
    from engine.audit.rewrite.measure import apply_template, measure_rewrite
    from engine.audit.scan.sampling import bounded_sample, traffic_scan
    from engine.audit.simulate.caches import CacheSettings
    from engine.audit.simulate.fleet import fleet_grid
    from engine.cache.budget import Cancelled, CancelToken, ComputeGate, WorkBudget, bounded, cancellable, waits_reported
    from engine.cache.decision import DECISIVE_MARGIN
    from engine.cache.footprint import tensor_bytes
    from engine.cache.interop import load_cache, save_cache, to_dynamic_cache
    from engine.cache.loaded import LoadedTokenizer
    from engine.cache.lru import BudgetedLRU
    from engine.cache.notebook import Knockout, Notebook
    from engine.cache.selftest import SelfTestReport, run_selftest
    from engine.cache.vision import check_vision_model
    from engine.checks.support import SupportRow, check_model
    from engine.comparison import compare_models
    from engine.compose.agent import run_agent
    from engine.compose.calibration import AUTO as AUTO_REMEDY
    from engine.compose.calibration import (
        ModelRemedies,
        calibrated_remedy,
        cancel_calibration,
        model_remedies,
        resolve_remedy,
        stored_choice,
    )
    from engine.compose.choice import RemedyChoice
    from engine.compose.fidelity import compare
    from engine.compose.keystone import keystone
    from engine.compose.pictures import IMAGE_QUESTION, bundled_images, compare_image
    from engine.compose.placing import PLACEMENTS, adhoc_scenario, compose_scenario
    from engine.compose.remedy import DEFAULT_REMEDY, Remedy
    from engine.compose.skills import SkillStore
    from engine.compose.study import REMEDIES as STUDY_REMEDIES
    from engine.compose.study import first_field_values, run_study, skill_prefixes
    from engine.compose.ttft import TtftRow, ttft_by_length
    from engine.edit.experiment import EditExperiment
    from engine.edit.hybrid import read_scenario
    from engine.edit.lora import LoraSettings
    from engine.edit.report import EditReport
    from engine.edit.rome import RomeSettings
    from engine.edit.runs import ScenarioRun, run_scenario
    from engine.edit.strategies import RENAMED as RENAMED_STRATEGIES
    from engine.edit.strategies import STRATEGIES, EditSettings
    from engine.edit.weight_edit import METHODS as WEIGHT_METHODS
    from engine.edit.weight_edit import compare_edits
    from engine.errors import KVScopeError, Unreachable
    from engine.models import (
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
    from engine.models.tiny import tiny_model
    from engine.once import SingleFlight
    from engine.probes.analysis import DEFAULT_STRATEGIES, analyse_edit
    from engine.probes.frontier import probe_frontier
    from engine.probes.registry import PROBES
    from engine.progress import MessageProgress, StepMessage, StepProgress, fraction
    from engine.reproduce import Recipe, recipe_settings, script_text
    from engine.reproduce import matches as recipe_matches
    from engine.reproduce import notebook as recipe_notebook
    from engine.scenario import Scenario, Skill, bundled_logs, bundled_scenarios, bundled_skills


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module, _, attribute = _PUBLIC[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
