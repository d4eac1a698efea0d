"""One result for one selection: a Composer run shows its result only while the page's selection is still the one it ran
for, and no other work runs on the model during a run's timed rounds."""

import threading
import time

import pytest

from kvscope.app.handlers.composer import ComposerRuns, Composition, compose_for_page, composed_scenario, selection, stale_words
from kvscope.engine import Cancelled, ComputeGate, WorkBudget, bounded
from kvscope.engine.cache.budget import compute_slot
from kvscope.engine.compose import fidelity

# a fast sequence of selections, as a person clicks them: skills added, removed, the remedy changed
SEQUENCE = (
    Composition(["account_gate"], after="", remedy="seam:1"),
    Composition(["account_gate", "refund_policy"], after="", remedy="seam:1"),
    Composition(["refund_policy"], after="", remedy="prefix+seam:2"),
    Composition(["refund_policy", "tone_guide"], after="", remedy="seam:1"),
    Composition(["refund_policy", "tone_guide"], after="", remedy="splice"),
)


def test_a_fast_sequence_of_selections_ends_showing_the_last_selections_result(registry):
    runs, session, shown, lock = ComposerRuns(), "one page", [], threading.Lock()

    def page_run(ticket: int, composition: Composition) -> None:
        view = compose_for_page(registry, runs, session, ticket, composition)
        if view is not None:  # what the page draws, in the order results arrive
            with lock:
                shown.append(view.summary)

    threads = []
    for composition in SEQUENCE:
        thread = threading.Thread(target=page_run, args=(runs.select(session, selection(registry, None, composition)), composition))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    last = SEQUENCE[-1]
    assert shown, "the last selection's run must show its result"
    assert shown[-1]["selection"] == selection(registry, None, last)
    assert shown[-1]["skills"] == list(last.skills) and shown[-1]["remedy"]["name"] == "splice"


ONE, TWO = {"skills": ["account_gate"]}, {"skills": ["refund_policy"]}


def test_a_newer_selection_cancels_the_run_in_flight_and_its_result_is_dropped():
    runs = ComposerRuns()
    first = runs.select("page", ONE)
    with runs.running("page", first) as token:
        assert not token.cancelled and runs.latest("page", first)
        assert runs.select("page", dict(ONE)) == first and not token.cancelled  # one click's two changes: the same selection
        second = runs.select("page", TWO)  # the person changes the selection while the first run computes
        assert token.cancelled and not runs.latest("page", first) and runs.latest("page", second)
        with pytest.raises(Cancelled, match="superseded by a newer selection"):
            token.check()
    other = runs.select("another page", ONE)  # another session's selection leaves this one alone
    assert runs.latest("page", second) and runs.latest("another page", other)


def test_a_run_started_after_a_newer_selection_stops_at_once():
    runs = ComposerRuns()
    stale = runs.select("page", ONE)
    runs.select("page", TWO)
    with runs.running("page", stale) as token:
        assert token.cancelled


def test_a_result_for_another_selection_is_marked_as_such(registry):
    shown = {"selection": selection(registry, None, SEQUENCE[1])}
    now = selection(registry, None, SEQUENCE[2])
    words = stale_words(shown, now, rerunning=False)
    assert "earlier selection" in words and "skills, remedy differ" in words and "account\\_gate, refund\\_policy" in words
    assert "Splice vs recompute" in words and "being recomputed" in stale_words(shown, now, rerunning=True)
    assert stale_words(shown, selection(registry, None, SEQUENCE[1]), rerunning=False) == ""
    assert stale_words(None, now, rerunning=False) == ""


def test_no_other_request_computes_during_a_compare_s_timed_rounds(registry, monkeypatch):
    """A second request hammering the gate gets no forward in while the comparison's rounds run."""
    gate, windows, others, done = ComputeGate(hold_s=0.0), [], [], threading.Event()
    timed = fidelity.side_by_side

    def recorded(*args, **kwargs):
        started = time.perf_counter()
        try:
            return timed(*args, **kwargs)
        finally:
            windows.append((started, time.perf_counter()))

    monkeypatch.setattr(fidelity, "side_by_side", recorded)

    def other_request() -> None:
        with bounded(WorkBudget(), gate):
            while not done.is_set():
                with compute_slot(1):
                    others.append(time.perf_counter())
                time.sleep(0.001)

    lm, placed = registry.get(), composed_scenario(Composition(["account_gate"], after="", remedy="seam:1"))
    thread = threading.Thread(target=other_request)
    thread.start()
    try:
        with bounded(WorkBudget(), gate):
            fidelity.compare(lm, placed, registry.skills(None), reps=2, warmup=1)
    finally:
        done.set()
        thread.join()
    ((start, end),) = windows
    assert others, "the other request must have run around the comparison"
    assert not [at for at in others if start < at < end]
