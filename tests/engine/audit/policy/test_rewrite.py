"""``rewrite_request`` against the exact text each repair must send: the erratum keeps the session's first value and
states the new one, hoist moves the line after the last message, coarsen rounds to the grain; requests the policy does
not match come back identical; the session state is bounded; and on a real log the rewrite is the request the audit
measured (the registry's own rewrite, not a copy)."""

from pathlib import Path

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import Message, Request
from kvscope.engine.audit.policy.build import forced_policy
from kvscope.engine.audit.policy.document import VERSION, Fidelity, FieldPolicy, Policy, PolicyError
from kvscope.engine.audit.policy.rewrite import SessionState, rewrite_request
from kvscope.engine.audit.prompts.repair_requests import prompt_repair_request
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[4]
SYSTEM = "You are Forge.\nTime now: {clock}\nBe brief."
ERRATUM = "[STATE UPDATE] clock -> {new}; overrides any earlier value and conclusion"
FIDELITY = Fidelity(0.01, 1.0, True, 2, 0.05, 0.9)


def _policy(repair: str, grain: str | None = None) -> Policy:
    entry = FieldPolicy("clock", "system", 0, "Time now: {clock}", "x", repair, "measured", grain, fidelity=FIDELITY)
    return Policy(VERSION, "tiny", "float32", 0.05, 0.9, (entry,))


def _request(clock: str, *turns: str, session: str | None = "a") -> Request:
    messages = [Message("system", SYSTEM.format(clock=clock))]
    for number, text in enumerate(turns or ("fix the bug",)):
        messages.append(Message("user" if number % 2 == 0 else "assistant", text))
    return Request(1, 1, tuple(messages), session=session)


def test_the_erratum_keeps_the_session_s_first_value_and_states_the_new_one():
    state, policy = SessionState(), _policy("erratum")
    assert rewrite_request(_request("09:41"), state, policy) == _request("09:41")  # the first value: sent as it came
    later = rewrite_request(_request("09:42", "fix the bug", "done", "and the test"), state, policy)
    assert later.contents == (SYSTEM.format(clock="09:41"), "fix the bug", "done", "and the test\n\n" + ERRATUM.format(new="09:42"))
    other = _request("09:45", session="b")  # keyed by session: b's first value is its own
    assert rewrite_request(other, state, policy) == other
    assert rewrite_request(_request("09:41", "again"), state, policy) == _request("09:41", "again")  # back at a's first value


def test_hoist_moves_the_line_after_the_last_message_and_coarsen_rounds_in_place():
    hoisted = rewrite_request(_request("2026-05-12 09:42", "fix", "ok", "next"), SessionState(), _policy("hoist"))
    assert hoisted.contents == ("You are Forge.\nBe brief.", "fix", "ok", "next\n\nTime now: 2026-05-12 09:42")
    coarse = rewrite_request(_request("2026-05-12 09:42"), SessionState(), _policy("coarsen", "hour"))
    assert coarse.contents == (SYSTEM.format(clock="2026-05-12 09:00"), "fix the bug")
    not_a_date = _request("soon")
    assert rewrite_request(not_a_date, SessionState(), _policy("coarsen", "hour")) == not_a_date


@pytest.mark.parametrize("repair", ["erratum", "hoist", "coarsen"])
def test_a_request_the_policy_does_not_match_comes_back_identical(repair):
    state, policy = SessionState(), _policy(repair, "hour" if repair == "coarsen" else None)
    unmatched = [
        Request(1, 1, (Message("system", "You are Forge."), Message("user", "Time now: 09:41"))),  # only in the last message
        Request(1, 1, (Message("user", SYSTEM.format(clock="09:41")), Message("user", "hi"))),  # another role
        Request(1, 1, (Message("system", "Time now:    "), Message("user", "hi"))),  # no value
        Request(1, 1, prompt=SYSTEM.format(clock="09:41")),  # a completions prompt
        Request(1, 1, (Message("system", "Time now 09:41"), Message("user", "hi"))),  # not its line
    ]
    for request in unmatched:
        assert rewrite_request(request, state, policy) is request


def test_the_session_state_forgets_the_least_recently_seen_session_beyond_its_limit():
    state, policy = SessionState(limit=2), _policy("erratum")
    for session in ("a", "b", "a", "c"):  # b is the least recently seen when c arrives
        rewrite_request(_request("09:41", session=session), state, policy)
    assert len(state) == 2
    assert rewrite_request(_request("09:50", session="b"), state, policy) == _request("09:50", session="b")  # b starts again
    assert rewrite_request(_request("09:50", session="c"), state, policy).contents[-1].endswith(ERRATUM.format(new="09:50"))
    with pytest.raises(PolicyError, match="sessions: keep at least 1"):
        SessionState(0)


@pytest.fixture(scope="module")
def coding_agent():
    """The bundled coding agent's log through the token pass (its clock line changes every turn)."""
    tokenizer = load_tokenizer("embedded")
    log = read_log((ROOT / "demos" / "logs" / "coding_agent.jsonl").read_text(encoding="utf-8"))
    return log, scan_log(tokenizer.tokenizer, log, model=tokenizer.name)


@pytest.mark.parametrize("repair", ["hoist", "erratum"])
def test_on_a_real_log_the_rewrite_is_the_request_the_audit_measured(coding_agent, repair):
    """The audit's prompt-level repair request (``prompt_repair_request``, what the model pass measures) and the
    gateway's rewrite send the same text: hoist on every turn, the erratum on the turn whose matched request holds the
    session's first value."""
    log, scan = coding_agent
    policy = forced_policy(scan, repair, None, "embedded")
    assert [entry.pattern for entry in policy.fields] == ["Session started: {session_started}"]
    state = SessionState()
    rewritten = [rewrite_request(request, state, policy) for request in log.requests]
    turns = sorted(scan.diffs) if repair == "hoist" else [2]
    assert len(turns) >= (5 if repair == "hoist" else 1)
    for index in turns:
        measured = prompt_repair_request(repair, scan.rendered[index], scan.diffs[index])
        assert rewritten[index - 1].contents == measured.contents, index
