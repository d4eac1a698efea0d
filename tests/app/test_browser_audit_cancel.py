"""The audit's progress and Cancel in Debian's chromium: Cancel shows only while an audit runs (hidden before, and
again once the run is done, failed or cancelled); the token pass shows while the model pass runs, the bar names the
turn it measures, Cancel stops the run and says so as information (no "Error" toast or badge anywhere), and the tab
audits again at once. Screenshots of the tab before, during and after go to test-artifacts/ (and
/tmp/perf-audit-*.png)."""

import re
import time
from pathlib import Path

import pytest

from tests.app.browser_waits import wait_for_app
from tests.app.test_audit_tab import LOG
from tests.app.test_browser import ARTIFACTS, CHROMIUM, TOAST, browser, page  # noqa: F401 (the module's fixtures)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")


def _shot(page, name: str) -> None:  # noqa: F811
    for folder in (ARTIFACTS, Path("/tmp")):
        page.screenshot(path=str(folder / f"perf-audit-{name}.png"), full_page=True)


def test_cancel_stops_the_audit_as_information_and_the_tab_audits_again(page, monkeypatch):  # noqa: F811
    from kvscope.engine.cache import adapter

    forward, pace = adapter.forward, {"s": 0.4}

    def slow_forward(*args, **kwargs):  # the tiny model audits in a second: slow it to a real model's pace
        time.sleep(pace["s"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", slow_forward)
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-input textarea").fill(LOG)
    page.locator("#audit-tokens input[type=number]").fill("3")
    cancel = page.locator("#cancel-audit")
    page.locator("#run-audit").wait_for()
    assert not cancel.is_visible()  # nothing runs: nothing to cancel
    _shot(page, "before")
    page.locator("#run-audit").click()
    measuring = page.get_by_text(re.compile(r"measuring turn 1 of 2")).first
    wait_for_app(page, measuring)
    assert cancel.is_visible()
    # the token pass is shown while the model pass runs: every request and engine, and what is being measured
    wait_for_app(page, page.locator("#audit-traffic").get_by_text("Measuring: the token pass is whole").first)
    assert "3 requests" in page.locator("#audit-traffic").inner_text()
    assert "Measuring: the token pass is whole" in page.locator("#audit-recommendation").inner_text()
    _shot(page, "during")
    cancel.click()
    wait_for_app(page, page.locator("#audit-status").get_by_text("Audit cancelled"))
    cancel.wait_for(state="hidden", timeout=10_000)
    wait_for_app(page, page.locator(TOAST).filter(has_text="Audit cancelled").first)
    page.wait_for_timeout(1500)  # a late error would show by now
    _shot(page, "after")
    toasts = page.locator(TOAST).all_inner_texts()
    assert all("Audit cancelled" in text for text in toasts), toasts
    assert page.get_by_text("Error", exact=True).count() == 0
    # the finished token pass is kept, and the recommendation says first that no repair was measured
    recommendation = page.locator("#audit-recommendation").inner_text()
    assert recommendation.startswith("Cancelled: the model pass was cancelled after"), recommendation
    assert re.search(r"\d+ of \d+ turns? measured, not kept", recommendation) and "Recommended:" not in recommendation
    pace["s"] = 0.0
    page.locator("#run-audit").click()  # the app stays responsive: the next audit runs to its end
    wait_for_app(page, page.locator("#audit-recommendation").get_by_text("Recommended:").first)
    assert page.get_by_text("Error", exact=True).count() == 0
    cancel.wait_for(state="hidden", timeout=10_000)  # done
    _shot(page, "again")
    page.locator("#audit-input textarea").fill("{broken")
    page.locator("#run-audit").click()
    wait_for_app(page, page.locator(TOAST).filter(has_text="line 1 is not JSON").first)
    cancel.wait_for(state="hidden", timeout=10_000)  # failed
