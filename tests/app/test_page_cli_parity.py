"""Every number on the Probes and Your prompt tabs is the CLI's: a probe run by the tab's handler against
`kvscope probe --json`, and a log audited by the tab against `kvscope audit --json`, on the same inputs, in float32
and bfloat16 (the Notes, Learn, Models and Composer tabs: test_page_numbers.py, test_composer_cli_parity.py)."""

import pytest

from kvscope.app.handlers.common import NOTES_SCENARIO, bundled_scenario_text
from kvscope.app.handlers.probes import ProbeCase, run_probe
from kvscope.app.handlers.your_prompt import run_audit
from kvscope.app.state import ModelRegistry, SessionStore
from kvscope.engine import bundled_logs, bundled_scenarios
from tests.app.conftest import TINY
from tests.engine.test_cli import run_cli

FIELD, NEW = "prescription", "valid"  # the notes demo's own edit
TIMES = {"seconds", "ms", "elapsed_s", "wall_s", "ttft_ms", "time_s"}


@pytest.fixture(scope="module", params=("float32", "bfloat16"))
def registry(request):
    registry = ModelRegistry(TINY, dtype=request.param)
    registry.get()
    return registry


def _untimed(value):
    """A JSON value without its wall-clock times (they differ run to run)."""
    if isinstance(value, dict):
        return {key: _untimed(item) for key, item in value.items() if key not in TIMES and not key.endswith("_ms")}
    if isinstance(value, list):
        return [_untimed(item) for item in value]
    return value


def test_the_probes_tab_shows_the_clis_knockout(registry):
    options = {"ks": [1, 2], "seeds": 2}
    _, page = run_probe(registry, ProbeCase(bundled_scenario_text(NOTES_SCENARIO), FIELD, NEW, "knockout", options))
    args = ["probe", "knockout", "--model", TINY, "--dtype", registry.dtype, "--scenario", str(bundled_scenarios()[NOTES_SCENARIO])]
    code, cli = run_cli(*args, "--field", FIELD, "--new", NEW, "--opt", "ks=[1,2]", "--opt", "seeds=2")
    assert code == 0, cli
    assert _untimed(page) == _untimed(
        {key: value for key, value in cli.items() if key not in ("model", "probe", "scenario", "field", "old", "new")}
    )


def test_the_your_prompt_tab_shows_the_clis_token_pass(registry, tmp_path):
    log = bundled_logs()["support_agent"]
    view = run_audit(registry, SessionStore(), log.read_text(encoding="utf-8"), session="p", sample=0)
    code, cli = run_cli("audit", str(log), "--model", TINY, "--sample", "0")
    assert code == 0, cli
    for key in ("engines", "sessions", "causes", "observed", "requests", "hosted"):
        assert _untimed(view.summary[key]) == _untimed(cli[key]), key
