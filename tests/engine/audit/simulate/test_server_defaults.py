"""Defaults that match the server a log came from, checked on the stored replays of real servers (benchmarks/interop's
``chat_replay``: four sessions of five turns on llama-server at its defaults, on llama-server with ``id_slot`` pinned,
and on vLLM's CPU build at block 32 and 128, each answer logged as a gateway logs it) audited as a user would, with
no flags: the server named from its answers, llama.cpp's own slot choice unless the log pins ``id_slot``, vLLM's block
read from its own counts, and ``--fit-observed`` searching the named engine's own settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.simulate.observed import Reported, log_server
from kvscope.engine.audit.simulate.registry import DEFAULT_ENGINE, engine_of_answer, engine_of_owner
from tests.engine.test_cli import run_cli
from tests.shared import assert_valid_report

ROOT = Path(__file__).resolve().parents[4]
STORED = json.loads((ROOT / "benchmarks" / "interop" / "results" / "chat_replay-embedded-cpu.json").read_text())["servers"]


def _log(tmp_path: Path, server: str, way: str) -> tuple[str, dict]:
    """The stored replay's log (``way``: ``token_ids`` or ``text_only``) as a file, and the benchmark's comparison."""
    path = tmp_path / f"{server}-{way}.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in STORED[server][f"log_{way}"]))
    return str(path), STORED[server][way]


def _counts(audit: dict) -> list[tuple[int | None, int]]:
    """Per request: the server's cached count and the compared engine's simulated one."""
    engine = audit["observed"]["engine"]
    return [(row["observed_cached_tokens"], row["reused_tokens"][engine]) for row in audit["requests"]]


def test_a_llama_server_log_at_its_defaults_audited_with_no_flags_equals_the_server(tmp_path):
    path, _ = _log(tmp_path, "llama-default", "token_ids")
    code, audit = run_cli("audit", path, "--sample", "0")
    assert code == 0
    assert_valid_report(audit)
    observed = audit["observed"]
    assert observed["engine"] == "llama_cpp" and "timings" in observed["engine_evidence"]
    assert audit["engines"]["settings"]["prompt_cache"] is True  # the server's own slot choice, no slot named
    counts = _counts(audit)
    assert len(counts) == 20 and all(server == simulated for server, simulated in counts)
    # read from the reply's text alone, the audit reproduces what the benchmark's --prompt-cache run stored: 19 of 20
    path, stored = _log(tmp_path, "llama-default", "text_only")
    code, audit = run_cli("audit", path, "--sample", "0")
    assert audit["observed"]["engine"] == "llama_cpp" and "system_fingerprint b1-" in audit["observed"]["engine_evidence"]
    assert [simulated for _, simulated in _counts(audit)] == [row["simulated_cached_tokens"] for row in stored["rows"]]
    assert audit["observed"]["equal"] == stored["equal"] == 19


def test_a_log_that_pins_slots_gets_a_slot_per_session_with_no_flags(tmp_path):
    for way in ("text_only", "token_ids"):  # both ways log the id_slot each request was sent with
        path, stored = _log(tmp_path, "llama-pinned", way)
        assert all(request.slot is not None for request in read_log(Path(path).read_text()).requests)
        code, audit = run_cli("audit", path, "--sample", "0")
        assert audit["engines"]["settings"]["prompt_cache"] is False
        assert [simulated for _, simulated in _counts(audit)] == [row["simulated_cached_tokens"] for row in stored["rows"]]
        bare = STORED["llama-pinned"]["no_flags"][way]
        assert audit["observed"]["equal"] == bare["equal"] == stored["equal"]
    assert all(server == simulated for server, simulated in _counts(audit))  # from the generated ids: every request


@pytest.mark.parametrize("block", [32, 128])
def test_a_vllm_log_with_no_flags_is_compared_with_vllm_at_the_block_its_counts_show(tmp_path, block):
    for way in ("token_ids", "text_only"):
        path = _log(tmp_path, f"vllm-{block}", "token_ids")[0] if way == "token_ids" else _text_only(tmp_path, block)
        code, audit = run_cli("audit", path, "--sample", "0")
        assert code == 0
        assert_valid_report(audit)
        observed = audit["observed"]
        assert observed["engine"] == "vllm" and f"block size {block} read from the log's counts" in observed["engine_evidence"]
        assert audit["engines"]["settings"]["block"] == block
        assert len(_counts(audit)) == 20 and all(server == simulated for server, simulated in _counts(audit))
        assert STORED[f"vllm-{block}"]["no_flags"][way]["equal"] == STORED[f"vllm-{block}"][way]["equal"] == 20


def _text_only(tmp_path: Path, block: int) -> str:
    """The vLLM replay's log with its token ids dropped, as a gateway that logs text keeps it (``chat_replay``)."""
    from benchmarks.interop.chat_replay import without_token_ids

    path = tmp_path / f"vllm-{block}-text_only.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in without_token_ids(STORED[f"vllm-{block}"]["log_token_ids"])))
    return str(path)


