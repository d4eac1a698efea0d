"""KVScope engine: a model's KV cache as an editable, composable notebook (torch + transformers only).

The public API, what a notebook, a script or the app imports (``from kvscope.engine import load_model, Scenario, ...``); the
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
``ScanSettings``           the token pass's settings: ``CacheSettings``, the observed engine (``DEFAULT_ENGINE``),
                           the fleets and the context limit, checked in its constructor
``OBSERVED_ENGINES``       the engines a log's observed cached tokens are compared with; ``fit_observed``: the cache
                           settings that reproduce them
``prefix_cache_stop``      where an exact prefix cache stops in a turn's text; ``appended_chars``: what was appended
``notes_scenario``         the scenario the Notes tab studies from an audit (``NotesScenario``); ``scenario_toml``
``notes_choices``          every changed field with its pre-check (``NotesChoice``); ``preferred_choice``: the default
``repaired_template``      the prompt template that keeps the cached prefix stable
``policy_from_report``     the measured repairs as a gateway's policy (``Policy``); ``hook_config``: the LiteLLM proxy's config
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
                           ``fraction``: a message that says how far its work is; ``duration_words``: time left;
                           ``rated``: (done, total) said with its rate and time left
=========================  ======================================================================================

Importing ``kvscope.engine`` loads nothing and changes no process state: names resolve on first use, the CPU math
setting is applied by the first model load and the attention function is registered by the first forward.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module defining it, or "module:attribute" where the public name differs from the module's own
_PUBLIC = {
    "AUTO_REMEDY": "kvscope.engine.compose.calibration:AUTO",
    "AuditReport": "kvscope.engine.audit.measure.turn",
    "BudgetedLRU": "kvscope.engine.cache.lru",
    "CacheSettings": "kvscope.engine.audit.simulate.caches",
    "CancelToken": "kvscope.engine.cache.budget",
    "Cancelled": "kvscope.engine.cache.budget",
    "ComputeGate": "kvscope.engine.cache.budget",
    "DECISIVE_MARGIN": "kvscope.engine.cache.decision",
    "DEFAULT_ENGINE": "kvscope.engine.audit.simulate.registry",
    "DEFAULT_REMEDY": "kvscope.engine.compose.remedy",
    "DEFAULT_SAMPLE": "kvscope.engine.audit.measure.traffic",
    "DEFAULT_STRATEGIES": "kvscope.engine.probes.analysis",
    "DTYPES": "kvscope.engine.models",
    "EditExperiment": "kvscope.engine.edit.experiment",
    "EditReport": "kvscope.engine.edit.report",
    "EditSettings": "kvscope.engine.edit.strategies",
    "EndpointClient": "kvscope.engine.audit.endpoint.client",
    "EndpointSettings": "kvscope.engine.audit.endpoint.client",
    "GRAINS": "kvscope.engine.audit.prompts.repair_requests",
    "HOST_OPT_IN_ALIASES": "kvscope.engine.models",
    "IMAGE_QUESTION": "kvscope.engine.compose.pictures",
    "KVScopeError": "kvscope.engine.errors",
    "ScanSettings": "kvscope.engine.audit.scan.settings",
    "Unreachable": "kvscope.engine.errors",
    "Knockout": "kvscope.engine.cache.notebook",
    "LoadedModel": "kvscope.engine.models",
    "LoadedTokenizer": "kvscope.engine.cache.loaded",
    "LoraSettings": "kvscope.engine.edit.lora",
    "MeasureSettings": "kvscope.engine.audit.measure.settings",
    "MessageProgress": "kvscope.engine.progress",
    "Notebook": "kvscope.engine.cache.notebook",
    "NotesScenario": "kvscope.engine.audit.measure.notes_scenario",
    "OBSERVED_ENGINES": "kvscope.engine.audit.simulate.observed",
    "NotesChoice": "kvscope.engine.audit.measure.notes_scenario",
    "PLACEMENTS": "kvscope.engine.compose.placing",
    "PROBES": "kvscope.engine.probes.registry",
    "REPAIRS": "kvscope.engine.audit.prompts.repair_requests",
    "REPAIR_SUMMARIES": "kvscope.engine.audit.measure.repairs",
    "Recipe": "kvscope.engine.reproduce",
    "Remedy": "kvscope.engine.compose.remedy",
    "RemedyChoice": "kvscope.engine.compose.choice",
    "ModelRemedies": "kvscope.engine.compose.calibration",
    "RenderedRequest": "kvscope.engine.audit.logs.render",
    "Request": "kvscope.engine.audit.logs.requests",
    "RequestLogError": "kvscope.engine.audit.logs.requests",
    "RomeSettings": "kvscope.engine.edit.rome",
    "STRATEGIES": "kvscope.engine.edit.strategies",
    "RENAMED_STRATEGIES": "kvscope.engine.edit.strategies:RENAMED",
    "STUDY_REMEDIES": "kvscope.engine.compose.study:REMEDIES",
    "Scenario": "kvscope.engine.scenario",
    "ScenarioRun": "kvscope.engine.edit.runs",
    "SelfTestReport": "kvscope.engine.cache.selftest",
    "SingleFlight": "kvscope.engine.once",
    "Skill": "kvscope.engine.scenario",
    "SkillStore": "kvscope.engine.compose.skills",
    "StepMessage": "kvscope.engine.progress",
    "StepProgress": "kvscope.engine.progress",
    "SupportRow": "kvscope.engine.checks.support",
    "TtftRow": "kvscope.engine.compose.ttft",
    "WEIGHT_METHODS": "kvscope.engine.edit.weight_edit:METHODS",
    "WorkBudget": "kvscope.engine.cache.budget",
    "accelerator_dtype": "kvscope.engine.models",
    "adhoc_scenario": "kvscope.engine.compose.placing",
    "analyse_edit": "kvscope.engine.probes.analysis",
    "appended_chars": "kvscope.engine.audit.prompts.text_spans",
    "apply_template": "kvscope.engine.audit.rewrite.measure",
    "audit_traffic": "kvscope.engine.audit.measure.traffic",
    "audit_value": "kvscope.engine.audit.measure.turn",
    "available_offline": "kvscope.engine.models",
    "bounded": "kvscope.engine.cache.budget",
    "cancellable": "kvscope.engine.cache.budget",
    "bounded_sample": "kvscope.engine.audit.scan.sampling",
    "traffic_scan": "kvscope.engine.audit.scan.sampling",
    "pending_report": "kvscope.engine.audit.measure.traffic",
    "measure_settings": "kvscope.engine.audit.measure.settings",
    "bundled_images": "kvscope.engine.compose.pictures",
    "bundled_logs": "kvscope.engine.scenario",
    "bundled_scenarios": "kvscope.engine.scenario",
    "bundled_skills": "kvscope.engine.scenario",
    "calibrated_remedy": "kvscope.engine.compose.calibration",
    "cancel_calibration": "kvscope.engine.compose.calibration",
    "candidate_menu": "kvscope.engine.audit.prompts.text_spans",
    "check_repairs": "kvscope.engine.audit.measure.settings",
    "candidate_span": "kvscope.engine.audit.prompts.text_spans",
    "candidate_spans": "kvscope.engine.audit.changes.fields",
    "check_model": "kvscope.engine.checks.support",
    "check_vision_model": "kvscope.engine.cache.vision",
    "compare": "kvscope.engine.compose.fidelity",
    "compare_edits": "kvscope.engine.edit.weight_edit",
    "compare_image": "kvscope.engine.compose.pictures",
    "compare_models": "kvscope.engine.comparison",
    "compose_scenario": "kvscope.engine.compose.placing",
    "dtype_name": "kvscope.engine.models",
    "duration_words": "kvscope.engine.progress",
    "rated": "kvscope.engine.progress",
    "budget_lines": "kvscope.engine.audit.ci.gate",
    "budgets": "kvscope.engine.audit.simulate.registry",
    "ModelKV": "kvscope.engine.audit.simulate.budgets",
    "ServerSize": "kvscope.engine.audit.simulate.budgets",
    "expected_parameter_bytes": "kvscope.engine.models",
    "find_span": "kvscope.engine.audit.prompts.text_spans",
    "fit_observed": "kvscope.engine.audit.simulate.observed",
    "first_field_values": "kvscope.engine.compose.study",
    "fleet_grid": "kvscope.engine.audit.simulate.fleet",
    "fraction": "kvscope.engine.progress",
    "is_offline_alias": "kvscope.engine.models",
    "keystone": "kvscope.engine.compose.keystone",
    "load_cache": "kvscope.engine.cache.interop",
    "load_model": "kvscope.engine.models",
    "load_tokenizer": "kvscope.engine.models",
    "measure_rewrite": "kvscope.engine.audit.rewrite.measure",
    "measure_rewrite_on_endpoint": "kvscope.engine.audit.endpoint.served_measure",
    "notes_scenario": "kvscope.engine.audit.measure.notes_scenario",
    "notes_choices": "kvscope.engine.audit.measure.notes_scenario",
    "preferred_choice": "kvscope.engine.audit.measure.notes_scenario",
    "offline_aliases": "kvscope.engine.models",
    "parse_prompt": "kvscope.engine.audit.logs.reading",
    "prefix_cache_stop": "kvscope.engine.audit.prompts.text_spans",
    "probe_frontier": "kvscope.engine.probes.frontier",
    "read_log": "kvscope.engine.audit.logs.reading",
    "read_scenario": "kvscope.engine.edit.hybrid",
    "recipe_matches": "kvscope.engine.reproduce:matches",
    "recipe_notebook": "kvscope.engine.reproduce:notebook",
    "recipe_settings": "kvscope.engine.reproduce",
    "render_request": "kvscope.engine.audit.logs.render",
    "repaired_template": "kvscope.engine.audit.measure.turn",
    "policy_from_report": "kvscope.engine.audit.policy.build",
    "hook_config": "kvscope.engine.audit.policy.gateway",
    "Policy": "kvscope.engine.audit.policy.document",
    "resolve_device": "kvscope.engine.models",
    "resolve_remedy": "kvscope.engine.compose.calibration",
    "model_remedies": "kvscope.engine.compose.calibration",
    "rewrite_markdown": "kvscope.engine.audit.ci.gate",
    "run_agent": "kvscope.engine.compose.agent",
    "run_scenario": "kvscope.engine.edit.runs",
    "run_selftest": "kvscope.engine.cache.selftest",
    "run_study": "kvscope.engine.compose.study",
    "save_cache": "kvscope.engine.cache.interop",
    "scenario_toml": "kvscope.engine.audit.measure.turn",
    "script_text": "kvscope.engine.reproduce",
    "skill_prefixes": "kvscope.engine.compose.study",
    "stored_choice": "kvscope.engine.compose.calibration",
    "tensor_bytes": "kvscope.engine.cache.footprint",
    "tiny_model": "kvscope.engine.models.tiny",
    "to_dynamic_cache": "kvscope.engine.cache.interop",
    "ttft_by_length": "kvscope.engine.compose.ttft",
    "waits_reported": "kvscope.engine.cache.budget",
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
    "DEFAULT_ENGINE",
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
    "ModelKV",
    "ModelRemedies",
    "Notebook",
    "NotesChoice",
    "NotesScenario",
    "OBSERVED_ENGINES",
    "PLACEMENTS",
    "PROBES",
    "Policy",
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
    "ScanSettings",
    "Scenario",
    "ScenarioRun",
    "SelfTestReport",
    "ServerSize",
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
    "budget_lines",
    "budgets",
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
    "duration_words",
    "expected_parameter_bytes",
    "find_span",
    "first_field_values",
    "fit_observed",
    "fleet_grid",
    "fraction",
    "hook_config",
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
    "policy_from_report",
    "preferred_choice",
    "prefix_cache_stop",
    "probe_frontier",
    "rated",
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


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'kvscope.engine' has no attribute {name!r}")
    module, _, attribute = _PUBLIC[name].partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
