"""Headless CLI: ``python -m engine
info|selftest|support|decide|edit|calibrate|probe|compose|image|agent|keystone|memory|weights|audit|compare-models``.

With ``--json`` exactly one JSON object goes to stdout (an ``{"error": ...}`` object and exit code 2 on
bad input); logs and progress go to stderr.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from engine.audit.audit import (
    DEFAULT_MIN_AGREEMENT,
    DEFAULT_THRESHOLD,
    DEFAULT_TOKENS,
    audit_value,
    repaired_template,
    scenario_toml,
)
from engine.audit.caches import CacheSettings
from engine.audit.formats import AUTO as AUTO_FORMAT
from engine.audit.formats import FORMATS
from engine.audit.gate import QUANTITIES, exit_code, gate, markdown, parse_conditions
from engine.audit.repairs import GRAINS, PROMPT_REPAIRS, REPAIRS
from engine.audit.requests import RequestLog, RequestLogError, parse_prompt, read_log
from engine.audit.rewrite import apply_template, check_pairing, measure_rewrite
from engine.audit.spans import find_span
from engine.audit.traffic import DEFAULT_SAMPLE, audit_traffic
from engine.cache.selftest import run_selftest
from engine.checks.support import (
    OPERATIONS,
    TOLERANCE,
    check_model,
    markdown_table,
    support_matrix,
)
from engine.comparison import SPLICE_SKILL, compare_models
from engine.compose.agent import Compaction, run_agent
from engine.compose.calibration import AUTO, calibrated_remedy, resolve_remedy
from engine.compose.fidelity import compare
from engine.compose.keystone import keystone
from engine.compose.memory import memory_placement
from engine.compose.pictures import (
    IMAGE_QUESTION,
    bundled_images,
    compare_image,
    load_picture,
)
from engine.compose.placing import adhoc_scenario, with_skills
from engine.compose.remedy import DEFAULT_REMEDY, Remedy
from engine.compose.skills import SkillStore
from engine.edit.calibrate import (
    FLIP_THRESHOLD,
    NOTES_DEMO_MAX_RECOVERY,
    calibrate,
    scenario_files,
)
from engine.edit.erratum import WORDINGS as ERRATUM_WORDINGS
from engine.edit.experiment import EditExperiment
from engine.edit.hybrid import hybrid_edit, read_scenario
from engine.edit.lora import LoraSettings
from engine.edit.rome import RomeSettings
from engine.edit.runs import run_scenario
from engine.edit.strategies import STRATEGIES, EditSettings, check_names
from engine.edit.weight_edit import METHODS as WEIGHT_METHODS
from engine.edit.weight_edit import compare_edits
from engine.errors import KVScopeError
from engine.models import LoadedModel, ModelLoadError, cache_dir, load_model
from engine.models.tiny import HYBRID_ARCHS, TINY_ARCHS
from engine.probes.registry import PROBES
from engine.progress import StepProgress
from engine.scenario import Scenario, ScenarioError, bundled_scenarios


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _load(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, device=args.device, dtype=args.dtype, progress=_log)


def cmd_info(args: argparse.Namespace) -> dict:
    """Model card: architecture, sizes, RoPE, device, dtype, fingerprint."""
    return _load(args).info()


def cmd_selftest(args: argparse.Namespace) -> dict:
    """RoPE round trip, reposition-vs-prefill, splice identity and chunked prefill errors."""
    return run_selftest(_load(args)).as_dict()


def cmd_support(args: argparse.Namespace) -> dict:
    """Support matrix: every operation on every tiny family against ground truth (and the loaded model with --loaded)."""
    families = tuple(name.strip() for name in args.families.split(",")) if args.families else TINY_ARCHS + HYBRID_ARCHS
    unknown = [name for name in families if name not in TINY_ARCHS + HYBRID_ARCHS]
    if unknown:
        raise ModelLoadError(f"unknown family {unknown[0]!r} in --families; choose from: {', '.join(TINY_ARCHS + HYBRID_ARCHS)}")
    rows = support_matrix(families, progress=_log)
    loaded = check_model(_load(args)) if args.loaded else None
    if args.markdown and not args.json:
        print(markdown_table(rows + ([loaded] if loaded else [])))
        return {}
    return {
        "tolerance": TOLERANCE,
        "operations": list(OPERATIONS),
        "families": [row.as_dict() for row in rows],
        "loaded": loaded.as_dict() if loaded else None,
    }


def _parse_pairs(pairs: list[str], flag: str, form: str, value: Callable[[str], object] = str) -> dict:
    """The ``NAME=VALUE`` arguments of a repeatable ``flag`` by name, each value read by ``value``."""
    values = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ScenarioError(f"{flag} expects {form}, got {pair!r}")
        values[name.strip()] = value(text)
    return values


def cmd_decide(args: argparse.Namespace) -> dict:
    """Prefill a scenario with chosen field values and read the decision."""
    scenario = Scenario.load(args.scenario)
    values = _parse_pairs(args.set, "--set", "FIELD=VALUE")
    scenario.values_with(**values)  # validate field names before the (slow) model load
    lm = _load(args)
    if lm.recurrent_layers:
        return {"model": lm.fingerprint.name, **read_scenario(lm, scenario, values).as_dict(), "hybrid": True}
    return {"model": lm.fingerprint.name, **run_scenario(lm, scenario, values).as_dict()}


SETTING_FLAGS = {"topk": "top_k", "ranking": "ranking", "cot_tokens": "cot_tokens", "erratum": "erratum"}
"""Edit flags that set :class:`EditSettings` fields, dest → field; where one is absent or empty the field keeps its default."""


def _settings(args: argparse.Namespace) -> EditSettings:
    options = {name: getattr(args, dest) for dest, name in SETTING_FLAGS.items() if getattr(args, dest, None) not in (None, "")}
    return EditSettings(**options)


def cmd_edit(args: argparse.Namespace) -> dict:
    """Change a field old → new and compare every edit strategy's decision and recovery."""
    scenario = Scenario.load(args.scenario)
    names = check_names(name.strip() for name in args.strategies.split(",")) if args.strategies else list(STRATEGIES)
    scenario.field(args.field)
    settings = _settings(args)
    lm = _load(args)
    if lm.recurrent_layers:
        return hybrid_edit(lm, scenario, args.field, args.new, names, settings.erratum).as_dict()
    experiment = EditExperiment(lm, scenario, args.field, args.new, settings)
    return experiment.report(names, progress=_progress("strategies"), fused=args.fused, downstream_patch=True).as_dict()


