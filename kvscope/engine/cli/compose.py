"""Commands that splice precompiled K/V: skills into a context, a picture, a multi-turn agent, an edit inside a
spliced skill, and a user memory's placement."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvscope.engine.cli.common import Group, Handler, arg, load, log, names, progress
from kvscope.engine.cli.edit import edit_settings
from kvscope.engine.compose.agent import Compaction, run_agent
from kvscope.engine.compose.calibration import AUTO, calibrated_remedy, resolve_remedy
from kvscope.engine.compose.fidelity import compare
from kvscope.engine.compose.keystone import keystone
from kvscope.engine.compose.memory import memory_placement
from kvscope.engine.compose.pictures import IMAGE_QUESTION, bundled_images, compare_image, load_picture
from kvscope.engine.compose.placing import adhoc_scenario, with_skills
from kvscope.engine.compose.remedy import DEFAULT_REMEDY
from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.edit.erratum import WORDINGS as ERRATUM_WORDINGS
from kvscope.engine.models import cache_dir
from kvscope.engine.scenario import Scenario, ScenarioError


def _composition(args: argparse.Namespace) -> Scenario:
    skills = names(args.skills)
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
    lm = load(args)
    store = _store()
    remedy = resolve_remedy(lm, args.remedy, store, log)
    result = {"model": lm.fingerprint.name, **compare(lm, scenario, store, remedy=remedy, reps=args.reps, warmup=1).as_dict()}
    if args.remedy.strip() == AUTO:
        result["remedy_choice"] = calibrated_remedy(lm, store).as_dict()
    return result


def cmd_image(args: argparse.Namespace) -> dict:
    """Splice a picture's stored K/V into a context vs a full recompute from pixels (vision-language models)."""
    path = bundled_images().get(args.image, args.image)
    pixels = load_picture(path)
    lm = load(args)
    result = compare_image(
        lm, pixels, Path(path).stem, before=args.before, after=args.after, question=args.question, seam=args.seam, reps=args.reps, warmup=1
    )
    return {"model": lm.fingerprint.name, **result.as_dict()}


def cmd_agent(args: argparse.Namespace) -> dict:
    """Multi-turn episode: compose once, errata per turn (compacted by --policy), against the clean-state prefill
    and the identical-token re-prefill every turn."""
    scenario = _composition(args)
    fields = names(args.fields) or [scenario.field(args.field).name]
    for name in fields:
        scenario.field(name)
    policy = Compaction.parse(args.policy)
    lm = load(args)
    store = _store()
    report = run_agent(
        lm,
        scenario,
        store,
        turns=args.turns,
        fields=fields,
        toggle=args.toggle,
        remedy=resolve_remedy(lm, args.remedy, store, log),
        policy=policy,
        wording=args.wording,
        progress=progress("turns"),
    )
    return {"model": lm.fingerprint.name, **report.as_dict()}


def cmd_keystone(args: argparse.Namespace) -> dict:
    """Edit a field inside a spliced skill: every strategy on the composed vs the recomputed cache."""
    scenario = _composition(args)
    lm = load(args)
    store = _store()
    report = keystone(
        lm,
        scenario,
        store,
        field_name=args.field,
        remedy=resolve_remedy(lm, args.remedy, store, log),
        settings=edit_settings(args),
        progress=progress("strategies"),
    )
    return {"model": lm.fingerprint.name, **report.as_dict()}


def cmd_memory(args: argparse.Namespace) -> dict:
    """A user-memory skill at the start vs the end: edit cost, transplant fidelity."""
    scenario = _composition(args)
    lm = load(args)
    return {"model": lm.fingerprint.name, **memory_placement(lm, scenario, _store(), skill_id=args.memory_skill, seam=args.seam).as_dict()}


COMPOSITION: Group = (
    arg("--scenario", help="scenario TOML file (may place skills with {skill:ID})"),
    arg("--skills", help="comma-separated skill ids from demos/skills"),
    arg("--at", default="start", help="where --skills go in a scenario: start, after_fields or end"),
)
REMEDY: Group = (
    arg(
        "--remedy",
        default=DEFAULT_REMEDY.name,
        help="repair of spliced skills, parts joined by +: prefix (compile after the scenario's system prompt), "
        "seam:N (first N tokens of each skill), tail:N (its last N tokens), aggregators, blend:F (top fraction F by "
        "layer-1 K/V deviation from a fresh prefill of layers 0–1, CacheBlend), query:F (top fraction F by the question's attention to "
        "the plain splice), cover:M (with blend or query: stop once the share M of its ranking's score is covered), "
        "deviation:F or causal:F (top fraction F ranked against the full recompute; compose only), ape:T,S (nothing "
        "recomputed: APE's rescaled attention at temperature T, scale S; EPIC's sink:K is seam:K), "
        "or auto: this model's calibrated choice (measured once, minutes; kept in the cache dir). "
        "Default: the static default (the Composer opens on the loaded model's own stored study instead)",
    ),
)
EDITED_FIELD: Group = (arg("--field", help="the field to change (default: the first)"),)
REPS: Group = (arg("--reps", type=int, default=1, help="timed repetitions of each side, after one untimed warm-up (min, median, max)"),)
IMAGE: Group = (
    arg("--image", default="shipping_label", help=f"image file, or a bundled one: {', '.join(bundled_images())}"),
    arg("--before", default="", help="text before the picture (the block moves by its length)"),
    arg("--after", default="", help="text after the picture, before the question"),
    arg("--question", default=IMAGE_QUESTION, help="a yes/no question"),
    arg("--seam", type=int, default=0, help="recompute the picture's first N tokens against the real prefix"),
)
AGENT: Group = (
    arg("--turns", type=int, default=12, help="state changes after the first turn"),
    arg("--toggle", action="store_true", help="toggle old/new every turn (drift stress test)"),
    arg("--fields", help="comma-separated fields changing in turn (default: --field)"),
    arg("--policy", default="never", help="erratum compaction: never, every:K or adaptive[:R]"),
    arg("--wording", default="override", choices=list(ERRATUM_WORDINGS), help="erratum wording"),
)
MEMORY: Group = (
    arg("--seam", type=int, default=1, help="seam repair: recompute the first K tokens of each skill"),
    arg("--memory-skill", default="user_memory", help="the memory skill id"),
)
COMMANDS: dict[str, tuple[Handler, tuple[Group, ...]]] = {
    "compose": (cmd_compose, (COMPOSITION, REMEDY, REPS)),
    "image": (cmd_image, (REPS, IMAGE)),
    "agent": (cmd_agent, (COMPOSITION, REMEDY, EDITED_FIELD, AGENT)),
    "keystone": (cmd_keystone, (COMPOSITION, REMEDY, EDITED_FIELD)),
    "memory": (cmd_memory, (COMPOSITION, MEMORY)),
}
