"""The Composer's *auto* remedy in Debian's chromium: the calibration shows its steps, and Cancel stops it without storing
anything. Screenshots go to test-artifacts/."""

import re
import time

import pytest

from tests.app.browser_waits import wait_for_app
from tests.app.test_browser import CHROMIUM, TOAST, _shot, browser, page  # noqa: F401 (the module's fixtures)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")


def test_auto_shows_the_calibration_steps_and_cancel_stops_it(page, registry, tmp_path, monkeypatch):  # noqa: F811
    from kvscope.engine.cache import adapter
    from kvscope.engine.compose import calibration

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    plan = calibration.CalibrationPlan(skills=("account_gate",), sizes=(1,), placements=("start",), remedies=("splice", "seam:1"))
    monkeypatch.setattr(calibration, "CalibrationPlan", lambda: plan)  # 4 study steps, then 2 keystone runs
    forward = adapter.forward

    def slow_forward(*args, **kwargs):  # the tiny model calibrates in a second or two: slow it to a real model's pace
        time.sleep(0.2)
        return forward(*args, **kwargs)

    monkeypatch.setattr(adapter, "forward", slow_forward)
    page.get_by_role("tab", name="Composer").click()
    cancel = page.locator("#cancel-calibration")
    assert not cancel.is_visible(), "nothing to cancel while a measured remedy is chosen"
    page.locator("#remedy input").click()
    page.get_by_role("option", name=re.compile(r"^auto — ")).click()
    cancel.wait_for(state="visible", timeout=10_000)
    page.locator("#run-compose").click()
    progress = page.get_by_text(re.compile(r"calibrating remedy auto for tiny-qwen2: prompt \d/2 \(refund_gate, 1 skill at start")).first
    wait_for_app(page, progress)
    assert re.search(r"step \d of 6", progress.inner_text())
    _shot(page, "composer-auto-calibrating")
    cancel.click()
    page.locator("#calibration-status").get_by_text(re.compile(r"Cancelled the calibration of tiny-qwen2 at step \d of 6")).wait_for(
        timeout=10_000
    )
    toast = page.locator(TOAST).filter(has_text="was cancelled at step")
    wait_for_app(page, toast.first)
    assert "nothing was stored" in toast.first.inner_text()
    _shot(page, "composer-auto-cancelled")
    assert not (tmp_path / "remedy-choices.json").exists() and calibration.cancel_calibration(registry.get()) is None
