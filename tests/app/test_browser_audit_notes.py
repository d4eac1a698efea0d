"""The Your prompt tab in Debian's chromium at 1,000 and 1,400 px: the bundled RAG log audited offers each changed field
with its pre-check, the one picked in the menu is the one Open in Notes opens and edits; the audit's table headers keep
each word whole; an empty log is one sentence of information, with no "Error" anywhere. Screenshots go to /tmp."""

import re

import pytest

from tests.app.browser_waits import wait_for_app, wait_for_audit
from tests.app.test_browser import CHROMIUM, TOAST, browser  # noqa: F401 (the module's browser fixture)
from tests.app.test_browser_labels import wide_page  # noqa: F401 (a page at 1,000 and 1,400 px)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")
PICKED = "request 2 · study_rooms_free_now"
# per header cell of the audit's tables: its text and how many lines it takes (1: no word broken)
HEADER_LINES = """() => [...document.querySelectorAll('#audit-traffic th, #audit-groups th')].map(th => {
  const range = document.createRange(); range.selectNodeContents(th);
  const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
  return [th.innerText, tops.size];
})"""


def _error_badges(page) -> list[str]:
    """Visible elements whose whole text is "Error" (Gradio's status badge on an output that failed)."""
    found = page.get_by_text("Error", exact=True)
    return [found.nth(i).inner_text() for i in range(found.count()) if found.nth(i).is_visible()]


def test_the_rag_log_offers_each_changed_field_and_opens_the_one_picked(wide_page):  # noqa: F811
    page, width = wide_page
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-demo input").click()
    page.get_by_role("option", name="rag", exact=True).click()
    page.wait_for_function("() => document.querySelector('#audit-input textarea').value.includes('Retrieved passage')", timeout=30_000)
    page.locator("#audit-tokens input[type=number]").fill("2")
    page.locator("#audit-sample input[type=number]").fill("1")
    page.locator("#run-audit").click()
    wait_for_app(page, page.locator("#audit-open-status").get_by_text("Open in Notes:"))
    wait_for_audit(page)  # the token pass shows first; the changed fields are offered once the turns are measured
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    wait_for_app(page, page.locator("#audit-traffic th").first)  # the tables render after the status line
    headers = page.evaluate(HEADER_LINES)
    assert headers and all(lines == 1 for _, lines in headers), headers  # "tokens", never "to/ke/ns"
    page.locator("#audit-notes-field input").click()
    options = [option.replace("✓", "").strip() for option in page.get_by_role("option").all_inner_texts()]  # ✓: the picked one
    assert [re.sub(r" · [^·]*$", "", option) for option in options] == [
        "request 2 · study_rooms_free_now: '3' → '1'",
        "request 3 · retrieved: '2026-05-12 09:44' → '2026-05-12 09:52'",
        "request 3 · printers: 'working' → 'out of order'",
    ], options
    assert all(re.search(r" · (moves the|does not move|changes the answer)", option) for option in options), options
    page.get_by_role("option", name=re.compile(re.escape(PICKED))).click()
    status = page.locator("#audit-open-status")
    wait_for_app(page, status.get_by_text("study_rooms_free_now").first)  # the pre-check said before anything runs
    assert "(request 2)" in status.inner_text()
    page.screenshot(path=f"/tmp/ragnotes-audit-{width}px.png", full_page=True)
    page.locator("#audit-open-notes").click()
    wait_for_app(page, page.locator("#notes-headline"))  # Open in Notes ran the edit in the Notes tab
    assert page.locator("#field input").input_value() == "study_rooms_free_now"
    assert page.locator("#new-value input").input_value() == "1"
    headline = page.locator("#notes-headline").inner_text()
    assert "Notes share undefined" not in headline and "nothing to recover" not in headline, headline
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    page.screenshot(path=f"/tmp/ragnotes-notes-{width}px.png", full_page=True)


def test_an_empty_log_is_information_in_one_place_not_an_error(wide_page):  # noqa: F811
    page, width = wide_page
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-input textarea").fill("\n\n   \n")
    page.locator("#run-audit").click()
    wait_for_app(page, page.locator("#audit-traffic").get_by_text("Nothing to audit yet"))
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    assert _error_badges(page) == []
    assert page.get_by_text("Nothing to audit yet").count() == 1  # in one place
    page.screenshot(path=f"/tmp/ragnotes-empty-{width}px.png", full_page=True)
