"""What a first visit trips over (issue 35), clicked in chromium: one number per quantity, results of an older
scenario cleared, the Composer's speed measured side by side, Open in Notes on the model's own answers. Screenshots of
every tab at 1,000 and 1,400 px go to test-artifacts/."""

import re

import pytest

from tests.app.browser_waits import wait_for_app, wait_for_audit
from tests.app.test_browser import ARTIFACTS, _audit, _shot, browser, page  # noqa: F401 (the module's fixtures)

TABS = ("Notes", "Your prompt", "Probes", "Models", "Composer", "Benchmarks", "Learn", "Model")


def _margin(text: str) -> str:
    return re.search(r"margin ([+−-]\d+\.\d\d)", text).group(1)


def test_the_prepared_margin_is_the_stale_cards_margin(page):  # noqa: F811
    baseline = page.locator("#baseline").inner_text()
    page.locator("#run-edit").click()
    stale = page.locator('#strategy-cards [data-strategy="stale"]')
    wait_for_app(page, stale)
    assert stale.get_attribute("data-margin") == _margin(baseline)
    _shot(page, "first-visit-notes-margins")


def test_learn_steps_two_and_three_show_one_notes_share(page):  # noqa: F811
    page.get_by_role("tab", name="Learn").click()
    shares = []
    for step in (2, 3):
        page.locator(f"#learn-{step}").click()
        headline = page.locator(f"#learn-{step}-result #notes-headline")
        wait_for_app(page, headline)
        shares.append(headline.get_attribute("data-share"))
    assert shares[0] == shares[1] != ""
    _shot(page, "first-visit-learn-shares")


def test_the_composer_names_its_scenario_and_times_both_sides_in_one_run(page):  # noqa: F811
    page.get_by_role("tab", name="Composer").click()
    assert page.locator("#after-scenario input").input_value() == "pharmacy_prescription"
    page.locator("#run-compose").click()
    metrics = page.locator("#compose-metrics")
    wait_for_app(page, metrics.get_by_text("both timed in this run"))
    text = metrics.inner_text()
    splice, full, ratio = re.search(r"splice (\d+) ms .* vs full (\d+) ms .* speedup ×([\d.]+) \(full ÷ splice\)", text).groups()
    shown = int(full) / int(splice)  # the ratio of the two times shown, each rounded to a whole ms
    rounding = shown * (0.5 / int(splice) + 0.5 / int(full))
    assert float(ratio) == pytest.approx(shown, abs=rounding + 0.01)
    assert "median of 2 rounds" in text and "skills compiled in" in text and "reused" not in text
    _shot(page, "first-visit-composer")


def test_open_in_notes_says_first_what_it_reads_and_clears_the_older_scenarios_results(page):  # noqa: F811
    page.get_by_text("Knockout: hide tokens from the decision").click()
    page.locator("#run-edit").click()
    wait_for_app(page, page.locator('#strategy-cards [data-strategy="oracle"]'))
    page.locator("#run-knockout").click()
    wait_for_app(page, page.locator("#knockout-result").get_by_text("Knocked out"))
    page.locator("#copy-link").click()
    page.wait_for_function("() => document.querySelector('#permalink textarea').value.startsWith('http')", timeout=30_000)
    _audit(page)
    status = page.locator("#audit-open-status")
    # said before the button is pressed (the progress line while it is measured starts "Open in Notes:" too)
    wait_for_app(page, status.get_by_text("next-token KL"))
    said = status.inner_text()
    # judged against the audit's own noise floor (the panel may still be drawing when the status is said)
    wait_for_app(page, page.locator("#audit-recommendation").get_by_text("noise floor (recompute vs the clean prefill): KL").first)
    assert "next-token KL" in said and re.search(r"margin [+−-]\d\.\d\d → [+−-]\d\.\d\d", said)
    page.locator("#audit-open-notes").click()
    wait_for_app(page, page.locator('#strategy-cards [data-strategy="oracle"]'))
    wait_for_app(page, page.locator("#baseline").get_by_text("session_started"))
    assert page.get_by_role("tab", name="Notes").get_attribute("aria-selected") == "true"
    assert page.locator("#scenario input").input_value() == ""  # no bundled scenario claims the audited prompt
    assert page.locator("#knockout-result").inner_text().strip() == ""
    assert page.locator("#permalink textarea").input_value() == ""
    editor = page.locator("#scenario-editor").inner_text()
    assert "{session_started}" in editor and '"yes" = ["yes"]' not in editor  # the model's own answers
    _shot(page, "first-visit-open-in-notes")
    page.get_by_role("tab", name="Your prompt").click()
    assert "Loaded into the Notes tab" in status.inner_text()
    page.locator("#audit-demo input").click()
    page.get_by_role("option", name="support_agent").click()
    page.wait_for_function("() => document.querySelector('#audit-input textarea').value.includes('harbor-support')", timeout=30_000)
    page.locator("#run-audit").click()
    page.wait_for_function(
        "() => !document.querySelector('#audit-open-status').innerText.includes('Loaded into the Notes tab')", timeout=300_000
    )
    wait_for_app(page, status.get_by_text("Open in Notes:"))
    wait_for_audit(page)  # the token pass shows first; the fields are offered once the turns are measured
    assert "account_tier" in status.inner_text() or "nothing to open" in status.inner_text()


@pytest.mark.parametrize("width", (1000, 1400))
def test_every_tab_at_classroom_widths(browser, app_url, width):  # noqa: F811
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": width, "height": 900})
    shot = context.new_page()
    shot.goto(app_url)
    wait_for_app(shot, shot.locator("#baseline").get_by_text("Now"))
    for name in TABS:
        shot.get_by_role("tab", name=name, exact=True).click()
        shot.wait_for_timeout(400)
        width_px = shot.evaluate("() => document.documentElement.scrollWidth")
        assert width_px <= width + 1, f"{name} scrolls sideways at {width} px ({width_px} px wide)"
        shot.screenshot(path=str(ARTIFACTS / f"tab-{name.lower().replace(' ', '-')}-{width}.png"), full_page=True)
    context.close()
