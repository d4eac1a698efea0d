"""The Your prompt tab on a log recorded by a gateway, in Debian's chromium at 1,000 and 1,400 px: the bundled interleaved
log picked from the menu and audited shows its sessions, the causes of its misses in words, the sampled groups, and its
per-session timeline drawn with one row per session. Screenshots go to test-artifacts/."""

import pytest

from kvscope.app.handlers.audit_log import bundled_log_text
from kvscope.engine.audit.changes.causes import CAUSES
from tests.app.browser_waits import fill_kept, wait_for_app, wait_for_audit
from tests.app.test_browser import ARTIFACTS, CHROMIUM, TOAST, _plot_data, browser  # noqa: F401 (the module's browser fixture)
from tests.app.test_browser_labels import wide_page  # noqa: F401 (a page at 1,000 and 1,400 px)

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")
DEMO = "interleaved_agents"


def test_an_interleaved_log_shows_its_sessions_causes_groups_and_timeline(wide_page):  # noqa: F811
    page, width = wide_page
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-demo input").click()
    page.get_by_role("option", name=DEMO).click()
    page.wait_for_function("() => document.querySelector('#audit-input textarea').value.includes('forge-1')", timeout=30_000)
    assert page.locator("#audit-input textarea").input_value() == bundled_log_text(DEMO)
    page.locator("#audit-tokens input[type=number]").fill("2")
    page.locator("#audit-sample input[type=number]").fill("1")
    page.locator("#run-audit").click()
    traffic = page.locator("#audit-traffic")
    wait_for_app(page, traffic.get_by_text("Causes of the misses"))
    wait_for_audit(page)  # the token pass shows first, while the model pass measures
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    text = traffic.inner_text()
    assert "6 requests in 2 sessions" in text and "lines that gave no request of their own: 1" in text and "line 5, messages" in text, text
    rows = {cells[0]: cells for cells in (row.split("\t") for row in traffic.locator("table").first.inner_text().splitlines()[1:])}
    assert {"forge-1", "harbor-7"} == set(rows) and rows["forge-1"][1] == "3" and rows["harbor-7"][1] == "3", rows
    for cause in ("new_prefix", "clock", "block_straddle"):
        assert CAUSES[cause] in text, cause  # each cause named in the engine's words
    groups = page.locator("#audit-groups").inner_text()
    assert "change signatures" in groups and "clock:current_time" in groups and "not measured: a cold prefill" in groups, groups
    drawn = [trace for trace in _plot_data(page, "audit-sessions") if trace["name"] in {*CAUSES, "growth", "reused"}]  # markers
    assert {"new_prefix", "clock"} <= {trace["name"] for trace in drawn}
    assert sorted(x for trace in drawn for x in trace["x"]) == [1, 2, 3, 4, 5, 6]
    assert {y for trace in drawn for y in trace["y"]} == {"forge-1", "harbor-7"}  # one row per session
    engines = [trace["name"] for trace in _plot_data(page, "audit-engines")]
    assert [name.split(":")[0] for name in engines] == ["vLLM", "SGLang", "llama.cpp"]
    wait_for_app(page, page.locator("#audit-recommendation").get_by_text("Recommended:").first)  # the measured turns
    top, bottom = page.locator("#audit-traffic").bounding_box(), page.locator("#audit-groups").bounding_box()
    scrolled = page.evaluate("window.scrollY")  # boxes are in the viewport; a full-page clip is in the page
    clip = {"x": 0, "y": top["y"] + scrolled - 8, "width": width, "height": bottom["y"] + bottom["height"] - top["y"] + 16}
    page.screenshot(path=str(ARTIFACTS / f"audit-traffic-{width}px.png"), full_page=True, clip=clip)  # the traffic's panels


def test_a_rewrite_pasted_beside_the_log_is_measured_against_it(wide_page):  # noqa: F811
    page, width = wide_page
    if width != 1400:
        pytest.skip("once is enough")
    log = bundled_log_text("support_agent")
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-input textarea").fill(log)
    page.get_by_text("Measure a rewrite of this log").click()
    fill_kept(page.locator("#audit-rewritten textarea"), log)  # in the accordion just opened; identical: reuse and output unchanged
    page.locator("#audit-tokens input[type=number]").fill("2")
    page.locator("#run-rewrite").click()
    view = page.locator("#audit-rewrite")
    wait_for_app(page, view.get_by_text("first token unchanged").first)
    text = view.inner_text()
    assert "unchanged on 4/4" in text and "Answers that change" not in text, text
    page.screenshot(path=str(ARTIFACTS / "audit-rewrite.png"), full_page=True)
