"""Open in Notes picks among every changed field (the bundled RAG log on tiny-qwen2): each field the measured turns
changed, at the latest turn that changed it, with the model's pre-check in its label; a field whose change does not move
the answer says so before anything runs and names the ones that do; an empty log is information, not an error."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from kvscope.app.handlers.audit_kept import audit_notes_choice, audit_notes_scenario
from kvscope.app.handlers.audit_log import NOTHING_TO_AUDIT, bundled_log_text, nothing_to_audit
from kvscope.app.handlers.audit_settings import AuditInputs
from kvscope.app.handlers.common import AppError
from kvscope.app.handlers.your_prompt import run_audit
from kvscope.engine.audit.measure.notes_scenario import NotesChoice
from kvscope.engine.cache.decision import RECOVERY_MIN_GAP

# the RAG log's changes, written out by hand from demos/logs/rag.jsonl: (request, field, old, new), the latest of each name
CHANGES = [
    (2, "study_rooms_free_now", "3", "1"),
    (3, "retrieved", "2026-05-12 09:44", "2026-05-12 09:52"),
    (3, "printers", "working", "out of order"),
]


@pytest.fixture(scope="module")
def rag(registry):
    from kvscope.app.state import SessionStore

    sessions = SessionStore()
    view = run_audit(registry, sessions, bundled_log_text("rag"), session="r", inputs=AuditInputs(["field_only"], 2))
    return view, sessions


def test_every_changed_field_is_offered_with_its_precheck(rag):
    view, sessions = rag
    choices = sessions.get("r", "audit_notes")
    assert [(c.request, c.field, c.old, c.new) for c in choices] == CHANGES  # retrieved of request 2: request 3's is later
    assert [key for _, key in view.notes_menu] == [f"{request}:{field}" for request, field, _, _ in CHANGES]
    for (label, _), choice in zip(view.notes_menu, choices):
        assert label.startswith(f"request {choice.request} · {choice.field}: {choice.old!r} → {choice.new!r} · ")
        assert choice.scenario.field == choice.field and label.endswith(choice.verdict())
        assert ("does not move" in label) == (choice.scenario.source != "divergence" and not choice.moves)
    moving = [choice.key for choice in choices if choice.moves]
    assert view.notes_pick == (moving[-1] if moving else "3:printers")  # the latest that moves, else the latest


def test_the_picked_field_is_the_scenario_opened(rag):
    _, sessions = rag
    text, choices = audit_notes_scenario(sessions, session="r", field="2:study_rooms_free_now")
    scenario = tomllib.loads(text)
    field = scenario["fields"]["study_rooms_free_now"]
    assert (field["old"], field["new"]) == ("3", "1")
    assert "{study_rooms_free_now}" in scenario["context"] and "{retrieved}" not in scenario["context"]
    assert choices.fields == ["study_rooms_free_now"] and choices.new == "1"
    labelled, _ = audit_notes_scenario(sessions, session="r", labels="yes, no", field="3:retrieved")
    assert tomllib.loads(labelled)["fields"]["retrieved"]["new"] == "2026-05-12 09:52"
    with pytest.raises(AppError, match=r"no changed field '2:retrieved' in this audit; it found 2:study_rooms_free_now, 3:retrieved"):
        audit_notes_scenario(sessions, session="r", field="2:retrieved")


def _moving(choice: NotesChoice) -> NotesChoice:
    """The choice with its new value's margin pushed past the recovery gap (as a field that moves the answer)."""
    scenario = choice.scenario
    decision = dataclasses.replace(scenario.new.decision, margin=scenario.old.decision.margin - 2 * RECOVERY_MIN_GAP)
    return dataclasses.replace(choice, scenario=dataclasses.replace(scenario, new=dataclasses.replace(scenario.new, decision=decision)))


def _still(choice: NotesChoice) -> NotesChoice:
    scenario = choice.scenario
    decision = dataclasses.replace(scenario.new.decision, margin=scenario.old.decision.margin + RECOVERY_MIN_GAP / 10)
    return dataclasses.replace(choice, scenario=dataclasses.replace(scenario, new=dataclasses.replace(scenario.new, decision=decision)))


def test_a_field_that_does_not_move_the_answer_says_so_before_running_and_offers_those_that_do(rag, registry):
    _, sessions = rag
    rooms, clock, printers = sessions.get("r", "audit_notes")
    sessions.put("p", "audit", sessions.get("r", "audit"), registry.resolve(None))
    sessions.put("p", "audit_notes", (_moving(rooms), _still(clock), _still(printers)), registry.resolve(None))
    said = audit_notes_choice(sessions, session="p", field="3:retrieved")
    assert "**This change does not move the model's answer.**" in said
    assert "Pick one whose change does: *study\\_rooms\\_free\\_now* (request 2)." in said
    assert "This change does not move" not in audit_notes_choice(sessions, session="p", field="2:study_rooms_free_now")
    assert audit_notes_choice(sessions, session="p", field="") == audit_notes_choice(sessions, session="p", field="2:study_rooms_free_now")
    sessions.put("p", "audit_notes", (_still(rooms), _still(clock), _still(printers)), registry.resolve(None))
    assert "No changed field of this audit moves the model's answer." in audit_notes_choice(sessions, session="p", field="3:retrieved")


def test_an_empty_log_is_information_not_an_error():
    for text in (None, "", "\n\n", "  \n\t\n  "):
        assert nothing_to_audit(text) == NOTHING_TO_AUDIT
    assert nothing_to_audit(bundled_log_text("rag")) is None
    assert "Nothing to audit yet" in NOTHING_TO_AUDIT and "Error" not in NOTHING_TO_AUDIT