@pytest.mark.parametrize("block", [32, 128])
def test_the_fit_finds_a_vllm_logs_block_and_the_flag_reproduces_it(tmp_path, block):
    path, stored = _log(tmp_path, f"vllm-{block}", "token_ids")
    code, audit = run_cli("audit", path, "--sample", "0", "--fit-observed", "--block-size", "16")
    fit = audit["observed"]["fit"]
    assert fit["engine"] == "vllm" and fit["best"] == {"block": block, "budget_tokens": None, "matches": 20, "share": 1.0}
    assert fit["tied"] == [{"block": block, "budget_tokens": None, "matches": 20}]
    assert audit["engines"]["settings"]["block"] == 16 and "block size" not in audit["observed"]["engine_evidence"]  # as given
    code, audit = run_cli("audit", path, "--sample", "0", "--block-size", str(block))
    assert all(server == simulated for server, simulated in _counts(audit))


def test_the_fit_searches_llama_cpps_own_settings(tmp_path):
    path, _ = _log(tmp_path, "llama-default", "token_ids")
    code, audit = run_cli("audit", path, "--sample", "0", "--fit-observed")
    fit = audit["observed"]["fit"]
    assert fit["engine"] == "llama_cpp" and len(fit["tried"]) == 5 + 5 * 4
    assert fit["best"] == {"slots": None, "prompt_cache": True, "cache_reuse": 0, "matches": 20, "share": 1.0}
    assert all(setting["prompt_cache"] for setting in fit["tied"])  # the server's own slot choice, at 4 or more slots
    path, _ = _log(tmp_path, "llama-pinned", "token_ids")
    code, audit = run_cli("audit", path, "--sample", "0", "--fit-observed")
    best = audit["observed"]["fit"]["best"]
    assert (best["prompt_cache"], best["matches"]) == (False, 20)  # a slot per session reproduces every count


def _answer(**fields) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"content": "ok"}, **fields.pop("choice", {})}],
        **fields,
    }


def test_each_engine_reads_its_own_marks_and_a_log_without_any_says_what_was_assumed():
    from kvscope.engine.audit.logs.usage import answer_marks

    marks = {
        "vllm": answer_marks(_answer(system_fingerprint="vllm-0.11.0-tp2-1a2b3c4d")),
        "sglang": answer_marks(_answer(choice={"matched_stop": 151645})),
        "llama_cpp": answer_marks(_answer(system_fingerprint="b6573-0c1e570", timings={"cache_n": 3})),
    }
    assert {name: engine_of_answer(found)[0] for name, found in marks.items()} == {name: name for name in marks}
    assert engine_of_answer(answer_marks(_answer(system_fingerprint="fp_44709d6fcb"))) is None  # OpenAI's own
    assert engine_of_answer(answer_marks(_answer(choice={"stop_reason": None})))[0] == "vllm"  # an older vLLM
    assert [engine_of_owner(owner) for owner in ("vllm", "sglang", "llamacpp", "someone")] == ["vllm", "sglang", "llama_cpp", "vllm"]
    plain = [Reported(n, None, None, 0) for n in range(1, 4)]
    assert log_server(plain).engine == DEFAULT_ENGINE and "assumed" in log_server(plain).evidence
    sglang = [Reported(n, None, None, 0, answer_marks=marks["sglang"]) for n in range(1, 4)]
    assert log_server(sglang).engine == "sglang" and log_server(sglang).evidence.startswith("3 of the log's 3 answers carry")
    named = log_server(sglang, "llama_cpp")
    assert named.engine == "llama_cpp" and named.evidence.startswith("named by --observed-engine (the log's answers name sglang")