def cmd_calibrate(args: argparse.Namespace) -> dict:
    """Check which scenarios' decisions flip with their field on this model (clean prefills)."""
    files = scenario_files(args.scenarios or list(bundled_scenarios().values()))
    lm = _load(args)
    results = calibrate(lm, files, args.threshold, progress=_progress("scenarios"))
    return {
        "model": lm.fingerprint.name,
        "threshold": args.threshold,
        "flipping": sum(r.flips for r in results),
        "notes_demos": sum(r.notes_demo for r in results),
        "notes_demo_max_field_recovery": NOTES_DEMO_MAX_RECOVERY,
        "total": len(results),
        "scenarios": [r.as_dict() for r in results],
    }


def _option_value(text: str):
    """A --opt value: JSON where it parses (numbers, booleans, lists), else the raw string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def cmd_probe(args: argparse.Namespace) -> dict:
    """Run one causal probe on a scenario's field change (see engine/probes/ for each probe's options)."""
    if args.name not in PROBES:
        raise ScenarioError(f"unknown probe {args.name!r}; choose from {', '.join(PROBES)}")
    scenario = Scenario.load(args.scenario)
    scenario.field(args.field)
    options = _parse_pairs(args.opt, "--opt", "KEY=VALUE", _option_value)
    accepted = [p for p in inspect.signature(PROBES[args.name]).parameters if p not in ("experiment", "source", "progress")]
    unknown = [key for key in options if key not in accepted]
    if unknown:
        raise ScenarioError(f"probe {args.name!r} has no option {unknown[0]!r}; options: {', '.join(accepted) or 'none'}")
    lm = _load(args)
    experiment = EditExperiment(lm, scenario, args.field, args.new)
    result = PROBES[args.name](experiment, progress=_progress(args.name), **options)
    return {
        "model": lm.fingerprint.name,
        "probe": args.name,
        "scenario": scenario.name,
        "field": experiment.field,
        "old": experiment.old,
        "new": experiment.new,
        **result.as_dict(),
    }


def _composition(args: argparse.Namespace) -> Scenario:
    skills = [s.strip() for s in args.skills.split(",") if s.strip()] if args.skills else []
    if args.scenario:
        scenario = Scenario.load(args.scenario)
        return with_skills(scenario, skills, args.at) if skills else scenario
    if not skills:
        raise ScenarioError("give --scenario FILE (placing skills with {skill:ID}) or --skills id,id")
    return adhoc_scenario(skills)


def _store() -> SkillStore:
    return SkillStore(cache_dir() / "skills")


def cmd_compose(args: argparse.Namespace) -> dict:
    """Splice precompiled skills into a context and compare with a full recompute (fidelity, TTFT)."""
    scenario = _composition(args)
    lm = _load(args)
    store = _store()
    remedy = resolve_remedy(lm, args.remedy, store, _log)
    result = {"model": lm.fingerprint.name, **compare(lm, scenario, store, remedy=remedy, reps=args.reps, warmup=1).as_dict()}
    if args.remedy.strip() == AUTO:
        result["remedy_choice"] = calibrated_remedy(lm, store).as_dict()
    return result


def cmd_image(args: argparse.Namespace) -> dict:
    """Splice a picture's stored K/V into a context vs a full recompute from pixels (vision-language models)."""
    path = bundled_images().get(args.image, args.image)
    pixels = load_picture(path)
    lm = _load(args)
    result = compare_image(
        lm, pixels, Path(path).stem, before=args.before, after=args.after, question=args.question, seam=args.seam, reps=args.reps, warmup=1
    )
    return {"model": lm.fingerprint.name, **result.as_dict()}


