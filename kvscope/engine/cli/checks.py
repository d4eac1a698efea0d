"""Commands that check a model or the engine: its card, the cache self-test and the support matrix."""

from __future__ import annotations

import argparse

from kvscope.engine.cache.selftest import run_selftest
from kvscope.engine.checks.support import OPERATIONS, TOLERANCE, check_model, markdown_table, support_matrix
from kvscope.engine.cli.common import Group, Handler, arg, load, log, names
from kvscope.engine.models import ModelLoadError
from kvscope.engine.models.tiny import HYBRID_ARCHS, TINY_ARCHS


def cmd_info(args: argparse.Namespace) -> dict:
    """Model card: architecture, sizes, RoPE, device, dtype, fingerprint."""
    return load(args).info()


def cmd_selftest(args: argparse.Namespace) -> dict:
    """RoPE round trip, reposition-vs-prefill, splice identity and chunked prefill errors."""
    return run_selftest(load(args)).as_dict()


def cmd_support(args: argparse.Namespace) -> dict:
    """Support matrix: every operation on every tiny family against ground truth (and the loaded model with --loaded)."""
    families = tuple(names(args.families)) or TINY_ARCHS + HYBRID_ARCHS
    unknown = [name for name in families if name not in TINY_ARCHS + HYBRID_ARCHS]
    if unknown:
        raise ModelLoadError(f"unknown family {unknown[0]!r} in --families; choose from: {', '.join(TINY_ARCHS + HYBRID_ARCHS)}")
    rows = support_matrix(families, progress=log)
    loaded = check_model(load(args)) if args.loaded else None
    if args.markdown and not args.json:
        print(markdown_table(rows + ([loaded] if loaded else [])))
        return {}
    return {
        "tolerance": TOLERANCE,
        "operations": list(OPERATIONS),
        "families": [row.as_dict() for row in rows],
        "loaded": loaded.as_dict() if loaded else None,
    }


SUPPORT: Group = (
    arg("--loaded", action="store_true", help="also check the model named by --model"),
    arg("--families", help="comma-separated tiny families (default: all)"),
    arg("--markdown", action="store_true", help="print the matrix as a Markdown table instead (ignored with --json)"),
)
COMMANDS: dict[str, tuple[Handler, tuple[Group, ...]]] = {
    "info": (cmd_info, ()),
    "selftest": (cmd_selftest, ()),
    "support": (cmd_support, (SUPPORT,)),
}
