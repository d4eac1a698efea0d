"""The argument parser with every command, and the entry point (``main``): each job's module names its commands and
the flag groups each takes; the flags every command shares (model, device, dtype, ``--json``) are declared here."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys

from kvscope.engine.audit.ci.gate import exit_code
from kvscope.engine.cli import audit, checks, compare, compose, edit, rewrite
from kvscope.engine.cli.common import Group, Handler, log
from kvscope.engine.errors import KVScopeError

_JOBS = (checks, edit, compose, compare, audit, rewrite)  # the order of the commands in --help
COMMANDS: dict[str, Handler] = {name: handler for job in _JOBS for name, (handler, _) in job.COMMANDS.items()}
_GROUPS: dict[str, tuple[Group, ...]] = {name: groups for job in _JOBS for name, (_, groups) in job.COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="embedded", help="alias (embedded, smollm2, qwen-1.5b, tiny-ARCH), HF id or local dir")
    common.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    common.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    common.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser = argparse.ArgumentParser(prog="python -m kvscope", description="KVScope engine: KV cache as a notebook.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, handler in COMMANDS.items():
        sub = commands.add_parser(name, parents=[common], help=handler.__doc__)
        for group in _GROUPS[name]:
            for flags, options in group:
                sub.add_argument(*flags, **options)
    return parser


def _print(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


def _run(args: argparse.Namespace) -> dict:
    """The command's result. With --json, whatever else reaches stdout meanwhile goes to stderr, so that stdout carries
    the one JSON object: libraries print there from their own threads (Ray's driver, e.g., the raylet's word that a
    worker died, which Ray retries)."""
    if not args.json:
        return COMMANDS[args.command](args)
    with contextlib.redirect_stdout(sys.stderr):
        return COMMANDS[args.command](args)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    try:
        result = _run(args)
    except KVScopeError as error:
        if args.json:
            print(json.dumps({"error": str(error), "type": type(error).__name__}))
        else:
            log(f"error: {error}")
        return 2
    if not (getattr(args, "markdown", False) and not args.json):
        _print(result, args.json)
    return exit_code(result)
