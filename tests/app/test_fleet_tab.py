"""The Your prompt tab's fleets: replica counts given, every router simulated at each, the table and the figure drawn
from the audit's JSON (one replica reuses exactly what one server does), and a bad count refused by name."""

from __future__ import annotations

import pytest

from kvscope.app.handlers.audit_log import bundled_log_text
from kvscope.app.handlers.audit_settings import EngineInputs
from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.your_prompt import run_audit
from kvscope.viz.fleet import ROUTING_LABELS


def test_fleets_are_simulated_tabled_and_drawn(registry, sessions):
    log = bundled_log_text("interleaved_agents")
    view = run_audit(registry, sessions, log, session="f", sample=0, engines=EngineInputs(replicas="1,2"))
    data = view.summary
    fleet = data["fleet"]
    assert [(entry["replicas"], entry["routing"]) for entry in fleet] == [(n, r) for n in (1, 2) for r in ROUTING_LABELS]
    for entry in fleet:
        assert entry["tokens"] == data["engines"]["tokens"]
        if entry["replicas"] == 1:
            assert entry["reused_tokens"] == data["engines"]["reused_tokens"]
    table = [line for line in view.fleet_markdown.splitlines() if line.startswith("| 2 |")]
    assert len(table) == 4 and "| 2 | session affinity |" in view.fleet_markdown
    routed = {trace.name for trace in view.fleet_figure.data}
    assert routed == {"one server", *ROUTING_LABELS.values()}
    assert len(view.fleet_figure.data) == 3 * 5  # per engine panel: one server and four routers
    none = run_audit(registry, sessions, bundled_log_text("interleaved_agents"), session="f", sample=0)
    assert "fleet" not in none.summary and none.fleet_figure is None and none.fleet_markdown == ""


def test_a_bad_replica_count_is_refused_by_name(registry, sessions):
    with pytest.raises(AppError, match="--replicas must be at least 1"):
        run_audit(registry, sessions, bundled_log_text("interleaved_agents"), session="f", sample=0, engines=EngineInputs(replicas="0"))
