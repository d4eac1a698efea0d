"""The replay benchmark: each repair's template deployed over a request log (the one ``--template`` measures, with its
fidelity), sent to a built llama-server, its cached tokens against the simulated cache; and its figure."""

from __future__ import annotations

import json

import pytest

from benchmarks.interop import audit_replay
from benchmarks.serving.serving_servers import SERVER_BINARY
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.audit.measure.turn import repaired_template
from kvscope.engine.audit.rewrite.measure import apply_template, measure_rewrite
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.models.tiny import tiny_model
from kvscope.viz.audit import KL_FLOOR
from kvscope.viz.benchmarks import audit_replay_figure

SYSTEM = "You are the help desk of a bike shop.\nSession started: 2026-05-12 {time}\nAnswer in one short sentence, with the opening hours."


def _request(session: str, time: str, *turns: str) -> str:
    messages = [{"role": "system", "content": SYSTEM.format(time=time)}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(turns)]
    return json.dumps({"session": session, "messages": messages})


def test_mismatches_name_by_how_much_and_why():
    equal = {"request": 0, "tokens": 10, "server_cached_tokens": 4, "simulated_cached_tokens": 4, "difference": 0, "accounted": True}
    last = {**equal, "request": 1, "server_cached_tokens": 10, "simulated_cached_tokens": 9, "difference": 1}
    other = {**equal, "request": 2, "server_cached_tokens": 2, "difference": -2}
    found = audit_replay.mismatches([equal, last, other])
    assert [(row["request"], row["by"]) for row in found] == [(1, 1), (2, -2)]
    assert "last token" in found[0]["why"] and "different prefix" in found[1]["why"]
    assert audit_replay.mismatches([{**equal, "accounted": False}])[0]["why"].startswith("cache_n + prompt_n")


# session a, then b with a's prefix (its own slot: nothing cached), then a again, one minute later and a turn longer
DESK = [_request("a", "09:41", "Hi"), _request("b", "09:41", "Hi"), _request("a", "09:42", "Hi", "Hello", "When do you open?")]


def test_the_replayed_rewrites_are_the_templates_the_audit_writes_measured_as_template_measures_them():
    lm, log = tiny_model("qwen2"), read_log("\n".join(DESK))
    repairs = ["erratum", "hoist", "coarsen"]
    rewrites = audit_replay.rewrites_of(lm, log, repairs, "hour", 2, ScanSettings())
    report = audit_traffic(lm, log, measure=measure_settings(repairs=repairs, tokens=2, grain="hour")).measured_report()
    assert list(rewrites.logs) == ["original", "erratum", "hoist", "coarsen"] and rewrites.logs["original"] == log
    for repair in repairs:  # every request rewritten, not only the one whose clock changed
        assert rewrites.logs[repair] == apply_template(repaired_template(report, repair), log)
        assert rewrites.templates[repair] == {
            "written": True,
            "from_request": 3,
            "form": "object" if repair == "erratum" else "list",
            "rewritten_requests": [1, 2, 3],
        }
        alone = measure_rewrite(lm, log, rewrites.logs[repair], tokens=2)
        rows = {"requests": [{"request": row.request, "prompt_ms": 1.0} for row in alone.requests]}
        merged = audit_replay.with_fidelity(rows, rewrites.fidelity[repair])
        for row, expected in zip(merged["requests"], alone.requests):
            assert row["kl"] == pytest.approx(expected.fidelity.kl, abs=1e-7) and row["top1_agree"] == expected.fidelity.top1_agree
            assert row["generation_agreement"] == expected.fidelity.generation_agreement and row["same_text"] == expected.same_text
        assert merged["fidelity"]["verdict"] == alone.verdict() and merged["fidelity"]["of"] == 3
        assert merged["fidelity"]["max_kl"] == max(row["kl"] for row in merged["requests"]) > 0
    original = audit_replay.with_fidelity({"requests": [{"request": i} for i in (1, 2, 3)]}, rewrites.fidelity["original"])["fidelity"]
    assert original["max_kl"] == 0 and original["top1_agree"] == original["same_text"] == 3
    tier = read_log("\n".join(line.replace("09:42", "09:41").replace("Session started", "Tier: gold\\nSession started") for line in DESK))
    refused = audit_replay.rewrites_of(lm, tier, ["coarsen"], "date", 1, ScanSettings())
    assert list(refused.logs) == ["original"] and "no field changed in this log" in refused.templates["coarsen"]["reason"]


needs_llama_server = pytest.mark.skipif(
    not SERVER_BINARY.is_file(), reason="llama-server is not built: bash scripts/build_llama_server.sh (~10 min)"
)


