"""Headless CLI: ``python -m engine info|selftest|decide``.

With ``--json`` exactly one JSON object goes to stdout (an ``{"error": ...}`` object and exit code 2 on
bad input); logs and progress go to stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

from engine.models import LoadedModel, ModelLoadError, load_model
from engine.notebook import NotebookError
from engine.rope import RopeUnsupported
from engine.runs import run_scenario
from engine.scenario import Scenario, ScenarioError
from engine.selftest import run_selftest

USER_ERRORS = (ModelLoadError, ScenarioError, NotebookError, RopeUnsupported, FileNotFoundError)


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


def _parse_assignments(pairs: list[str]) -> dict[str, str]:
    values = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ScenarioError(f"--set expects FIELD=VALUE, got {pair!r}")
        values[name.strip()] = value
    return values


def cmd_decide(args: argparse.Namespace) -> dict:
    """Prefill a scenario with chosen field values and read the decision."""
    scenario = Scenario.load(args.scenario)
    values = _parse_assignments(args.set)
    scenario.values_with(**values)  # validate field names before the (slow) model load
    lm = _load(args)
    return {"model": lm.fingerprint.name, **run_scenario(lm, scenario, values).as_dict()}


COMMANDS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "info": cmd_info,
    "selftest": cmd_selftest,
    "decide": cmd_decide,
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="embedded", help="alias (embedded, smollm2, tiny-ARCH), HF id or local dir")
    common.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    common.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    common.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser = argparse.ArgumentParser(prog="python -m engine", description="KVScope engine: KV cache as a notebook.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler in COMMANDS.items():
        sub = commands.add_parser(name, parents=[common], help=handler.__doc__)
        if name == "decide":
            sub.add_argument("--scenario", required=True, help="scenario TOML file")
            sub.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="field value (repeatable)")
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
    except USER_ERRORS as error:
        if args.json:
            print(json.dumps({"error": str(error), "type": type(error).__name__}))
        else:
            _log(f"error: {error}")
        return 2
    _print(result, args.json)
    return 0
