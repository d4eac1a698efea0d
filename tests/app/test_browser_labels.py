"""What a first visit reads on the figures and menus, in Debian's chromium at 1,000 and 1,400 px: every figure has a
label saying what it shows, its text stays inside the figure without overlapping, and the names of strategies, repairs
and remedies come with their one-line explanation. Screenshots go to test-artifacts/."""

import re

import pytest

from kvscope.engine.audit.measure.repairs import REPAIR_SUMMARIES
from kvscope.engine.cache.decision import RECOVERY_WORDS
from kvscope.engine.edit.strategies import REGISTRY
from tests.app.browser_waits import wait_for_app
from tests.app.test_browser import ARTIFACTS, CHROMIUM, TOAST, browser  # noqa: F401 (the module's browser fixture)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")
WIDTHS = (1000, 1400)

# Every text element of a drawn figure that lies outside the figure, and every pair of point labels, annotations and
# legend entries whose boxes overlap (1 px of slack): {"outside": [...], "overlaps": [[a, b], ...]}.
FIT_JS = """(root) => {
  const frame = root.getBoundingClientRect();
  const shown = (node) => node.textContent.trim() && node.getBoundingClientRect().width > 0;
  const texts = Array.from(root.querySelectorAll("svg text")).filter(shown);
  const outside = texts.filter((node) => {
    const box = node.getBoundingClientRect();
    return box.left < frame.left - 1 || box.right > frame.right + 1 || box.top < frame.top - 1 || box.bottom > frame.bottom + 1;
  }).map((node) => node.textContent);
  const labels = Array.from(root.querySelectorAll(".textpoint text, .annotation-text, .legendtext, text[class$=title]")).filter(shown);
  const overlaps = [];
  labels.forEach((a, i) => labels.slice(i + 1).forEach((b) => {
    const p = a.getBoundingClientRect(), q = b.getBoundingClientRect();
    const apart = p.right <= q.left + 1 || q.right <= p.left + 1 || p.bottom <= q.top + 1 || q.bottom <= p.top + 1;
    if (!apart) overlaps.push([a.textContent, b.textContent]);
  }));
  return {outside, overlaps};
}"""


@pytest.fixture(params=WIDTHS, ids=lambda width: f"{width}px")
def wide_page(request, browser, app_url):  # noqa: F811
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": request.param, "height": 900})
    page = context.new_page()
    page.goto(app_url)
    wait_for_app(page, page.locator("#baseline").get_by_text("Now"))
    yield page, request.param
    context.close()


def _plots(page, container: str) -> list:
    """The drawn figures (plotly roots) inside ``container``, each waited for."""
    roots = page.locator(f"{container} .js-plotly-plot")
    wait_for_app(page, roots.first.locator(".main-svg").first)
    return [roots.nth(index) for index in range(roots.count())]


def _label(root) -> str:
    """The Gradio label shown above a figure."""
    return root.evaluate(
        "node => { const block = node.closest('.block'); const label = block && block.querySelector('[data-testid=\"block-label\"]');"
        " return label ? label.textContent.trim() : ''; }"
    )


def _check_figures(page, container: str, width: int, name: str) -> list[str]:
    """Every figure in ``container`` is labelled (not "Plot") and its text fits (screenshot first); returns the labels."""
    labels, problems = [], []
    for root in _plots(page, container):
        root.scroll_into_view_if_needed()
        label = _label(root)
        fit = root.evaluate(FIT_JS)
        if not label or label == "Plot":
            problems.append(f"a figure labelled {label!r}")
        if fit["outside"]:
            problems.append(f"{label!r}: text outside the figure {fit['outside']}")
        if fit["overlaps"]:
            problems.append(f"{label!r}: overlapping text {fit['overlaps']}")
        labels.append(label)
    page.screenshot(path=str(ARTIFACTS / f"labels-{name}-{width}.png"), full_page=True)
    assert not problems, f"{name} at {width} px: " + "; ".join(problems)
    return labels


def test_models_figures_are_labelled_and_fit(wide_page):
    page, width = wide_page
    page.get_by_role("tab", name="Models").click()
    page.locator("#compare-run").click()
    wait_for_app(page, page.locator("#compare-summary table").or_(page.locator(TOAST)).first)
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    labels = _check_figures(page, "#compare-share, #compare-metrics", width, "models")
    assert len(set(labels)) == 2
    cells = page.locator("#compare-summary th, #compare-summary td").evaluate_all(
        "cells => cells.map(cell => { const range = document.createRange(); range.selectNodeContents(cell);"
        " return [cell.textContent.trim(), range.getClientRects().length]; })"
    )
    broken = [text for text, lines in cells if " " not in text and lines > 1]
    assert cells and not broken, f"one-word table cells broken across lines at {width} px: {broken}"


def test_learn_figures_are_labelled_and_fit(wide_page):
    page, width = wide_page
    page.get_by_role("tab", name="Learn").click()
    for step in (2, 4):
        page.locator(f"#learn-{step}").click()
        wait_for_app(page, page.locator(f"#learn-{step}-result p").first.or_(page.locator(TOAST)).first)
        assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    labels = _check_figures(page, "#learn-2-plot, #learn-4-plot", width, "learn")
    assert len(set(labels)) == 2
    cards = page.locator("#learn-2-result")
    for name in ("field_only", "full_downstream"):
        assert cards.locator(f'[data-strategy="{name}"] [title]').first.get_attribute("title") == REGISTRY[name].summary
    assert RECOVERY_WORDS in cards.inner_text()


def test_benchmark_figures_are_labelled_distinct_and_fit(wide_page):
    page, width = wide_page
    page.get_by_role("tab", name="Benchmarks").click()
    page.locator("#bench-refresh").click()
    labels = _check_figures(page, "[id^=bench-plot-]", width, "benchmarks")
    assert len(labels) > 10 and len(set(labels)) == len(labels), labels
    page.locator("#bench-pick input").click()  # one stored result's JSON, picked by its file name
    page.get_by_role("option", name="observed_fit-cpu").click()
    wait_for_app(page, page.get_by_text('"server_setting_among_the_best"'))


def test_names_come_with_their_explanations(wide_page):
    page, width = wide_page
    page.get_by_role("tab", name="Notes").click()
    strategies = page.locator("#strategies").inner_text()
    assert all(REGISTRY[name].summary in strategies for name in ("field_only", "field_topk", "restate", "full_downstream"))
    page.get_by_role("tab", name="Your prompt").click()
    repairs = page.locator("#audit-repairs").inner_text()
    assert all(summary in repairs for summary in REPAIR_SUMMARIES.values())
    page.get_by_role("tab", name="Composer").click()
    menu = page.locator("#remedy")
    menu.locator("input").click()
    options = page.get_by_role("option").all_inner_texts()
    assert options and all(re.search("full recompute|^auto|not measured", option) for option in options), options
    page.keyboard.press("Escape")
    page.locator("#run-compose").click()
    metrics = page.locator("#compose-metrics")
    wait_for_app(page, metrics.get_by_text("cosine").or_(page.locator(TOAST)).first)
    assert "recomputed against the real prefix" in metrics.inner_text()
    _check_figures(page, "#logits-plot, #deviation-plot", width, "composer")
