"""The Composer's numbers are the CLI's: ``kvscope compose`` and the page's handler on the same inputs (same model, dtype,
skills, scenario and remedy) give the same logit agreement, decisions, token counts and K/V deviation, in float32 and
bfloat16. Times differ run to run and are left out."""

import argparse

import pytest

from kvscope.app.handlers.common import NOTES_SCENARIO
from kvscope.app.handlers.composer import Composition, run_compose
from kvscope.app.state import ModelRegistry
from kvscope.engine import bundled_scenarios
from kvscope.engine.cli.compose import cmd_compose
from tests.app.conftest import TINY

SAME = ("context_tokens", "skill_tokens", "recomputed_tokens", "recomputed_fraction", "top1_agree", "decisive", "decision_agree")
CLOSE = ("cosine", "kl", "max_kv_deviation", "margin_error")
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}  # both sides run the same forwards; the tolerance only absorbs rounding


def _cli(dtype: str, skills: list[str], scenario: str | None, remedy: str) -> dict:
    args = argparse.Namespace(
        model=TINY, device="cpu", dtype=dtype, scenario=scenario, skills=",".join(skills), at="start", remedy=remedy, reps=1
    )
    return cmd_compose(args)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("skills", "after", "remedy"),
    [(["account_gate"], "", "seam:2"), (["refund_policy", "tone_guide"], NOTES_SCENARIO, "prefix+seam:1")],
)
def test_the_composer_shows_the_clis_numbers(dtype, skills, after, remedy, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))  # both compile their skills afresh
    cli = _cli(dtype, skills, str(bundled_scenarios()[after]) if after else None, remedy)
    page = run_compose(ModelRegistry(TINY, device="cpu", dtype=dtype), Composition(skills, after=after, remedy=remedy)).summary
    assert page["model"] == cli["model"] and page["scenario"] == cli["scenario"] and page["skills"] == cli["skills"]
    assert page["remedy"] == cli["remedy"]
    for key in SAME:
        assert page[key] == cli[key], key
    for key in CLOSE:
        assert page[key] == pytest.approx(cli[key], abs=TOLERANCE[dtype]), key
    for side in ("spliced", "recomputed"):
        assert page[side]["decision"] == cli[side]["decision"]
        assert page[side]["margin"] == pytest.approx(cli[side]["margin"], abs=TOLERANCE[dtype]), side
