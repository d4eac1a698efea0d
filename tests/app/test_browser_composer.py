"""The Composer in Debian's chromium, in the app's own theme at a 1,000 and a 1,400 px window: fast clicks end on the
last selection's result, a result for an earlier selection is marked, the keystone demo's context list shows the skill
its scenario places, and the scenario menu is not clipped. Screenshots go to test-artifacts/composer-*.png."""

import time
from pathlib import Path

import pytest

from tests.app.browser_waits import WORKING, wait_for_app
from tests.app.test_browser import ARTIFACTS, browser  # noqa: F401 (the module's fixture)
from tests.app.test_browser_layout import themed_url  # noqa: F401 (the app in its own theme)
from tests.shared import CHROMIUM

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (scripts/test.sh installs it)")
QUIET_S = 3.0  # how long the page must show no work before a test reads its final state
# Whether a dropdown's chosen text ends before its arrow: the text's width in the input's font, from the padding on.
TEXT_BEFORE_ARROW = """e => {
  const input = e.querySelector('input'), style = getComputedStyle(input), canvas = document.createElement('canvas').getContext('2d');
  canvas.font = style.font;
  const end = input.getBoundingClientRect().left + parseFloat(style.paddingLeft) + canvas.measureText(input.value).width;
  const arrow = e.querySelector('.icon-wrap, svg').getBoundingClientRect().left;
  return {end, arrow, fits: end <= arrow};
}"""


@pytest.fixture(params=[1000, 1400])
def composer(request, browser, themed_url):  # noqa: F811
    """The Composer tab at a ``request.param`` px window."""
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": request.param, "height": 1000})
    page.goto(themed_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))  # the page opens on Notes, its scenario prepared
    page.get_by_role("tab", name="Composer").click()
    wait_for_app(page, page.locator('#composer .kv-in[data-id="account_gate"]'))  # its default context
    yield page, request.param
    page.close()


def _settled(page) -> None:
    """Until the page has shown no work for ``QUIET_S`` seconds."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < QUIET_S:
        if page.locator(WORKING).count():
            quiet_since = time.monotonic()
        time.sleep(0.2)


def _add(page, skill: str) -> None:
    page.locator(f'#composer .kv-btn[data-act="add"][data-id="{skill}"]').click()


def test_fast_clicks_end_on_the_last_selections_result(composer):
    page, width = composer
    _add(page, "refund_policy")
    _add(page, "tone_guide")
    page.locator('#composer .kv-btn[data-act="remove"][data-index="0"]').click()  # account_gate out
    _add(page, "tool_specs")
    page.locator('#composer .kv-btn[data-act="up"][data-index="2"]').click()  # tool_specs before tone_guide
    last = "Computed for skills refund_policy, tool_specs, tone_guide · scenario pharmacy_prescription"
    metrics = page.locator("#compose-metrics")
    wait_for_app(page, metrics.get_by_text(last))
    _settled(page)  # no earlier selection's run may land after it
    chips = [chip.get_attribute("data-id") for chip in page.locator("#composer .kv-in").all()]
    assert chips == ["refund_policy", "tool_specs", "tone_guide"]
    assert last in metrics.inner_text() and page.locator("#compose-stale").inner_text().strip() == ""
    page.screenshot(path=str(ARTIFACTS / f"composer-fast-clicks-{width}.png"), full_page=True)


def test_a_result_for_an_earlier_selection_is_marked_until_it_is_recomputed(composer):
    page, width = composer
    page.locator("#run-compose").click()
    wait_for_app(page, page.locator("#compose-metrics").get_by_text("Computed for skills account_gate"))
    page.locator("#text-before textarea").fill("Shift notes follow.")
    stale = page.locator("#compose-stale")
    wait_for_app(page, stale.get_by_text("computed for an earlier selection"))
    assert "before differ" in stale.inner_text() and "Splice vs recompute" in stale.inner_text()
    page.screenshot(path=str(ARTIFACTS / f"composer-stale-{width}.png"), full_page=False)
    page.locator("#run-compose").click()
    wait_for_app(page, stale.get_by_text("earlier selection"), state="hidden")
    _settled(page)
    assert stale.inner_text().strip() == "" and "Computed for skills account_gate" in page.locator("#compose-metrics").inner_text()


def test_the_keystone_demo_lists_the_skill_its_scenario_splices_and_the_scenario_menu_fits(composer):
    page, width = composer
    page.locator("#keystone-demo").click()
    placed = page.locator('#composer .kv-placed[data-id="safety_gate"]')
    wait_for_app(page, placed)
    assert "placed by the scenario" in placed.inner_text() and not page.locator("#composer .kv-empty").count()
    metrics = page.locator("#compose-metrics")
    wait_for_app(page, metrics.get_by_text("scenario keystone_safety"))
    assert "Computed for skills none dragged in" in metrics.inner_text() and "context tokens spliced" in metrics.inner_text()
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / f"composer-keystone-demo-{width}.png"), full_page=False)
    menu, row = page.locator("#after-scenario").bounding_box(), page.locator("#composer").bounding_box()
    assert menu["x"] + menu["width"] <= row["x"] + row["width"] + 1 and menu["width"] >= 300, (menu, row)
    for name in ("keystone_safety", "pharmacy_prescription"):  # at 1,000 px the second ran under the menu's arrow
        page.locator("#after-scenario input").click()
        page.get_by_role("option", name=name, exact=True).click()
        text = page.locator("#after-scenario").evaluate(TEXT_BEFORE_ARROW)
        assert text["fits"], (name, text)