def cmd_agent(args: argparse.Namespace) -> dict:
    """Multi-turn episode: compose once, errata per turn (compacted by --policy), against the clean-state prefill
    and the identical-token re-prefill every turn."""
    scenario = _composition(args)
    fields = [name.strip() for name in args.fields.split(",")] if args.fields else [scenario.field(args.field).name]
    for name in fields:
        scenario.field(name)
    policy = Compaction.parse(args.policy)
    lm = _load(args)
    store = _store()
    report = run_agent(
        lm,
        scenario,
        store,
        turns=args.turns,
        fields=fields,
        toggle=args.toggle,
        remedy=resolve_remedy(lm, args.remedy, store, _log),
        policy=policy,
        wording=args.wording,
        progress=_progress("turns"),
    )
    return {"model": lm.fingerprint.name, **report.as_dict()}


def cmd_keystone(args: argparse.Namespace) -> dict:
    """Edit a field inside a spliced skill: every strategy on the composed vs the recomputed cache."""
    scenario = _composition(args)
    lm = _load(args)
    store = _store()
    report = keystone(
        lm,
        scenario,
        store,
        field_name=args.field,
        remedy=resolve_remedy(lm, args.remedy, store, _log),
        settings=_settings(args),
        progress=_progress("strategies"),
    )
    return {"model": lm.fingerprint.name, **report.as_dict()}


