"""Browser waits that follow the app's own progress: a result is awaited as long as the page shows Gradio working on
it (a progress bar, its text, the pending timer), so a loaded machine only makes a test slower, never red; a test
fails when the app has shown no progress for ``quiet_s`` seconds and the result is not there."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

from playwright.sync_api import Locator, Page
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

# What Gradio 6 shows while an event runs: the progress bar and its text, and the pending timer ("processing | 3.1s").
WORKING = ".progress-text, .progress-level, .eta-bar, .meta-text, .meta-text-center, .generating, .pending"
TOAST = "[data-testid='toast-body'], .toast-body"  # Gradio's toasts (errors, warnings, information), quoted when a wait gives up
LIMIT_S = 900.0  # a bound on any one wait, however long the app keeps working
FAILED_SHOTS = Path("/tmp/kvscope-wait-failed")  # what the page showed when a wait gave up
_failures = itertools.count(1)


def wait_for_app(page: Page, locator: Locator, quiet_s: float = 180.0, state: str = "visible") -> None:
    """Wait until ``locator`` is in ``state`` (visible, hidden, ...) while the app keeps showing progress; raise
    Playwright's timeout once the app has shown none for ``quiet_s`` seconds (or after ``LIMIT_S``)."""
    started = last_working = time.monotonic()
    toasts: dict[str, None] = {}  # every toast shown during the wait, in order (they close after seconds)
    while True:
        try:
            locator.wait_for(timeout=1_000, state=state)
            return
        except PlaywrightTimeoutError:
            pass
        now = time.monotonic()
        toasts.update(dict.fromkeys(page.locator(TOAST).all_inner_texts()))
        if page.locator(WORKING).count():
            last_working = now
        if now - last_working > quiet_s or now - started > LIMIT_S:
            shot = _failed_shot(page)
            try:
                locator.wait_for(timeout=1, state=state)  # raises, naming the locator
            except PlaywrightTimeoutError as error:
                said = f"no progress for {now - last_working:.0f} s; toasts shown while waiting: {list(toasts)}; the page: {shot}"
                raise PlaywrightTimeoutError(f"{error.message}\n{said}") from None
            return


def fill_kept(locator: Locator, text: str, settle_ms: int = 500, tries: int = 5) -> None:
    """Fill ``locator`` with ``text`` and return once the value has held for ``settle_ms``. Gradio 6 mounts a closed
    accordion's fields when it opens, and a fill in that moment can be reset to the field's first value (seen on a
    loaded machine: the fleet test's replica counts emptied, the audit run without them); the fill is then repeated."""
    for _ in range(tries):
        locator.fill(text)
        locator.page.wait_for_timeout(settle_ms)
        if locator.input_value() == text:
            return
    raise AssertionError(f"{locator} did not keep {text!r} after {tries} fills (it holds {locator.input_value()!r})")


def _failed_shot(page: Page) -> Path:
    """A full-page screenshot of a wait that gave up, numbered in this process."""
    FAILED_SHOTS.mkdir(exist_ok=True)
    path = FAILED_SHOTS / f"{next(_failures)}-{int(time.time())}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def wait_for_audit(page: Page) -> None:
    """Until the audit under way has measured its turns: the token pass it shows first (its recommendation panel
    saying "Measuring:") replaced, and Cancel hidden. Call it once the audit has shown something of its own."""
    wait_for_app(page, page.locator("#audit-recommendation:not(:has-text('Measuring:'))"))
    wait_for_app(page, page.locator("#cancel-audit"), state="hidden")


def audit_bundled_log(page: Page, name: str, holds: str, tokens: int = 2, sample: int = 1) -> None:
    """In the Your prompt tab, bundled log ``name`` (its text holding ``holds``) audited with ``tokens`` greedy tokens
    on ``sample`` turns per change, waited for until its turns are measured."""
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-demo input").click()
    page.get_by_role("option", name=name, exact=True).click()
    page.wait_for_function(f"() => document.querySelector('#audit-input textarea').value.includes({holds!r})", timeout=30_000)
    page.locator("#audit-tokens input[type=number]").fill(str(tokens))
    page.locator("#audit-sample input[type=number]").fill(str(sample))
    page.locator("#run-audit").click()
    wait_for_audit(page)
