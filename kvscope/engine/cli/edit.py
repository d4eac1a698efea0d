"""Commands on one scenario's field edit: the decision, every edit strategy, which scenarios flip, a causal probe, and
weight editing beside the cache edit."""

from __future__ import annotations

import argparse
import inspect
import json

from kvscope.engine.cli.common import CHANGE, SCENARIO, Group, Handler, arg, load, parse_pairs, progress
from kvscope.engine.cli.common import names as names_of
from kvscope.engine.edit.calibrate import FLIP_THRESHOLD, NOTES_DEMO_MAX_RECOVERY, calibrate, scenario_files
from kvscope.engine.edit.experiment import EditExperiment
from kvscope.engine.edit.hybrid import hybrid_edit, read_scenario
from kvscope.engine.edit.lora import LoraSettings
from kvscope.engine.edit.rome import RomeSettings
from kvscope.engine.edit.runs import run_scenario
from kvscope.engine.edit.strategies import STRATEGIES, EditSettings, check_names
from kvscope.engine.edit.weight_edit import METHODS as WEIGHT_METHODS
from kvscope.engine.edit.weight_edit import compare_edits
from kvscope.engine.probes.registry import PROBES
from kvscope.engine.scenario import Scenario, ScenarioError, bundled_scenarios

SETTING_FLAGS = {"topk": "top_k", "ranking": "ranking", "cot_tokens": "cot_tokens", "erratum": "erratum"}
"""Edit flags that set :class:`EditSettings` fields, dest → field; where one is absent or empty the field keeps its default."""


def edit_settings(args: argparse.Namespace) -> EditSettings:
    """The strategies' knobs from the flags given (``edit``, ``keystone``)."""
    options = {name: getattr(args, dest) for dest, name in SETTING_FLAGS.items() if getattr(args, dest, None) not in (None, "")}
    return EditSettings(**options)


def cmd_decide(args: argparse.Namespace) -> dict:
    """Prefill a scenario with chosen field values and read the decision."""
    scenario = Scenario.load(args.scenario)
    values = parse_pairs(args.set, "--set", "FIELD=VALUE")
    scenario.values_with(**values)  # validate field names before the (slow) model load
    lm = load(args)
    if lm.recurrent_layers:
        return {"model": lm.fingerprint.name, **read_scenario(lm, scenario, values).as_dict(), "hybrid": True}
    return {"model": lm.fingerprint.name, **run_scenario(lm, scenario, values).as_dict()}


def cmd_edit(args: argparse.Namespace) -> dict:
    """Change a field old → new and compare every edit strategy's decision and recovery."""
    scenario = Scenario.load(args.scenario)
    names = check_names(names_of(args.strategies)) if args.strategies else list(STRATEGIES)
    scenario.field(args.field)
    settings = edit_settings(args)
    lm = load(args)
    if lm.recurrent_layers:
        return hybrid_edit(lm, scenario, args.field, args.new, names, settings.erratum).as_dict()
    experiment = EditExperiment(lm, scenario, args.field, args.new, settings)
    return experiment.report(names, progress=progress("strategies"), fused=args.fused, downstream_patch=True).as_dict()


def cmd_calibrate(args: argparse.Namespace) -> dict:
    """Check which scenarios' decisions flip with their field on this model (clean prefills)."""
    files = scenario_files(args.scenarios or list(bundled_scenarios().values()))
    lm = load(args)
    results = calibrate(lm, files, args.threshold, progress=progress("scenarios"))
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
    """Run one causal probe on a scenario's field change (see kvscope/engine/probes/ for each probe's options)."""
    if args.name not in PROBES:
        raise ScenarioError(f"unknown probe {args.name!r}; choose from {', '.join(PROBES)}")
    scenario = Scenario.load(args.scenario)
    scenario.field(args.field)
    options = parse_pairs(args.opt, "--opt", "KEY=VALUE", _option_value)
    accepted = [p for p in inspect.signature(PROBES[args.name]).parameters if p not in ("experiment", "source", "progress")]
    unknown = [key for key in options if key not in accepted]
    if unknown:
        raise ScenarioError(f"probe {args.name!r} has no option {unknown[0]!r}; options: {', '.join(accepted) or 'none'}")
    lm = load(args)
    experiment = EditExperiment(lm, scenario, args.field, args.new)
    result = PROBES[args.name](experiment, progress=progress(args.name), **options)
    return {
        "model": lm.fingerprint.name,
        "probe": args.name,
        "scenario": scenario.name,
        "field": experiment.field,
        "old": experiment.old,
        "new": experiment.new,
        **result.as_dict(),
    }


