"""The Your prompt tab's fleets in Debian's chromium at 1,000 and 1,400 px: replica counts given in the engine settings,
the bundled interleaved log audited, the fleet table lists every router at each count and the figure draws one line per
router in each engine's panel. Screenshots of the figure go to test-artifacts/ (fleet-<width>.png)."""

import pytest

from kvscope.viz.fleet import ROUTING_LABELS
from tests.app.browser_waits import fill_kept, wait_for_app
from tests.app.test_browser import ARTIFACTS, CHROMIUM, TOAST, _plot_data, browser  # noqa: F401 (the module's browser fixture)
from tests.app.test_browser_labels import wide_page  # noqa: F401 (a page at 1,000 and 1,400 px)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")


def test_fleets_show_a_table_and_a_line_per_router(wide_page):  # noqa: F811
    page, width = wide_page
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-demo input").click()
    page.get_by_role("option", name="interleaved_agents").click()
    page.wait_for_function("() => document.querySelector('#audit-input textarea').value.includes('forge-1')", timeout=30_000)
    page.locator("#audit-sample input[type=number]").fill("0")
    page.locator("#audit-engine-settings").get_by_text("Simulated engines").click()
    fill_kept(page.locator("#audit-replicas textarea"), "2,3")  # in the accordion just opened
    page.locator("#run-audit").click()
    table = page.locator("#audit-fleet-table")
    wait_for_app(page, table.get_by_text("the hit rate behind each router"))
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    rows = table.locator("table").inner_text().splitlines()[1:]
    assert len(rows) == 1 + 2 * 4 and all(label in table.inner_text() for label in ROUTING_LABELS.values()), rows
    drawn = _plot_data(page, "audit-fleet")
    assert {trace["name"] for trace in drawn} == {"one server", *ROUTING_LABELS.values()}
    assert all(trace["x"] == ["2", "3"] for trace in drawn)
    figure = page.locator("#audit-fleet")
    figure.scroll_into_view_if_needed()
    figure.screenshot(path=str(ARTIFACTS / f"fleet-{width}.png"))
