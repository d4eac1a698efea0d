"""What a person sees at 1,000 px: a sentence under every probe result, the trigger probe asking for the tab's own
fields, a new probe clearing the last one's figure, the Notes result and export holding the edit and its knockout,
and a cancelled calibration shown as information with Cancel hidden. Screenshots go to /tmp/notesprobes-*.png."""

import re
import time
from pathlib import Path
from urllib.parse import urljoin

import pytest

from tests.app.browser_waits import wait_for_app
from tests.app.conftest import SCENARIO
from tests.app.test_browser import ARGS, CHROMIUM, TOAST, _set_editor, browser  # noqa: F401 (the module's fixtures)

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (scripts/test.sh installs it)")
SHOTS = Path("/tmp")


@pytest.fixture
def narrow(browser, app_url):  # noqa: F811
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    page.goto(app_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))
    yield page
    context.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"notesprobes-{name}.png"), full_page=True)


def _pick(page, element_id: str, option: str) -> None:
    page.locator(f"#{element_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def _edit(page) -> None:
    page.get_by_role("tab", name="Notes").click()
    _set_editor(page, SCENARIO)
    page.locator("#run-edit").click()
    wait_for_app(page, page.locator('#strategy-cards [data-strategy="erratum"]'))


def test_probe_results_carry_a_sentence_and_the_trigger_asks_for_the_tabs_fields(narrow):
    page = narrow
    _edit(page)
    page.get_by_role("tab", name="Probes").click()
    _pick(page, "probe-name", "knockout")
    page.locator("#run-probe").click()
    sentence = page.locator("#probe-sentence").get_by_text(re.compile(r"^Knocking out the top \d+ notes? moves the new-value margin by"))
    wait_for_app(page, sentence)
    wait_for_app(page, page.locator("#probe-plot .js-plotly-plot"))
    assert sentence.inner_text().strip().endswith(".")
    page.locator("#probe-sentence").scroll_into_view_if_needed()
    _shot(page, "probe-sentence")
    _pick(page, "probe-name", "trigger")  # another probe: the knockout's figure and sentence go
    page.locator("#probe-plot .js-plotly-plot").wait_for(state="detached", timeout=10_000)
    assert page.locator("#probe-sentence").inner_text().strip() == ""
    page.locator("#run-probe").click()
    said = page.locator("#probe-sentence").get_by_text("The trigger probe needs")
    wait_for_app(page, said)  # a warning where the result would be (and as a toast), not an error
    for text in (said.inner_text(), page.locator(TOAST).filter(has_text="The trigger probe needs").first.inner_text()):
        assert "'trigger: rule text to flip'" in text and "'trigger: replacement (same token count)'" in text and "find=" not in text
    assert page.get_by_text("Error", exact=True).count() == 0, "input not given yet is not a failure: no error badges"
    _shot(page, "trigger-message")


def test_the_notes_result_and_export_hold_the_edit_and_its_knockout(narrow):
    page = narrow
    _edit(page)
    wait_for_app(page, page.locator("#frontier-plot .js-plotly-plot"))  # the frontier follows the edit
    page.get_by_text("Knockout: hide tokens from the decision").click()
    page.locator("#knockout-positions").locator("textarea, input").first.fill("4")
    page.locator("#run-knockout").click()
    wait_for_app(page, page.locator("#knockout-result").get_by_text("Knocked out 1 position ("))
    result = page.locator("#edit-json").inner_text()
    assert "knockout" in result and "strategies" in result and "frontier" in result
    page.locator("#export-notes").click()
    wait_for_app(page, page.locator("#notes-files").get_by_text(".ipynb"))
    links = page.locator("#notes-files a")
    href = next(link.get_attribute("href") for link in links.all() if (link.get_attribute("href") or "").endswith(".json"))
    exported = page.request.get(urljoin(page.url, href)).json()
    assert exported["knockout"]["positions"] == [4] and exported["strategies"]["erratum"]["decision"] in ("yes", "no")
    assert exported["frontier"]["points"] and exported["notes"]["headline"]
    page.locator("#knockout-result").scroll_into_view_if_needed()
    _shot(page, "notes-knockout-export")


def test_a_cancelled_calibration_is_information_and_cancel_hides(narrow, registry, tmp_path, monkeypatch):
    from kvscope.engine.cache import adapter
    from kvscope.engine.compose import calibration

    page = narrow
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    plan = calibration.CalibrationPlan(skills=("account_gate",), sizes=(1,), placements=("start",), remedies=("splice", "seam:1"))
    monkeypatch.setattr(calibration, "CalibrationPlan", lambda: plan)
    forward = adapter.forward

    def slow_forward(*args, **kwargs):  # a real model's pace, so that there is time to cancel
        time.sleep(0.2)
        return forward(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", slow_forward)
    page.get_by_role("tab", name="Composer").click()
    cancel = page.locator("#cancel-calibration")
    page.locator("#remedy input").click()
    page.get_by_role("option", name=re.compile(r"^auto — ")).click()
    cancel.wait_for(state="visible", timeout=10_000)
    page.locator("#run-compose").click()
    wait_for_app(page, page.get_by_text(re.compile(r"calibrating remedy auto for tiny-qwen2")).first)
    cancel.click()
    notice = page.locator("#compose-metrics").get_by_text(re.compile(r"The calibration of tiny-qwen2 was cancelled at step \d of 6"))
    wait_for_app(page, notice)
    cancel.wait_for(state="hidden", timeout=10_000)
    toasts = page.locator(TOAST)
    assert "nothing was stored" in toasts.filter(has_text="was cancelled at step").first.inner_text()
    assert page.get_by_text("Error", exact=True).count() == 0, "a cancel is not an error: no red toast, no error badges"
    page.locator("#compose-metrics").scroll_into_view_if_needed()
    _shot(page, "calibration-cancelled")
    assert not (tmp_path / "remedy-choices.json").exists() and calibration.cancel_calibration(registry.get()) is None