def cmd_memory(args: argparse.Namespace) -> dict:
    """A user-memory skill at the start vs the end: edit cost, transplant fidelity."""
    scenario = _composition(args)
    lm = _load(args)
    return {"model": lm.fingerprint.name, **memory_placement(lm, scenario, _store(), skill_id=args.memory_skill, seam=args.seam).as_dict()}


def cmd_weights(args: argparse.Namespace) -> dict:
    """Weight editing (ROME, LoRA) beside field_erratum on one edit: efficacy, contamination, collateral, cost."""
    scenario = Scenario.load(args.scenario)
    paths = [p.strip() for p in args.others.split(",") if p.strip()] if args.others else list(bundled_scenarios().values())
    others = [Scenario.load(path) for path in paths]
    lora = LoraSettings(
        rank=args.lora_rank,
        steps=args.lora_steps,
        lr=args.lora_lr,
        modules=tuple(m.strip() for m in args.lora_modules.split(",") if m.strip()),
    )
    rome = RomeSettings(layer=args.rome_layer, steps=args.rome_steps)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    lm = _load(args)
    report = compare_edits(
        lm, scenario, others, field_name=args.field, new=args.new, methods=methods, lora=lora, rome=rome, progress=_progress("steps")
    )
    return report.as_dict()


def cmd_compare_models(args: argparse.Namespace) -> dict:
    """The same scenario and field edit on up to three models: notes share, recoveries, notes depth, read heads, splice cosine."""
    scenario = Scenario.load(args.scenario)
    result = compare_models(
        args.models.split(","),
        lambda spec: load_model(spec, device=args.device, dtype=args.dtype, progress=_log),
        scenario,
        args.field,
        args.new,
        skill=args.skill,
        remedy=Remedy.parse(args.remedy),
        progress=_log,
        steps=_progress("steps"),
    )
    return result.as_dict()


def _progress(unit: str) -> StepProgress:
    return lambda done, total: _log(f"{unit}: {done}/{total}")


def cmd_audit(args: argparse.Namespace) -> dict:
    """Audit a request log (or one prompt with --find/--new): a token pass over every request (sessions, matches, causes,
    simulated vLLM / SGLang / llama.cpp reuse), then every repair's cost and fidelity on --sample turns per change;
    with --rewritten / --template, the rewrite's reuse and output against the original's; --fail-on gates on it."""
    text = _read_text(args.log)
    conditions = parse_conditions(args.fail_on)
    if args.rewritten and args.template:
        raise RequestLogError("--rewritten and --template are two rewrites: measure one at a time")
    if args.template_repair and not args.template_out:
        raise RequestLogError("--template-repair names the repair whose template --template-out writes: add --template-out FILE")
    if (args.rewritten or args.template) and args.new is not None:
        raise RequestLogError("--rewritten and --template measure a log's rewrite; they do not combine with --new")
    options = {
        "repairs": _names(args.repairs) or REPAIRS,
        "tokens": args.tokens,
        "threshold": args.threshold,
        "min_agreement": args.min_agreement,
        "grain": args.grain,
    }
    lm = _load(args)
    if args.new is None:
        settings = CacheSettings(args.block_size, args.kv_budget_blocks, args.kv_budget_tokens, args.slots, args.cache_reuse)
        log = read_log(text, args.format)
        for skipped in log.skipped:
            _log(f"skipped {skipped.message}")
        steps = {"scan_progress": _progress("token pass: requests"), "progress": _progress("measured steps")}
        rewritten = _rewritten(args, log)
        traffic = audit_traffic(lm, log, sample=args.sample, settings=settings, **steps, **options)
        result, report = traffic.as_dict(), traffic.measured_report()
        if rewritten is not None:
            measured = measure_rewrite(lm, log, rewritten, settings=settings, tokens=args.tokens, progress=_progress("rewrite: requests"))
            result |= {"rewrite": [row.as_dict() for row in measured.requests], "verdict": measured.verdict()}
    else:
        request = parse_prompt(text)
        if not args.find:
            raise RequestLogError("--new needs --find TEXT: the value to change in the prompt")
        site = find_span(request, args.find)
        report = audit_value(lm, request, site.chars, args.new, message=site.message, progress=_progress("audit steps"), **options)
        result = report.as_dict()
    template = (args.template_out, lambda: repaired_template(report, args.template_repair))
    for path, build in ((args.scenario_out, lambda: scenario_toml(report)), template):
        if path:
            Path(path).write_text(build(), encoding="utf-8")
    if conditions:
        result["gate"] = gate(conditions, result)
    if args.markdown and not args.json:
        print(markdown(result), end="")
    return result


