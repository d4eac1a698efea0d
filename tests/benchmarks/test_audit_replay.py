"""The replay benchmark: a request log sent to a built llama-server, its cached tokens against the simulated cache."""

from __future__ import annotations

import json

import pytest

from benchmarks import audit_replay
from benchmarks.serving_servers import SERVER_BINARY

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


needs_llama_server = pytest.mark.skipif(
    not SERVER_BINARY.is_file(), reason="llama-server is not built: bash scripts/build_llama_server.sh (~10 min)"
)


@needs_llama_server
def test_replay_on_llama_server_caches_what_the_simulation_predicts(tmp_path):
    # session a, then b with a's prefix (its own slot: nothing cached), then a again, one minute later and a turn longer
    log = [_request("a", "09:41", "Hi"), _request("b", "09:41", "Hi"), _request("a", "09:42", "Hi", "Hello", "When do you open?")]
    (tmp_path / "desk.jsonl").write_text("\n".join(log))
    argv = ["--model", "embedded", "--logs", "desk", "--log-dir", str(tmp_path), "--out", str(tmp_path), "--repairs", "hoist"]
    data = audit_replay.main([*argv, "--reps", "2"])
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
    # the third request rewritten with its clock line at the end of the last message: a prompt the template never
    # rendered before, cached on the server exactly as simulated
    moved = hoist["requests"][2]
    assert moved["server_cached_tokens"] == moved["simulated_cached_tokens"] > 0
    assert hoist["mismatches"] == [] and hoist["not_rewritten"] == 0
    assert stored["summary"]["equal"] == stored["summary"]["requests"] == 6


def _replayed(label_cached: dict[str, list[int]]) -> dict:
    replays = {
        label: {
            "requests": [
                {"request": i, "tokens": 50, "server_cached_tokens": c, "simulated_cached_tokens": c, "prompt_ms": 90.0 - c}
                for i, c in enumerate(cached)
            ]
        }  # fmt: skip
        for label, cached in label_cached.items()
    }
    return {
        "reps": 2,
        "model": "embedded",
        "device": "cpu",
        "logs": [{"log": "desk", "replays": replays}],
        "summary": {"equal": 4, "requests": 4},
    }


def test_the_benchmarks_tab_draws_prompt_time_against_cached_tokens_and_the_simulation_beside_it():
    from app.handlers import benchmark_figures_for

    (figure,) = benchmark_figures_for({"audit_replay-embedded-cpu": _replayed({"original": [0, 10], "hoist": [0, 40]})})
    time, simulated, _, _, diagonal = figure.data
    assert list(time.x) == [0, 10] and list(time.y) == [90.0, 80.0] and time.name == "original" and time.showlegend
    assert list(simulated.x) == list(simulated.y) == [0, 10] and not simulated.showlegend
    assert list(diagonal.x) == [0, 40] and "4/4 requests cache what the simulation predicts" in figure.layout.title.text
