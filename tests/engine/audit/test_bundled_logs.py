"""Every bundled log does what the README, docs/app.md and docs/audit.md say of it, read off the audit's own JSON: the
token pass (``scan_log``) with the embedded model's tokenizer, no weights. The claims, as written there:

- "a coding agent with a per-minute session line in a 1.5k-token system prompt";
- "a support agent whose tier changes";
- "a RAG prompt whose passage changes" (in one session: the retrieved passage changes between requests, so the audit
  finds the changed fields and the model pass measures them);
- docs/audit.md's table of the interleaved log (sessions, matches, tokens, each engine's reuse, causes) and its
  truncated record skipped by name.
"""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.traffic_scan import TrafficScan, sample_groups, scan_log
from kvscope.engine.models import load_model
from kvscope.engine.models.gguf import EMBEDDED_SHA256
from kvscope.engine.models.store import cache_dir
from kvscope.engine.scenario import bundled_logs


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer: from its converted copy, else loaded with the model (which converts it)."""
    copy = cache_dir() / "converted" / EMBEDDED_SHA256
    if (copy / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(copy), local_files_only=True)
    return load_model("embedded").tokenizer


def _scan(tokenizer, name: str) -> TrafficScan:
    return scan_log(tokenizer, read_log(bundled_logs()[name].read_text(encoding="utf-8")), model="embedded")


def _rows(scan: TrafficScan) -> list[dict]:
    return [row.as_dict() for row in scan.requests]


def _changes(scan: TrafficScan) -> list[list[tuple[str, str, str]]]:
    """Per request after the first: each changed field's (name, old, new)."""
    return [[(c.name, c.old, c.new) for c in scan.diffs[row.request].fields] for row in scan.requests[1:]]


def test_the_coding_agent_has_a_per_minute_session_line_in_a_1_5k_token_system_prompt(tokenizer):
    scan = _scan(tokenizer, "coding_agent")
    rows = _rows(scan)
    assert len(rows) == 6 and {row["session"] for row in rows} == {None} and not scan.skipped
    system = scan.rendered[1].content_spans[0]
    system_tokens = scan.rendered[1].tokens_in(*system)
    assert 1400 <= system_tokens.stop - system_tokens.start <= 1600  # "a 1.5k-token system prompt"
    changes = _changes(scan)
    assert [[name for name, _, _ in turn] for turn in changes] == [["session_started"]] * 5
    minutes = [changes[0][0][1]] + [new for ((_, _, new),) in changes]
    assert all(re.fullmatch(r"2026-05-12 09:\d\d", value) for value in minutes)
    steps = [int(b[-2:]) - int(a[-2:]) for a, b in zip(minutes, minutes[1:])]
    assert steps == [1, 2, 1, 2, 1]  # the line carries the minute: it changes with every request
    assert all([c["name"] for c in row["causes"]] == ["clock", "block_straddle"] for row in rows[1:])


def test_the_support_agent_changes_its_tier_once(tokenizer):
    scan = _scan(tokenizer, "support_agent")
    assert {row["session"] for row in _rows(scan)} == {None}
    assert _changes(scan) == [[], [("account_tier", "standard", "plus")], []]
    assert [[c["name"] for c in row["causes"]] for row in _rows(scan)] == [["new_prefix"], [], ["value", "block_straddle"], []]


def test_the_rag_passage_changes_between_requests_of_one_session_and_every_turn_is_measured(tokenizer):
    scan = _scan(tokenizer, "rag")
    rows = _rows(scan)
    assert len(rows) == 3 and {row["session"] for row in rows} == {None}
    assert [row["matched_request"] for row in rows] == [None, 1, 2]  # each request grows the one before
    assert all(row["appended_tokens"] > 0 for row in rows[1:])
    assert _changes(scan) == [
        [("retrieved", "2026-05-12 09:41", "2026-05-12 09:44"), ("study_rooms_free_now", "3", "1")],
        [("retrieved", "2026-05-12 09:44", "2026-05-12 09:52"), ("printers", "working", "out of order")],
    ]
    for row in scan.requests[1:]:  # every change sits inside the retrieved passage of the system prompt
        rendered, passage = scan.rendered[row.request], scan.rendered[row.request].request.contents[0]
        start = rendered.content_spans[0][0] + passage.index("Retrieved passage")
        end = rendered.content_spans[0][0] + passage.index("\n\nAnswer in")
        assert all(c.message == 0 and start < c.char_span[0] < c.char_span[1] < end for c in scan.diffs[row.request].fields)
    causes = [[(c["name"], c["field"]) for c in row["causes"]] for row in rows[1:]]
    assert causes == [
        [("clock", "retrieved"), ("counter", "study_rooms_free_now"), ("block_straddle", None)],
        [("clock", "retrieved"), ("value", "printers"), ("block_straddle", None)],
    ]
    measured = sorted(index for group in sample_groups(scan, 3) for index in group.measured)
    assert measured == [2, 3]  # no other_conversation: the model pass measures both turns


def test_the_interleaved_log_is_the_table_docs_audit_md_shows(tokenizer):
    scan = _scan(tokenizer, "interleaved_agents")
    table = [  # request, session, matched, tokens, vLLM, SGLang, llama.cpp, causes (docs/audit.md, "A real interleaved log")
        (1, "forge-1", None, 266, 0, 0, 0, ["new_prefix"]),
        (2, "harbor-7", 1, 68, 0, 5, 0, ["other_conversation"]),
        (3, "forge-1", 1, 324, 32, 38, 0, ["clock:current_time", "block_straddle"]),  # llama-server at its defaults
        (4, "harbor-7", 2, 90, 64, 76, 76, []),  # with request 2's 8-token reply, which this turn resends
        (5, "forge-1", 3, 384, 32, 38, 0, ["clock:current_time", "tools_reordered", "block_straddle"]),
        (6, "harbor-7", 4, 90, 32, 39, 39, ["value:customer_tier", "block_straddle"]),
    ]
    found = [
        (
            row["request"],
            row["session"],
            row["matched_request"],
            row["tokens"],
            *(row["reused_tokens"][engine] for engine in ("vllm", "sglang", "llama_cpp")),
            [f"{c['name']}:{c['field']}" if c["field"] else c["name"] for c in row["causes"]],
        )
        for row in _rows(scan)
    ]
    assert found == table
    assert "shares 5 tokens" in scan.requests[1].causes[0].detail  # "(5 tokens of template shared)"
    assert [(item.line, item.message) for item in scan.skipped] == [(5, "line 5, messages: must be a non-empty list")]
    assert scan.totals().replies == {"logged": 0, "next_turn": 1, "none": 5}
    assert scan.requests[3].prompts_only_reused_tokens == {"vllm": 64, "sglang": 68, "llama_cpp": 68}
