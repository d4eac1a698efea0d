"""The Your prompt tab on a gateway log whose records say what the server cached, in Debian's chromium at 1,000 and
1,400 px: the observed line drawn beside the simulated engines, the shortfall requests marked on both timelines, the
formats read named, and the observed hit rate in words. Screenshots go to test-artifacts/."""

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.models import load_model
from tests.app.browser_waits import wait_for_app
from tests.app.conftest import TINY
from tests.app.test_browser import ARTIFACTS, CHROMIUM, TOAST, _plot_data, browser  # noqa: F401 (the module's browser fixture)
from tests.app.test_browser_labels import wide_page  # noqa: F401 (a page at 1,000 and 1,400 px)
from tests.engine.audit.simulate.test_observed import gateway_log

pytestmark = pytest.mark.skipif(not CHROMIUM, reason="Debian chromium is not installed (scripts/test.sh installs it)")
COUNTS = [0, 0, 16, 0, None, 16, 0, 32]  # two sessions, interleaved; request 5 reports no count


def test_observed_counts_are_drawn_beside_the_engines_with_the_shortfalls_marked(wide_page):  # noqa: F811
    text = gateway_log(COUNTS, sessions=2)
    if all(request.observed_cached_tokens is None for request in read_log(text).requests):
        pytest.skip("read_log does not yet read a gateway record's response usage (the exports readers fill it)")
    rows = scan_log(load_model(TINY).tokenizer, read_log(text)).requests
    short = sorted(row.request for row, count in zip(rows, COUNTS) if count is not None and count < row.reused_tokens["vllm"])
    assert short
    page, width = wide_page
    page.get_by_role("tab", name="Your prompt").click()
    page.locator("#audit-input textarea").fill(text)
    page.locator("#audit-tokens input[type=number]").fill("2")
    page.locator("#audit-sample input[type=number]").fill("0")
    page.locator("#run-audit").click()
    traffic = page.locator("#audit-traffic")
    wait_for_app(page, traffic.get_by_text("Observed beside simulated"))
    assert page.locator(TOAST).count() == 0, page.locator(TOAST).all_inner_texts()
    words = traffic.inner_text()
    assert "7 of 8 requests report a cached count; compared with vLLM" in words, words
    assert f"{len(short)} shortfall" in words, words
    rings = [t for t in _plot_data(page, "audit-sessions") if (t["name"] or "").startswith("observed shortfall")]
    assert len(rings) == 1 and sorted(rings[0]["x"]) == short and set(rings[0]["y"]) <= {"s1", "s2"}
    engines = {(t["name"] or "").split(":")[0]: t for t in _plot_data(page, "audit-engines")}
    assert {"vLLM", "SGLang", "llama.cpp", "observed"} <= set(engines)
    assert engines["observed"]["y"][4] is None and engines["observed"]["y"][0] == 0  # no count: a gap, never a zero
    assert sorted(engines["observed shortfall against vLLM"]["x"]) == short
    titles = page.locator("#audit-engines .gtitle").text_content() + page.locator("#audit-sessions .gtitle").text_content()
    assert titles.count("formats read:") == 2, titles
    top = page.locator("#audit-traffic").bounding_box()
    bottom = max(
        (page.locator(f"#{name}").bounding_box() for name in ("audit-sessions", "audit-engines")), key=lambda b: b["y"] + b["height"]
    )
    scrolled = page.evaluate("window.scrollY")
    clip = {"x": 0, "y": top["y"] + scrolled - 8, "width": width, "height": bottom["y"] + bottom["height"] - top["y"] + 16}
    page.screenshot(path=str(ARTIFACTS / f"audit-observed-{width}px.png"), full_page=True, clip=clip)
