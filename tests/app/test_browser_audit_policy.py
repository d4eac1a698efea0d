"""Download policy in Debian's chromium: after the bundled coding agent is audited, the button gives the policy file
and the LiteLLM config, and the policy's words name the field, what is done to it and its measured cost. Screenshot:
/tmp/policy-audit-{width}px.png."""

import pytest

from tests.app.browser_waits import audit_bundled_log, wait_for_app
from tests.app.test_browser import CHROMIUM, TOAST, browser  # noqa: F401 (the module's browser fixture)
from tests.app.test_browser_labels import wide_page  # noqa: F401 (a page at 1,000 and 1,400 px)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")


def test_download_policy_shows_the_fields_their_repairs_and_their_cost(wide_page):  # noqa: F811
    page, width = wide_page
    audit_bundled_log(page, "coding_agent", "Session started")
    page.locator("#download-policy").click()
    words = page.locator("#policy-words")
    wait_for_app(page, words.get_by_text("repaired at the gateway"))
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    text = words.inner_text()
    assert "session_started" in text and "Session started: {session_started}" in text and "KVSCOPE_POLICY" in text
    files = page.locator("#policy-files").inner_text().replace("\n", "")  # Gradio breaks a name before its suffix
    assert "kvscope-policy.json" in files and "config.yaml" in files
    words.scroll_into_view_if_needed()
    page.screenshot(path=f"/tmp/policy-audit-{width}px.png", full_page=True)
