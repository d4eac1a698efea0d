"""The audit's progress on tiny-qwen2: one bar that never goes back, through every phase in order (reading the log,
loading, the token pass, measuring turn k of n, the Notes scenario, the figures), ending at 100%; a token pass
(``sample`` 0) loads no weights; a Cancel stops the run before its next forward and says so as information."""

from __future__ import annotations

import re

import pytest

from kvscope.app.handlers.audit_progress import PHASES, AuditPhases, AuditRuns
from kvscope.app.handlers.your_prompt import run_audit, start_audit
from kvscope.app.state import ModelRegistry
from kvscope.engine import LoadedTokenizer, StepMessage, cancellable
from kvscope.engine.cache.budget import compute_slot
from tests.app.conftest import TINY
from tests.app.test_audit_tab import LOG, OPTIONS


def _heard(registry, sessions, **options):
    heard: list[StepMessage] = []
    run_audit(registry, sessions, LOG, session="p", progress=heard.append, **OPTIONS, **options)
    return heard


def test_the_bar_moves_through_every_phase_in_order_and_names_each_turn(registry, sessions):
    heard = _heard(registry, sessions, sample=3)
    fractions = [message.done / message.total for message in heard]
    assert fractions == sorted(fractions) and fractions[0] == 0.0 and fractions[-1] == 1.0
    texts = [str(message) for message in heard]
    order = ["reading the log", "loading the model", "token pass: requests", "measuring turn", "Open in Notes", "drawing the figures"]
    firsts = [next(i for i, text in enumerate(texts) if text.startswith(prefix)) for prefix in order]
    assert firsts == sorted(firsts)
    # the log's 2 turns are measured (recompute and 3 repairs: 4 steps, with the reference 5 each), said by the model
    # pass's meter from its 0 to its end, each turn named, the time left once a reference and a repair have ended
    model = [(t, f) for t, f in zip(texts, fractions) if t.startswith(("measuring turn", "measured 2 turns"))]
    start, end = PHASES["measuring"]
    assert model[0][0].startswith("measuring turn 1 of 2: the reference (step 1 of 10); 0% of the model pass")
    assert model[0][1] == pytest.approx(start) and model[-1][1] == pytest.approx(end)
    assert model[-1][0].startswith("measured 2 turns (10 steps) in ")
    assert {re.match(r"measuring turn (\d) of 2", text).group(1) for text, _ in model[:-1]} == {"1", "2"}
    assert any("left" in text for text, _ in model[:-1])
    # the Notes pre-check of the one changed field: two prefills, each said as it starts, with the time left after the first
    notes = [(t, f) for t, f in zip(texts, fractions) if t.startswith("Open in Notes")]
    start, end = PHASES["notes"]
    assert [re.search(r"prefill (\d of \d)", text).group(1) for text, _ in notes[1:]] == ["1 of 2", "2 of 2"]
    assert "timing the first" in notes[1][0] and re.search(r"about \d+ s left", notes[2][0]), notes
    assert [fraction for _, fraction in notes] == pytest.approx([start, start, (start + end) / 2], abs=1e-3)


def test_a_token_pass_loads_the_tokenizer_only(sessions):
    fresh = ModelRegistry(TINY)  # nothing loaded: the token pass must not load the weights
    heard = _heard(fresh, sessions, sample=0)
    assert fresh.loaded() == [] and isinstance(fresh.token_model(), LoadedTokenizer)
    assert "loading the tokenizer (the token pass needs no weights)" in [str(m) for m in heard]
    assert not any(str(m).startswith(("measuring turn", "measured")) for m in heard) and heard[-1].done == heard[-1].total


def test_a_cancel_stops_the_audit_before_its_next_forward_and_says_so(registry, sessions):
    runs = AuditRuns()
    assert runs.cancel("tab") == "No audit is running: nothing to cancel."
    with runs.running("tab") as token, cancellable(token):  # as the tab runs each step of the audit
        said = []

        def cancel_at_the_first_turn(message):
            if str(message).startswith("measuring turn"):
                said.append(runs.cancel("tab"))

        view = run_audit(registry, sessions, LOG, session="c", progress=cancel_at_the_first_turn, **OPTIONS)
        assert view.summary["cancelled"].startswith("the model pass was cancelled after 0 of ")  # the token pass is kept
        assert view.traffic_markdown.startswith("**Cancelled**: the model pass was cancelled") and view.summary["requests"]
        with pytest.raises(Exception, match="cancelled"):
            with compute_slot(1):  # any further forward of this run is refused
                pass
    assert said[0].startswith("Audit cancelled: it stops before its next forward; a finished token pass is shown")
    with compute_slot(1):  # outside the run, forwards go on
        pass


def test_the_token_pass_is_shown_while_the_model_pass_runs_and_nothing_is_kept_until_it_ends(registry, sessions):
    started = start_audit(registry, sessions, LOG, session="w", **OPTIONS)
    pending = started.pending.summary
    assert pending["pending"] == "the token pass is whole; the model pass is measuring 2 turns of 3 change signatures with 4 repairs each"
    assert started.pending.traffic_markdown.startswith("**Measuring**: the token pass is whole")
    recommendation = started.pending.recommendation_markdown
    assert recommendation.startswith("**Measuring**:") and "Recommended:" not in recommendation
    assert "the model pass is measuring the sampled turns now" in started.pending.groups_markdown
    assert started.pending.notes_menu == [] and sessions.get("w", "audit") is None  # Open in Notes waits for the measured turns
    view = started.finish()
    assert view.summary["requests"] == pending["requests"] and view.summary["engines"] == pending["engines"]
    assert "pending" not in view.summary and "Recommended:" in view.recommendation_markdown
    assert sessions.get("w", "audit") is not None
    assert "The model pass is measuring the sampled turns, so no prompt is marked yet." in started.pending.prompt_html
    tokens_only = start_audit(registry, sessions, LOG, session="w", sample=0, **OPTIONS)
    assert tokens_only.pending is None  # no model pass to wait for
    view = tokens_only.finish()  # every panel of the measured turns says why it is empty: not "one request only"
    words = [view.prompt_html, *(figure.layout.annotations[0].text for figure in (view.timeline_figure, view.fidelity_figure))]
    assert all("the token pass only (--sample 0)" in text.lower() and "one request only" not in text.lower() for text in words), words


def test_the_token_pass_says_its_rate_and_time_left_on_the_bar():
    """The tab's token pass line is the CLI's (``rated``): its rate and time left from the first report, on a fake clock,
    placed through the token-pass phase of the bar."""
    heard, now = [], [10.0]
    steps = AuditPhases(heard.append).steps("token pass", "token pass: requests", clock=lambda: now[0])
    steps(10, 100)
    now[0] += 2.0
    steps(70, 100)  # 60 requests in 2 s: 30 a second, 30 left: 1 s
    assert [str(message) for message in heard] == [
        "token pass: requests: 10/100",
        "token pass: requests: 70/100 · 30 requests/s · about 1 s left",
    ]
    start, end = PHASES["token pass"]
    assert heard[-1].done == round((start + (end - start) * 0.7) * 1000) and heard[-1].total == 1000
