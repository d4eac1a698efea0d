"""The app's plots, menus and tabs at a 1,000 and a 1,400 px window in Debian's chromium: plots in a row of two wrap to
one per row rather than shrink below 560 px, the remedy menu's text stops before its arrow, and every tab shows (none
under an overflow menu). Screenshots of the tabs go to test-artifacts/tabs-*.png."""

from pathlib import Path

import pytest

from kvscope.app.page import PAIRED_PLOT_MIN_WIDTH
from tests.app.browser_waits import wait_for_app
from tests.app.conftest import launched
from tests.app.test_browser import ARTIFACTS
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


TABS = ["Model", "Notes", "Your prompt", "Probes", "Models", "Composer", "Benchmarks", "Learn"]


@pytest.fixture(scope="module")
def themed_url(registry):
    """The app as ``kvscope-app`` serves it, in its own theme (the other tests' app has Gradio's default theme, whose
    narrower type fits the tabs in one row)."""
    from kvscope.app.ui import build_app, theme

    blocks = build_app(registry)
    yield launched(blocks, theme=theme())
    blocks.close()


@pytest.mark.parametrize("window", [1000, 1400])
def test_every_tab_shows_at_1000_and_1400_px_none_under_an_overflow_menu(browser, themed_url, window):
    """At 1,000 px Gradio's overflow menu ("⋯") hid Benchmarks and Learn: the tabs wrap onto a second row instead."""
    page = browser.new_page(viewport={"width": window, "height": 900})
    page.goto(themed_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))
    tabs = page.get_by_role("tab")
    assert [tab.inner_text() for tab in tabs.all()] == TABS
    hidden = [tab.inner_text() for tab in tabs.all() if not tab.is_visible()]
    assert hidden == [] and not page.get_by_role("button", name="More tabs").is_visible(), hidden
    boxes = [tab.bounding_box() for tab in tabs.all()]
    assert all(box["x"] >= 0 and box["x"] + box["width"] <= window for box in boxes), boxes
    page.get_by_role("tab", name="Learn").click()  # reachable in one click
    page.locator("#learn-1").wait_for()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"tabs-{window}px.png"), clip={"x": 0, "y": 0, "width": window, "height": 320})
    page.close()
