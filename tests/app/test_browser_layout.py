"""The app's plots and menus at a 1,000 and a 1,400 px window in Debian's chromium: plots in a row of two wrap to one
per row rather than shrink below 560 px, and the remedy menu's text stops before its arrow."""

from pathlib import Path

import pytest

from app.page import PAIRED_PLOT_MIN_WIDTH
from tests.app.browser_waits import wait_for_app
from tests.shared import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (scripts/test.sh installs it)")
PAIRS = {"Notes": [("strategy-plot", "frontier-plot"), ("attention-plot", "notes-plot")], "Composer": [("logits-plot", "deviation-plot")]}


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _box(page, elem_id: str) -> dict:
    box = page.locator(f"#{elem_id}").bounding_box()
    return {"x": box["x"], "y": box["y"], "w": box["width"]}


@pytest.mark.parametrize("window", [1000, 1400])
def test_paired_plots_wrap_rather_than_shrink_and_the_remedy_menu_stops_before_its_arrow(browser, app_url, window):
    page = browser.new_page(viewport={"width": window, "height": 1000})
    page.goto(app_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))
    for tab, pairs in PAIRS.items():
        page.get_by_role("tab", name=tab).click()
        for left, right in pairs:
            page.locator(f"#{right}").wait_for()
            first, second = _box(page, left), _box(page, right)
            assert min(first["w"], second["w"]) >= PAIRED_PLOT_MIN_WIDTH, (window, left, first, second)
            side_by_side = abs(first["y"] - second["y"]) < 1 and second["x"] > first["x"]
            assert side_by_side == (window == 1400), (window, left, first, second)
    menu = page.evaluate(
        """(() => { const input = document.querySelector('#remedy input'), arrow = document.querySelector('#remedy .icon-wrap');
        const style = getComputedStyle(input);
        const text_right = input.getBoundingClientRect().right - parseFloat(style.paddingRight);
        return {text_right, arrow_left: arrow.getBoundingClientRect().left, overflow: style.textOverflow}; })()"""
    )
    assert menu["text_right"] <= menu["arrow_left"] and menu["overflow"] == "ellipsis", menu
    page.close()