def _rewritten(args: argparse.Namespace, log: RequestLog) -> RequestLog | None:
    """The rewritten log of --rewritten, or --template applied to ``log`` (None without either), paired with ``log``."""
    if args.rewritten:
        rewritten = read_log(_read_text(args.rewritten), args.format)
    elif args.template:
        rewritten = apply_template(_read_text(args.template), log)
        changed = sum(old.contents != new.contents for old, new in zip(log.requests, rewritten.requests))
        kept = " (the others' prompt lacks its read lines, or is the template's already)" if changed < len(log.requests) else ""
        _log(f"template: {changed} of {len(log.requests)} requests rewritten{kept}")
    else:
        return None
    check_pairing(log.requests, rewritten.requests)
    return rewritten


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise RequestLogError(f"cannot read {path}: {error}") from None


def _names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


COMMANDS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "info": cmd_info,
    "selftest": cmd_selftest,
    "support": cmd_support,
    "decide": cmd_decide,
    "edit": cmd_edit,
    "calibrate": cmd_calibrate,
    "probe": cmd_probe,
    "compose": cmd_compose,
    "image": cmd_image,
    "agent": cmd_agent,
    "keystone": cmd_keystone,
    "memory": cmd_memory,
    "weights": cmd_weights,
    "audit": cmd_audit,
    "compare-models": cmd_compare_models,
}


Argument = tuple[tuple[str, ...], dict]


def _arg(*flags: str, **options) -> Argument:
    return flags, options


