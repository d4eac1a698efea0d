"""One number per quantity: the notes share and the field-only recovery the README quotes for the Notes tab's demo are the
stored model comparison's (``compare_models-<dtype>-cpu.json``, shown on the Benchmarks tab), in the dtype the README
names, rounded as the app's Notes headline and cards round them; and the app's Notes tab and Learn tab, run on the
embedded model in that dtype, show those same numbers."""

import json
import re
from pathlib import Path

import pytest

from kvscope.app.handlers.common import NOTES_SCENARIO
from kvscope.engine.edit.report import NotesShare
from kvscope.viz.cards import notes_headline_html
from kvscope.viz.learn import share_percent

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
STUDIES = ROOT / "benchmarks" / "studies" / "results"


def _said() -> dict:
    """The Notes demo's numbers as the README states them (its first "Three things to try")."""
    prose = " ".join(README.split())  # the paragraph unwrapped
    demo = re.search(r"The tab opens on `(\w+)`", prose)
    share = re.search(r"notes carry (\d+)% of the decision in (float32|bfloat16)", prose)
    field = re.search(
        r"in (float32|bfloat16) the field-only edit recovers (\d\.\d\d) of the change and the decision stays \*(\w+)\*", prose
    )
    assert demo and share and field, "the README states the Notes demo's share, dtype and field-only recovery"
    assert share.group(2) == field.group(1), "the README's share and recovery name one dtype"
    return {
        "demo": demo.group(1),
        "percent": f"{share.group(1)}%",
        "dtype": share.group(2),
        "field": field.group(2),
        "label": field.group(3),
    }


def _stored(dtype: str, demo: str) -> dict:
    """The embedded model's row for ``demo`` in the stored model comparison of ``dtype``."""
    data = json.loads((STUDIES / f"compare_models-{dtype}-cpu.json").read_text())
    assert data["dtype"] == dtype
    (model,) = [model for model in data["models"] if model["spec"] == "embedded"]
    (row,) = [row for row in model["calibrate"]["scenarios"] if Path(row["file"]).stem == demo]
    return row


def test_the_readme_quotes_the_stored_comparison_of_the_demo_the_app_opens_on():
    said = _said()
    assert said["demo"] == NOTES_SCENARIO
    row = _stored(said["dtype"], said["demo"])
    notes = NotesShare(row["notes_share"], row["field_only_recovery"], row["field_only_label"], row["old_label"], row["new_label"])
    assert f"Notes carry {said['percent']} of this decision" in notes.headline()  # the Notes tab's headline
    assert share_percent(notes) == said["percent"]  # Learn's step 2
    assert f"field_only recovery {said['field']}" in notes_headline_html(notes)  # the headline's evidence
    assert said["label"] == row["field_only_label"] == row["old_label"] != row["new_label"]


@pytest.fixture(scope="module")
def embedded():
    from kvscope.app.state import ModelRegistry

    registry = ModelRegistry("embedded", dtype=_said()["dtype"])
    registry.get()
    return registry


def test_the_notes_and_learn_tabs_show_the_readmes_numbers_on_the_embedded_model(embedded):
    from kvscope.app.handlers.common import bundled_scenario_text
    from kvscope.app.handlers.learn import learn_step
    from kvscope.app.handlers.notes import EditInputs, run_edit
    from kvscope.app.state import SessionStore

    said, sessions = _said(), SessionStore()
    view = run_edit(embedded, sessions, EditInputs(bundled_scenario_text(NOTES_SCENARIO)), session="s")
    headline = re.search(r'<p class="kv-notes" id="notes-headline".*?</p>', view.cards_html).group(0)
    assert f"Notes carry {said['percent']} of this decision" in headline and f"field_only recovery {said['field']}" in headline
    assert f"computed in {said['dtype']}" in headline
    learned, _ = learn_step(embedded, sessions, 1, session="s")
    assert f"recovers only {said['field']}" in learned and f"because {said['percent']} of it sits in the stale notes" in learned
