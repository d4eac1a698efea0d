"""The audit tab's upload in Debian's chromium at a 1,000 px window: an uploaded log is read as a file (its name and size
shown, the text box left empty, the audit run on the file), a second upload replaces the first without clearing it
first, and text pasted into the box is audited instead. Cancel is hidden by the time the audit's result shows.
Screenshots go to test-artifacts/audit-upload-*.png."""

from pathlib import Path

import pytest

from kvscope.app.handlers.audit_log import size_words
from tests.app.browser_waits import wait_for_app, wait_for_audit
from tests.app.test_audit_tab import LOG
from tests.app.test_browser import ARTIFACTS, CHROMIUM, TOAST, browser  # noqa: F401 (the module's browser fixture)

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (scripts/test.sh installs it)")

# Records, at the first change of the page that shows the audit's recommendation, whether Cancel is still visible.
WATCH_DONE = """() => {
  window.cancelAtDone = undefined;
  const observer = new MutationObserver(() => {
    const shown = document.querySelector('#audit-recommendation');
    if (!shown || !shown.innerText.includes('Recommended:')) return;
    const cancel = document.querySelector('#cancel-audit');
    window.cancelAtDone = !!cancel && cancel.checkVisibility();
    observer.disconnect();
  });
  observer.observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true});
}"""


@pytest.fixture
def page(browser, app_url):  # noqa: F811
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1000, "height": 1000})
    page = context.new_page()
    page.goto(app_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))
    yield page
    context.close()


def _upload(page, path: Path) -> None:
    with page.expect_file_chooser() as chooser:
        page.locator("#audit-upload").click()
    chooser.value.set_files(str(path))


def _shot(page, name: str) -> None:
    """The tab's inputs, from the demo menu and the upload to the text box, as the page shows them."""
    top, bottom = page.locator("#audit-demo").bounding_box(), page.locator("#audit-input").bounding_box()
    scrolled = page.evaluate("window.scrollY")  # boxes are in the viewport; a full-page clip is in the page
    clip = {"x": 0, "y": top["y"] + scrolled - 16, "width": 1000, "height": bottom["y"] + 120 - top["y"]}
    page.screenshot(path=str(ARTIFACTS / f"audit-upload-{name}.png"), full_page=True, clip=clip)


def _audit(page, requests: int) -> None:
    """Audit and wait for the traffic panel to count ``requests`` requests (the log the audit read)."""
    page.locator("#run-audit").click()
    wait_for_app(page, page.locator("#audit-traffic").get_by_text(f"{requests} requests in 1 session"))
    wait_for_audit(page)


def test_an_upload_is_audited_as_a_file_and_a_second_replaces_it(page, tmp_path):
    first, second = tmp_path / "bike_desk.jsonl", tmp_path / "two_turns.jsonl"
    first.write_text(LOG, encoding="utf-8")
    second.write_text("\n".join(LOG.splitlines()[:2]), encoding="utf-8")
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-tokens input[type=number]").fill("2")
    info, text = page.locator("#audit-upload-info"), page.locator("#audit-input textarea")
    _upload(page, first)
    wait_for_app(page, info.get_by_text("bike_desk.jsonl"))
    assert f"bike_desk.jsonl · {size_words(first.stat().st_size)}" in info.inner_text()
    assert text.input_value() == ""  # the file is not pasted into the text box
    _shot(page, "first")
    page.evaluate(WATCH_DONE)
    _audit(page, 3)
    wait_for_app(page, page.locator("#audit-recommendation").get_by_text("Recommended:").first)
    assert page.evaluate("window.cancelAtDone") is False  # hidden by the time the result shows, not a step later
    _upload(page, second)  # no clearing first: the second upload replaces the first
    wait_for_app(page, info.get_by_text("two_turns.jsonl"))
    assert "bike_desk" not in info.inner_text() and size_words(second.stat().st_size) in info.inner_text()
    _shot(page, "second")
    _audit(page, 2)
    text.fill(LOG)  # text in the box is read instead of the upload
    _audit(page, 3)
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()


def test_an_empty_then_a_binary_upload_clear_the_earlier_logs_results_and_say_why(page, tmp_path):
    """After an audit, an empty file then a binary one: each time every panel is cleared and the traffic panel describes
    the file just given (the empty log; then why the binary one could not be read), once the error toast has gone too."""
    logged, empty, binary = tmp_path / "bike_desk.jsonl", tmp_path / "empty.jsonl", tmp_path / "photo.jsonl"
    logged.write_text(LOG, encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    binary.write_bytes(bytes(range(256)) * 8 + b"\n\x00\xff\n" * 4)
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-tokens input[type=number]").fill("2")
    traffic, recommendation = page.locator("#audit-traffic"), page.locator("#audit-recommendation")
    _upload(page, logged)
    wait_for_app(page, page.locator("#audit-upload-info").get_by_text("bike_desk.jsonl"))
    _audit(page, 3)
    wait_for_app(page, recommendation.get_by_text("Recommended:").first)
    _upload(page, empty)
    wait_for_app(page, page.locator("#audit-upload-info").get_by_text("empty.jsonl"))
    page.locator("#run-audit").click()
    wait_for_app(page, traffic.get_by_text("Nothing to audit yet"))
    assert "Recommended:" not in recommendation.inner_text() and "requests in" not in traffic.inner_text()
    _upload(page, binary)
    wait_for_app(page, page.locator("#audit-upload-info").get_by_text("photo.jsonl"))
    page.locator("#run-audit").click()
    wait_for_app(page, traffic.get_by_text("This log could not be audited"))
    page.locator(TOAST).first.wait_for(state="detached", timeout=30_000)  # the toast fades; the panel still says why
    said = traffic.inner_text()
    assert "no request of the log could be read" in said and "skipped" in said and "the log is empty" not in said, said
    assert "Recommended:" not in recommendation.inner_text() and page.locator("#cancel-audit").is_hidden()
    page.screenshot(path=str(ARTIFACTS / "audit-upload-failed.png"), full_page=True)
