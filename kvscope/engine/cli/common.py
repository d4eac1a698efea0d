"""What every command shares: logging to stderr, loading the model, progress lines, reading files and lists, and the
flags several commands take."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from kvscope.engine.audit.logs.formats import AUTO, FORMATS
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.logs.sources import EXPORT_SOURCES
from kvscope.engine.models import LoadedModel, load_model
from kvscope.engine.progress import StepProgress, rated
from kvscope.engine.scenario import ScenarioError

Handler = Callable[[argparse.Namespace], dict]  # a command: its parsed arguments in, its JSON-ready result out
Argument = tuple[tuple[str, ...], dict]  # one flag as argparse takes it: its names, its options
Group = tuple[Argument, ...]  # flags declared together, shared by the commands that list the group


def arg(*flags: str, **options) -> Argument:
    return flags, options


SCENARIO: Group = (arg("--scenario", required=True, help="scenario TOML file"),)
CHANGE: Group = (arg("--field", help="field to change (default: the first)"), arg("--new", help="new value (default: the field's `new`)"))
LOG_FORMAT = arg(
    "--format", default=AUTO, choices=[AUTO, *FORMATS, *EXPORT_SOURCES], help="the log's request format or export (auto: per record)"
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load(args: argparse.Namespace) -> LoadedModel:
    return load_model(args.model, device=args.device, dtype=args.dtype, progress=log)


def progress(unit: str) -> StepProgress:
    """Each count of ``unit`` to stderr, with its rate and time left (``rated``)."""
    return rated(unit, lambda text, done, total: log(text))


def parse_pairs(pairs: list[str], flag: str, form: str, value: Callable[[str], object] = str) -> dict:
    """The ``NAME=VALUE`` arguments of a repeatable ``flag`` by name, each value read by ``value``."""
    values = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ScenarioError(f"{flag} expects {form}, got {pair!r}")
        values[name.strip()] = value(text)
    return values


def names(text: str | None) -> list[str]:
    """A comma-separated list, stripped, empty entries dropped."""
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise RequestLogError(f"cannot read {path}: {error}") from None