def _argument_groups() -> dict[str, tuple[tuple[Argument, ...], ...]]:
    """Every subcommand's own flags, as the groups it takes in order (each group declared once)."""
    scenario = (_arg("--scenario", required=True, help="scenario TOML file"),)
    change = (_arg("--field", help="field to change (default: the first)"), _arg("--new", help="new value (default: the field's `new`)"))
    composition = (
        _arg("--scenario", help="scenario TOML file (may place skills with {skill:ID})"),
        _arg("--skills", help="comma-separated skill ids from demos/skills"),
        _arg("--at", default="start", help="where --skills go in a scenario: start, after_fields or end"),
    )
    remedy = (
        _arg(
            "--remedy",
            default=DEFAULT_REMEDY.name,
            help="repair of spliced skills, parts joined by +: prefix (compile after the scenario's system prompt), "
            "seam:N (first N tokens of each skill), tail:N (its last N tokens), aggregators, blend:F (top fraction F by "
            "layer-1 K/V deviation from a fresh prefill of layers 0–1, CacheBlend), query:F (top fraction F by the question's attention to "
            "the plain splice), cover:M (with blend or query: stop once the share M of its ranking's score is covered), "
            "deviation:F or causal:F (top fraction F ranked against the full recompute; compose only), "
            "or auto: this model's calibrated choice (measured once, minutes; kept in the cache dir)",
        ),
    )
    edited_field = (_arg("--field", help="the field to change (default: the first)"),)
    reps = (_arg("--reps", type=int, default=1, help="timed repetitions of each side, after one untimed warm-up (min, median, max)"),)
    support = (
        _arg("--loaded", action="store_true", help="also check the model named by --model"),
        _arg("--families", help="comma-separated tiny families (default: all)"),
        _arg("--markdown", action="store_true", help="print the matrix as a Markdown table instead (ignored with --json)"),
    )
    assignments = (_arg("--set", action="append", default=[], metavar="FIELD=VALUE", help="field value (repeatable)"),)
    edit = (
        _arg("--strategies", help=f"comma-separated subset of: {', '.join(STRATEGIES)}"),
        _arg("--topk", type=int, default=EditSettings.top_k, help="K for field_topk"),
        _arg("--ranking", default=EditSettings.ranking, help="field_topk ranking: causal or deviation"),
        _arg("--cot-tokens", type=int, default=EditSettings.cot_tokens, help="chain-of-thought length for field_only_cot"),
        _arg("--fused", action="store_true", help="read every strategy and the oracle in one forward (ms become shares)"),
        _arg("--erratum", help="erratum template with {field}, {new}, {old}"),
    )
    calibration = (
        _arg("scenarios", nargs="*", help="scenario files or directories (default: the bundled demos)"),
        _arg("--threshold", type=float, default=FLIP_THRESHOLD, help="minimum |Δmargin| that counts as a flip"),
    )
    probe_name = (_arg("name", help=f"one of: {', '.join(PROBES)}"),)
    probe_options = (
        _arg("--opt", action="append", default=[], metavar="KEY=VALUE", help="probe option, e.g. top=8, exact=true, find=..."),
    )
    image = (
        _arg("--image", default="shipping_label", help=f"image file, or a bundled one: {', '.join(bundled_images())}"),
        _arg("--before", default="", help="text before the picture (the block moves by its length)"),
        _arg("--after", default="", help="text after the picture, before the question"),
        _arg("--question", default=IMAGE_QUESTION, help="a yes/no question"),
        _arg("--seam", type=int, default=0, help="recompute the picture's first N tokens against the real prefix"),
    )
    agent = (
        _arg("--turns", type=int, default=12, help="state changes after the first turn"),
        _arg("--toggle", action="store_true", help="toggle old/new every turn (drift stress test)"),
        _arg("--fields", help="comma-separated fields changing in turn (default: --field)"),
        _arg("--policy", default="never", help="erratum compaction: never, every:K or adaptive[:R]"),
        _arg("--wording", default="override", choices=list(ERRATUM_WORDINGS), help="erratum wording"),
    )
    memory = (
        _arg("--seam", type=int, default=1, help="seam repair: recompute the first K tokens of each skill"),
        _arg("--memory-skill", default="user_memory", help="the memory skill id"),
    )
    weights = (
        _arg("--methods", default=",".join(WEIGHT_METHODS), help=f"comma-separated subset of: {', '.join(WEIGHT_METHODS)}"),
        _arg("--lora-rank", type=int, default=LoraSettings.rank, help="LoRA rank"),
        _arg("--lora-steps", type=int, default=LoraSettings.steps, help="LoRA optimisation steps (stops early once flipped)"),
        _arg("--lora-lr", type=float, default=LoraSettings.lr, help="LoRA learning rate"),
        _arg("--lora-modules", default=",".join(LoraSettings.modules), help="linear modules LoRA wraps, by name"),
        _arg("--rome-layer", type=int, help="MLP layer ROME edits (default: just before the notes map's strongest layer)"),
        _arg("--rome-steps", type=int, default=RomeSettings.steps, help="ROME value optimisation steps"),
        _arg("--others", help="comma-separated scenario files for collateral (default: every bundled scenario)"),
    )
    audit = (
        _arg("log", help="request log (JSONL or a JSON array, in any of --format's formats), or one prompt with --new"),
        _arg("--format", default=AUTO_FORMAT, choices=[AUTO_FORMAT, *FORMATS], help="the log's request format (auto: detected per record)"),
        _arg("--sample", type=int, default=DEFAULT_SAMPLE, help="turns measured with the model per change signature (0: token pass only)"),
        _arg("--block-size", type=int, default=CacheSettings.block, help="vLLM KV block size in tokens"),
        _arg("--kv-budget-blocks", type=int, help="vLLM KV budget in blocks (default: unbounded)"),
        _arg("--kv-budget-tokens", type=int, help="SGLang radix-cache budget in tokens (default: unbounded)"),
        _arg("--slots", type=int, help="llama.cpp server slots (default: one per session)"),
        _arg("--cache-reuse", type=int, default=0, help="llama.cpp --cache-reuse N: shift cached chunks of at least N tokens (0: off)"),
        _arg("--repairs", help=f"comma-separated subset of: {', '.join(REPAIRS)} (recompute always runs)"),
        _arg("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens generated per state"),
        _arg("--threshold", type=float, default=DEFAULT_THRESHOLD, help="largest next-token KL a recommended repair may have"),
        _arg("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT, help="smallest share of agreeing greedy tokens"),
        _arg("--grain", choices=GRAINS, help="coarsen date-times to this grain (the coarsen repair)"),
        _arg("--find", help="one prompt: the text of the value to change"),
        _arg("--new", help="one prompt: its new value (the file is then one prompt, not a log)"),
        _arg("--scenario-out", help="write the auto-built scenario TOML here (Notes tab, `edit`)"),
        _arg("--template-out", help="write the recommended prompt-level repair here, as the prompt template it measured"),
        _arg(
            "--template-repair", choices=PROMPT_REPAIRS, help="the prompt-level repair --template-out writes (default: the recommended one)"
        ),
        _arg("--rewritten", help="a rewrite of the log (same requests, same order): its reuse and output against the original's"),
        _arg("--template", help="a prompt template (as --template-out writes) applied to the log's values: the rewrite to measure"),
        _arg(
            "--fail-on",
            action="append",
            default=[],
            metavar="CONDITION",
            help=f"exit 1 when a condition holds, e.g. reuse<0.5,kl>0.05 (over the rewrite if one is measured): {', '.join(QUANTITIES)}",
        ),
        _arg("--markdown", action="store_true", help="print a Markdown summary for a pull-request comment (ignored with --json)"),
    )
    comparison = (
        _arg("--models", required=True, help="comma-separated specs of 1 to 3 models (e.g. embedded,qwen-1.5b,smollm2), loaded in turn"),
        _arg("--skill", default=SPLICE_SKILL, help="the skill spliced before the scenario for the splice cosine"),
    )
    return {
        "audit": (audit,),
        "support": (support,),
        "decide": (scenario, assignments),
        "edit": (scenario, change, edit),
        "calibrate": (calibration,),
        "probe": (probe_name, scenario, change, probe_options),
        "compose": (composition, remedy, reps),
        "image": (reps, image),
        "agent": (composition, remedy, edited_field, agent),
        "keystone": (composition, remedy, edited_field),
        "memory": (composition, memory),
        "weights": (scenario, change, weights),
        "compare-models": (comparison, scenario, change, remedy),
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="embedded", help="alias (embedded, smollm2, qwen-1.5b, tiny-ARCH), HF id or local dir")
    common.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    common.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    common.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser = argparse.ArgumentParser(prog="python -m engine", description="KVScope engine: KV cache as a notebook.")
    commands = parser.add_subparsers(dest="command", required=True)
    groups = _argument_groups()
    for name, handler in COMMANDS.items():
        sub = commands.add_parser(name, parents=[common], help=handler.__doc__)
        for group in groups.get(name, ()):
            for flags, options in group:
                sub.add_argument(*flags, **options)
    return parser


def _print(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    try:
        result = COMMANDS[args.command](args)
    except KVScopeError as error:
        if args.json:
            print(json.dumps({"error": str(error), "type": type(error).__name__}))
        else:
            _log(f"error: {error}")
        return 2
    if not (getattr(args, "markdown", False) and not args.json):
        _print(result, args.json)
    return exit_code(result)