@needs_llama_server
def test_replay_on_llama_server_caches_what_the_simulation_predicts(tmp_path):
    (tmp_path / "desk.jsonl").write_text("\n".join(DESK))
    argv = ["--model", "embedded", "--logs", "desk", "--log-dir", str(tmp_path), "--out", str(tmp_path), "--repairs", "hoist"]
    data = audit_replay.main([*argv, "--reps", "2", "--tokens", "4"])
    stored = json.loads((tmp_path / "audit_replay-embedded-cpu.json").read_text())
    assert stored["summary"] == data["summary"] and stored["reps"] == 2 and {"avx2", "model_name"} <= set(stored["cpu"])
    (desk,) = stored["logs"]
    assert desk["sessions"] == 2 and desk["llama_server"]["slots"] == 2 and len(desk["load_average_before"]) == 3
    original, hoist = desk["replays"]["original"], desk["replays"]["hoist"]
    rows = original["requests"]
    assert [row["slot"] for row in rows] == [0, 1, 0]
    assert [row["server_cached_tokens"] for row in rows] == [row["simulated_cached_tokens"] for row in rows]
    assert rows[0]["server_cached_tokens"] == 0 and rows[1]["server_cached_tokens"] == 0  # b has a slot of its own
    assert 0 < rows[2]["server_cached_tokens"] < rows[2]["tokens"]  # a's slot: the head before the clock line
    assert all(row["accounted"] and len(row["prompt_ms_reps"]) == 2 and row["prompt_ms"] > 0 for row in rows)
    assert original["mismatches"] == [] and original["counts_repeat_across_reps"]
    assert all(row["kl"] == 0 and row["generation_agreement"] == 1 for row in rows)  # the original against itself
    # the hoist template deployed: every request with its clock line at the end of its last message, prompts the
    # template never rendered before, cached on the server exactly as simulated, each with its fidelity
    assert desk["templates"]["hoist"]["rewritten_requests"] == [1, 2, 3]
    moved = hoist["requests"]
    assert [row["server_cached_tokens"] for row in moved] == [row["simulated_cached_tokens"] for row in moved]
    assert moved[2]["server_cached_tokens"] > 0  # the head up to request 1's turn, whose appended clock line moved on
    assert all(0 <= row["generation_agreement"] <= 1 and row["kl"] >= 0 for row in moved) and hoist["fidelity"]["of"] == 3
    assert hoist["mismatches"] == [] and stored["summary"]["equal"] == stored["summary"]["requests"] == 6
    assert stored["summary"]["against_original"]["desk"]["hoist"]["prompt_ms_ratio"] > 0


def _replayed(label_rows: dict[str, list[tuple[int, float, float]]]) -> dict:
    """A replay file: per label, each request's (cached tokens, KL, agreement); its prompt time falls with its cache."""
    replays = {
        label: {
            "requests": [
                {
                    "request": i,
                    "tokens": 50,
                    "server_cached_tokens": c,
                    "simulated_cached_tokens": c,
                    "prompt_ms": 90.0 - c,
                    "kl": kl,
                    "top1_agree": kl < 0.1,
                    "generation_agreement": agree,
                    "same_text": agree == 1.0,
                }
                for i, (c, kl, agree) in enumerate(rows)
            ]
        }  # fmt: skip
        for label, rows in label_rows.items()
    }
    return {
        "reps": 2,
        "model": "embedded",
        "device": "cpu",
        "logs": [{"log": "desk", "replays": replays}],
        "summary": {"equal": 4, "requests": 4},
    }


def test_the_benchmarks_tab_draws_prompt_time_against_fidelity_and_the_simulation_beside_it():
    data = _replayed({"original": [(0, 0.0, 1.0), (10, 0.0, 1.0)], "hoist": [(0, 0.02, 0.75), (40, 0.5, 0.25)]})
    figure = audit_replay_figure(data)  # what the Benchmarks tab draws for audit_replay-*.json
    agreement, kl, simulated = figure.data[:3]
    assert list(agreement.x) == [1.0, 1.0] and list(agreement.y) == [90.0, 80.0] and agreement.name == "original" and agreement.showlegend
    assert list(kl.x) == [KL_FLOOR, KL_FLOOR] and list(kl.y) == [90.0, 80.0] and not kl.showlegend
    assert list(simulated.x) == list(simulated.y) == [0, 10] and not simulated.showlegend
    hoist_agreement, hoist_kl = figure.data[3:5]
    assert list(hoist_agreement.x) == [0.75, 0.25] and list(hoist_agreement.y) == [90.0, 50.0] and hoist_agreement.name == "hoist"
    assert list(hoist_kl.x) == [0.02, 0.5] and list(hoist_agreement.marker.symbol) == ["circle", "circle-open"]  # the top token changes
    assert list(figure.data[-1].x) == [0, 40] and "4/4 requests cache what the simulation predicts" in figure.layout.title.text
    assert figure.layout.xaxis.title.text == "greedy tokens agreeing" and figure.layout.yaxis.title.text == "prompt time (ms)"
