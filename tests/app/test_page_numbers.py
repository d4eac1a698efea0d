"""Every number on the page is the CLI's: the Notes, Learn and Models handlers against `kvscope edit --json` on the same
scenario, field, value and strategies (read the way the page reads them: ``--fused``), in float32 and bfloat16."""

import re

import pytest

from kvscope.app.handlers.common import NOTES_SCENARIO, bundled_scenario_text
from kvscope.app.handlers.learn import LEARN_STRATEGIES, learn_step
from kvscope.app.handlers.models import run_model_comparison
from kvscope.app.handlers.notes import EditInputs, run_edit
from kvscope.app.state import ModelRegistry, SessionStore
from kvscope.engine import DEFAULT_STRATEGIES, bundled_scenarios
from tests.app.conftest import TINY
from tests.engine.test_cli import run_cli

DTYPES = ("float32", "bfloat16")
FIELD, NEW = "prescription", "valid"  # the notes demo's own edit


@pytest.fixture(scope="module", params=DTYPES)
def registry(request):
    registry = ModelRegistry(TINY, dtype=request.param)
    registry.get()
    return registry


def _cli(registry, strategies) -> dict:
    """`kvscope edit --json` on the notes demo, in the registry model's dtype, read as the page reads it."""
    args = ["edit", "--model", TINY, "--dtype", registry.dtype, "--scenario", str(bundled_scenarios()[NOTES_SCENARIO])]
    code, data = run_cli(*args, "--field", FIELD, "--new", NEW, "--strategies", ",".join(strategies), "--fused")
    assert code == 0, data
    return data


def _numbers(report: dict) -> dict:
    """Every number a page shows of an edit report: margins, decisions, recoveries, the notes share and the noise floor."""
    runs = {"stale": report["stale"], "oracle": report["oracle"], **report["strategies"]}
    shown = {name: (run["margin"], run["decision"], run["recovery"]) for name, run in runs.items()}
    notes = report["notes"]
    return shown | {"notes": (notes["share"], notes["field_recovery"]), "noise": (report["margin_noise"], report["within_noise"])}


def test_the_notes_tab_shows_the_clis_numbers(registry):
    view = run_edit(
        registry,
        SessionStore(),
        EditInputs(bundled_scenario_text(NOTES_SCENARIO), field=FIELD, new=NEW, strategies=list(DEFAULT_STRATEGIES)),
        session="s",
    )
    assert _numbers(view.summary) == _numbers(_cli(registry, DEFAULT_STRATEGIES))
    assert view.summary["dtype"] == registry.dtype


def test_full_downstream_is_the_oracle_on_the_page_as_in_the_cli(registry):
    summary = run_edit(
        registry, SessionStore(), EditInputs(bundled_scenario_text(NOTES_SCENARIO), field=FIELD, new=NEW), session="s"
    ).summary
    assert summary["strategies"]["full_downstream"]["scores"] == summary["oracle"]["scores"]  # bit for bit, rounded alike
    assert summary["strategies"]["full_downstream"]["recovery"] in (None, 1.0)


def _cards(html: str) -> dict[str, tuple[str, str]]:
    """The cards' margin and recovery as the page prints them, by strategy."""
    cards = re.findall(r'data-strategy="([^"]+)"[^>]*data-margin="([^"]+)".*?recovery ([^<]+)</span>', html)
    return {name: (margin, recovered) for name, margin, recovered in cards}


def _printed(run: dict) -> tuple[str, str]:
    return f"{run['margin']:+.2f}", "—" if run["recovery"] is None else f"{run['recovery']:.2f}"


@pytest.mark.parametrize("step", sorted(LEARN_STRATEGIES))
def test_the_learn_steps_print_the_clis_numbers(registry, step):
    html, _ = learn_step(registry, SessionStore(), step, session="s")
    for strategies in (LEARN_STRATEGIES[step], DEFAULT_STRATEGIES):  # its own two, and as the Notes tab's default edit reads them
        data = _cli(registry, strategies)
        runs = {"stale": data["stale"], "oracle": data["oracle"], **{name: data["strategies"][name] for name in LEARN_STRATEGIES[step]}}
        assert _cards(html) == {name: _printed(run) for name, run in runs.items()}


def test_the_models_tab_shows_the_clis_recoveries(registry):
    view = run_model_comparison(registry, [TINY], text=bundled_scenario_text(NOTES_SCENARIO), field=FIELD, new=NEW)
    row = view.result["models"][0]
    for strategies in (view.result["strategies"], DEFAULT_STRATEGIES):  # its own three, and the Notes tab's default four
        data = _cli(registry, strategies)
        assert row["recoveries"] == {name: data["strategies"][name]["recovery"] for name in view.result["strategies"]}
        assert row["details"]["delta_margin"] == data["delta_margin"] and row["notes_share"] == data["notes"]["share"]