def cmd_weights(args: argparse.Namespace) -> dict:
    """Weight editing (ROME, LoRA) beside field_erratum on one edit: efficacy, contamination, collateral, cost."""
    scenario = Scenario.load(args.scenario)
    others = [Scenario.load(path) for path in names_of(args.others) or bundled_scenarios().values()]
    lora = LoraSettings(rank=args.lora_rank, steps=args.lora_steps, lr=args.lora_lr, modules=tuple(names_of(args.lora_modules)))
    rome = RomeSettings(layer=args.rome_layer, steps=args.rome_steps)
    methods = names_of(args.methods)
    lm = load(args)
    report = compare_edits(
        lm, scenario, others, field_name=args.field, new=args.new, methods=methods, lora=lora, rome=rome, progress=progress("steps")
    )
    return report.as_dict()


ASSIGNMENTS: Group = (arg("--set", action="append", default=[], metavar="FIELD=VALUE", help="field value (repeatable)"),)
EDIT: Group = (
    arg("--strategies", help=f"comma-separated subset of: {', '.join(STRATEGIES)}"),
    arg("--topk", type=int, default=EditSettings.top_k, help="K for field_topk"),
    arg("--ranking", default=EditSettings.ranking, help="field_topk ranking: causal or deviation"),
    arg("--cot-tokens", type=int, default=EditSettings.cot_tokens, help="chain-of-thought length for field_only_cot"),
    arg("--fused", action="store_true", help="read every strategy and the oracle in one forward (ms become shares)"),
    arg("--erratum", help="erratum template with {field}, {new}, {old}"),
)
CALIBRATION: Group = (
    arg("scenarios", nargs="*", help="scenario files or directories (default: the bundled demos)"),
    arg("--threshold", type=float, default=FLIP_THRESHOLD, help="minimum |Δmargin| that counts as a flip"),
)
PROBE_NAME: Group = (arg("name", help=f"one of: {', '.join(PROBES)}"),)
PROBE_OPTIONS: Group = (
    arg("--opt", action="append", default=[], metavar="KEY=VALUE", help="probe option, e.g. top=8, exact=true, find=..."),
)
WEIGHTS: Group = (
    arg("--methods", default=",".join(WEIGHT_METHODS), help=f"comma-separated subset of: {', '.join(WEIGHT_METHODS)}"),
    arg("--lora-rank", type=int, default=LoraSettings.rank, help="LoRA rank"),
    arg("--lora-steps", type=int, default=LoraSettings.steps, help="LoRA optimisation steps (stops early once flipped)"),
    arg("--lora-lr", type=float, default=LoraSettings.lr, help="LoRA learning rate"),
    arg("--lora-modules", default=",".join(LoraSettings.modules), help="linear modules LoRA wraps, by name"),
    arg("--rome-layer", type=int, help="MLP layer ROME edits (default: just before the notes map's strongest layer)"),
    arg("--rome-steps", type=int, default=RomeSettings.steps, help="ROME value optimisation steps"),
    arg("--others", help="comma-separated scenario files for collateral (default: every bundled scenario)"),
)
COMMANDS: dict[str, tuple[Handler, tuple[Group, ...]]] = {
    "decide": (cmd_decide, (SCENARIO, ASSIGNMENTS)),
    "edit": (cmd_edit, (SCENARIO, CHANGE, EDIT)),
    "calibrate": (cmd_calibrate, (CALIBRATION,)),
    "probe": (cmd_probe, (PROBE_NAME, SCENARIO, CHANGE, PROBE_OPTIONS)),
    "weights": (cmd_weights, (SCENARIO, CHANGE, WEIGHTS)),
}
