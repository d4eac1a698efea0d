"""Exported figure pages open offline: plotly.js is embedded, no script comes from the network, and chromium draws
every figure with every http(s) request refused."""

import re
from pathlib import Path

import plotly.graph_objects as go
import pytest

from kvscope.app.state import ExportFolder
from kvscope.viz.common import figures_html, plotly_js
from tests.shared import CHROMIUM, CHROMIUM_ARGS

REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc\s*=\s*[\"']?(https?:)?//", re.IGNORECASE)


def _figures() -> list[go.Figure]:
    return [go.Figure(go.Bar(x=["a", "b"], y=[1, 2])), go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2]))]


def test_a_figure_page_embeds_plotly_js_once_and_loads_no_remote_script():
    page = figures_html(_figures(), ["<p>view</p>"])
    assert page.count(plotly_js()) == 1 and len(plotly_js()) > 3_000_000
    assert REMOTE_SCRIPT.search(page) is None and 'src="https://cdn.plot.ly' not in page
    assert page.count('class="plotly-graph-div"') == 2 and page.endswith("<p>view</p></body></html>")
    assert plotly_js() not in figures_html([], ["<p>view</p>"])  # a page of views only needs no library


def test_an_export_embeds_plotly_js_and_its_cap_counts_only_what_the_session_wrote(tmp_path):
    folder = ExportFolder(max_bytes=64 * 1024, keep=2, root=tmp_path)
    json_path, html_path = folder.write({"a": 1}, _figures(), "x")
    page = html_path.read_text(encoding="utf-8")
    assert json_path.name == "x.json" and plotly_js() in page and REMOTE_SCRIPT.search(page) is None


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium is not installed (scripts/test.sh installs it)")
def test_chromium_draws_an_exported_page_with_the_network_refused(tmp_path):
    from playwright.sync_api import sync_playwright

    _, html_path = ExportFolder(2**20, keep=2, root=tmp_path).write({"a": 1}, _figures(), "x")
    refused = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.route(re.compile(r"^https?://"), lambda route: (refused.append(route.request.url), route.abort()))
        page.goto(html_path.as_uri())
        page.wait_for_function("document.querySelectorAll('.main-svg').length >= 2", timeout=30_000)
        drawn = page.evaluate("document.querySelectorAll('.js-plotly-plot').length")
        browser.close()
    assert drawn == 2 and refused == []
