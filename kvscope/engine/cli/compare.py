"""``compare-models``: the same scenario and field edit on up to three models, side by side."""

from __future__ import annotations

import argparse

from kvscope.engine.cli.common import CHANGE, SCENARIO, Group, Handler, arg, log, progress
from kvscope.engine.cli.compose import REMEDY
from kvscope.engine.comparison import SPLICE_SKILL, compare_models
from kvscope.engine.compose.remedy import Remedy
from kvscope.engine.models import load_model
from kvscope.engine.scenario import Scenario


def cmd_compare_models(args: argparse.Namespace) -> dict:
    """The same scenario and field edit on up to three models: notes share, recoveries, notes depth, read heads, splice cosine."""
    scenario = Scenario.load(args.scenario)
    result = compare_models(
        args.models.split(","),
        lambda spec: load_model(spec, device=args.device, dtype=args.dtype, progress=log),
        scenario,
        args.field,
        args.new,
        skill=args.skill,
        remedy=Remedy.parse(args.remedy),
        progress=log,
        steps=progress("steps"),
    )
    return result.as_dict()


COMPARISON: Group = (
    arg("--models", required=True, help="comma-separated specs of 1 to 3 models (e.g. embedded,qwen-1.5b,smollm2), loaded in turn"),
    arg("--skill", default=SPLICE_SKILL, help="the skill spliced before the scenario for the splice cosine"),
)
COMMANDS: dict[str, tuple[Handler, tuple[Group, ...]]] = {"compare-models": (cmd_compare_models, (COMPARISON, SCENARIO, CHANGE, REMEDY))}
