"""Every figure of kvscope/viz/ fits the width the app gives it at a 1,000 and a 1,400 px window: drawn by plotly.js in Debian's
chromium, no text label's box overlaps another's or leaves the figure, nothing sits under the label Gradio draws over
a plot's top-left corner, and no title, note, annotation or name keeps a template's ``{`` or ``}``. Screenshots of every
figure at both widths go to /tmp/figures/ (to look at)."""

from __future__ import annotations

import re
from pathlib import Path

import plotly.offline
import pytest

from kvscope.viz.common import GRADIO_LABEL_PX
from tests.shared import CHROMIUM, CHROMIUM_ARGS
from tests.viz.figure_cases import WIDTHS, every_case, figure_builders

SHOTS = Path("/tmp/figures")
ARGS = CHROMIUM_ARGS


@pytest.fixture(scope="module")
def cases(lm, experiment, length_change):
    return every_case(lm, experiment, length_change)


def _texts(figure) -> list[tuple[str, str]]:
    """Every text a reader sees outside hover: title and subtitle, annotations (subplot titles, line labels), axis
    titles, trace names and trace text."""
    layout = figure.layout
    found = [("title", layout.title.text), ("subtitle", layout.title.subtitle.text)]
    found += [("annotation", annotation.text) for annotation in layout.annotations]
    found += [(name, axis.title.text) for name in dir(layout) if re.fullmatch(r"[xy]axis\d*", name) for axis in [layout[name]]]
    for trace in figure.data:
        found.append(("trace name", trace.name))
        text = getattr(trace, "text", None)
        found += [("trace text", item) for item in ([text] if isinstance(text, str) else text or ()) if isinstance(item, str)]
    return [(where, text) for where, text in found if text]


def test_every_builder_is_drawn(cases):
    assert figure_builders() == {case.builder for case in cases}


def test_no_template_braces_are_left_in_any_figure(cases):
    left = [(case.builder, where, text) for case in cases for where, text in _texts(case.figure) if "{" in text or "}" in text]
    assert left == []


def test_the_keystone_subtitle_reads_both_stale_margins(cases):
    figures = [case.figure for case in cases if case.builder == "keystone_figure"]
    assert len(figures) == 3  # the tiny model's, and the embedded model's stored run with two remedies
    for figure in figures:
        title = re.sub(r"</sup><br><sup>", " ", figure.layout.title.text)  # its note, unwrapped
        assert re.search(r"stale margin composed [+-]\d+\.\d\d vs recomputed [+-]\d+\.\d\d", title), title


# Boxes of every text label plotly drew, by kind; a tick label is compared with the other ticks of its own axis only,
# tilted ones by the distance between their parallel baselines (their boxes overlap while their text does not).
MEASURE = """
async ([json, width]) => {
  const div = document.getElementById('figure');
  div.style.width = width + 'px';
  Plotly.purge(div);
  const figure = JSON.parse(json);
  await Plotly.newPlot(div, figure.data, figure.layout, {responsive: false});
  const svg = div.querySelector('.main-svg').getBoundingClientRect();
  const labels = [];
  const add = (kind, element, group) => {
    const style = getComputedStyle(element);
    if (style.display === 'none' || style.visibility === 'hidden' || Number(style.opacity) === 0) return;
    if (element.closest('[style*="display: none"], [opacity="0"]')) return;
    const box = element.getBoundingClientRect();
    if (box.width < 1 || box.height < 1) return;
    const text = (element.textContent || '').trim();
    if (!text && kind !== 'legend') return;
    labels.push({kind, group, text: text.slice(0, 60), box: {l: box.left, r: box.right, t: box.top, b: box.bottom}, element});
  };
  div.querySelectorAll('.infolayer .gtitle, .infolayer .gtitle-subtitle').forEach(e => add('title', e, 'title'));
  div.querySelectorAll('.infolayer g[class^="g-"][class$="title"]:not(.g-gtitle) text').forEach(e => add('axis title', e, 'axis title'));
  div.querySelectorAll('.legend .traces').forEach(e => add('legend', e, 'legend'));
  div.querySelectorAll('.legend .legendtitletext').forEach(e => add('legend', e, 'legend'));
  div.querySelectorAll('.annotation').forEach(e => add('annotation', e, 'annotation'));
  div.querySelectorAll('.bartext, .textpoint text').forEach(e => add('trace text', e, 'trace text'));
  div.querySelectorAll('.colorbar .cbtitle, .colorbar .cbaxis text').forEach(e => add('colour bar', e, 'colour bar'));
  for (const layer of div.querySelectorAll('.xaxislayer-above, .yaxislayer-above')) {
    const axis = layer.closest('.subplot') ? layer.closest('.subplot').getAttribute('class') : '';
    layer.querySelectorAll('.xtick text, .ytick text, .x2tick text').forEach(e =>
      add('tick', e, 'tick ' + axis + (layer.classList.contains('xaxislayer-above') ? ' x' : ' y')));
  }
  const problems = [];
  const name = label => `${label.kind} "${label.text}"`;
  for (const label of labels) {
    const b = label.box;
    if (b.l < svg.left - 1 || b.r > svg.right + 1 || b.t < svg.top - 1 || b.b > svg.bottom + 1)
      problems.push(`${name(label)} leaves the figure (${Math.round(b.l - svg.left)}..${Math.round(b.r - svg.left)} x `
        + `${Math.round(b.t - svg.top)}..${Math.round(b.b - svg.top)} in ${Math.round(svg.width)} x ${Math.round(svg.height)})`);
    if (label.kind !== 'tick' && label.kind !== 'trace text' && b.t - svg.top < %(gradio)d && b.l - svg.left < 0.4 * svg.width)
      problems.push(`${name(label)} sits under Gradio's label (top ${Math.round(b.t - svg.top)} px)`);
  }
  for (let i = 0; i < labels.length; i++) for (let j = i + 1; j < labels.length; j++) {
    const [a, c] = [labels[i], labels[j]];
    if (a.element.contains(c.element) || c.element.contains(a.element)) continue;
    if (a.kind === 'tick' && c.kind === 'tick') {
      if (a.group !== c.group) continue;
      const angle = Math.abs(((a.element.getAttribute('transform') || '').match(/rotate\\((-?[\\d.]+)/) || [0, 0])[1]);
      if (angle > 0 && angle < 90) {
        const dx = Math.abs(a.box.r - c.box.r);  // a tilted label ends at its tick, the top right of its box
        const size = parseFloat(getComputedStyle(a.element).fontSize);
        if (dx * Math.sin(angle * Math.PI / 180) < 0.8 * size) problems.push(`${name(a)} overlaps ${name(c)} (rotated ${angle}°)`);
        continue;
      }
    }
    const x = Math.min(a.box.r, c.box.r) - Math.max(a.box.l, c.box.l);
    const y = Math.min(a.box.b, c.box.b) - Math.max(a.box.t, c.box.t);
    if (x > 1.5 && y > 1.5) problems.push(`${name(a)} overlaps ${name(c)} by ${Math.round(x)} x ${Math.round(y)} px`);
  }
  return problems;
}
""" % {"gradio": GRADIO_LABEL_PX}


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (scripts/test.sh installs it)")
    from playwright.sync_api import sync_playwright

    folder = tmp_path_factory.mktemp("plotly")
    (folder / "plotly.min.js").write_text(plotly.offline.get_plotlyjs(), encoding="utf-8")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_content('<html><body style="margin:0;font-family:sans-serif"><div id="figure"></div></body></html>')
        page.add_script_tag(path=str(folder / "plotly.min.js"))
        yield page
        browser.close()


@pytest.mark.parametrize("window", sorted(WIDTHS["full"]))
def test_every_figure_fits_its_width_in_the_app_without_overlapping_labels(cases, page, window):
    SHOTS.mkdir(exist_ok=True)
    problems = []
    for index, case in enumerate(cases):
        found = page.evaluate(MEASURE, [case.figure.to_json(), case.width(window)])
        page.locator("#figure").screenshot(path=str(SHOTS / f"{index:02d}-{case.builder}-{window}.png"))
        problems += [f"{index:02d} {case.builder} at {case.width(window)} px: {problem}" for problem in found]
    assert problems == [], "\n".join(problems)


# The keystone's point labels as chromium draws them: each inside the plot area (plotly clips text past it), clear of
# every marker but its own, and nearer its own than any other (or it reads as another point's label).
KEYSTONE_LABELS = """
async ([json, width]) => {
  const div = document.getElementById('figure');
  div.style.width = width + 'px';
  Plotly.purge(div);
  const figure = JSON.parse(json);
  await Plotly.newPlot(div, figure.data, figure.layout, {responsive: false});
  const svg = div.querySelector('.main-svg').getBoundingClientRect(), size = div._fullLayout._size;
  const area = {l: svg.left + size.l, r: svg.left + size.l + size.w, t: svg.top + size.t, b: svg.top + size.t + size.h};
  const box = e => { const b = e.getBoundingClientRect(); return {l: b.left, r: b.right, t: b.top, b: b.bottom}; };
  const traces = div.querySelectorAll('.scatterlayer .trace');
  const strategies = traces[traces.length - 1];
  const texts = Array.from(strategies.querySelectorAll('.textpoint text'), e => ({text: e.textContent, box: box(e)}));
  const points = Array.from(strategies.querySelectorAll('.points path.point'), box);
  const clash = (a, c) => Math.min(a.r, c.r) - Math.max(a.l, c.l) > 1 && Math.min(a.b, c.b) - Math.max(a.t, c.t) > 1;
  const problems = [];
  texts.forEach((label, i) => {
    const b = label.box;
    if (b.l < area.l - 1 || b.r > area.r + 1 || b.t < area.t - 1 || b.b > area.b + 1)
      problems.push(`"${label.text}" leaves the plot area (${Math.round(b.l - area.l)}..${Math.round(b.r - area.l)} x `
        + `${Math.round(b.t - area.t)}..${Math.round(b.b - area.t)} in ${Math.round(size.w)} x ${Math.round(size.h)})`);
    points.forEach((point, j) => { if (j !== i && clash(b, point)) problems.push(`"${label.text}" covers point ${j}`); });
    const middle = box => [(box.l + box.r) / 2, (box.t + box.b) / 2];
    const away = point => Math.hypot(middle(b)[0] - middle(point)[0], middle(b)[1] - middle(point)[1]);
    const nearest = points.reduce((best, point, j) => away(point) < away(points[best]) ? j : best, 0);
    if (nearest !== i) problems.push(`"${label.text}" sits nearer point ${nearest} than its own`);
    texts.forEach((other, j) => { if (j > i && clash(b, other.box)) problems.push(`"${label.text}" overlaps "${other.text}"`); });
  });
  return {count: texts.length, problems};
}
"""


@pytest.mark.parametrize("window", sorted(WIDTHS["full"]))
def test_the_keystone_labels_stay_inside_the_plot_area_apart_from_each_other_and_the_points(page, window):
    from kvscope.viz.compose import keystone_figure
    from tests.viz.figure_cases import stored_keystone

    SHOTS.mkdir(exist_ok=True)
    problems = []
    for remedy in ("prefix+seam:16", "splice", "seam:1", "prefix+ape:1,0.7", "prefix+seam:1+blend:0.7"):
        figure = keystone_figure(stored_keystone(remedy))
        found = page.evaluate(KEYSTONE_LABELS, [figure.to_json(), WIDTHS["full"][window]])
        assert found["count"] == len(figure.data[2].x)
        page.locator("#figure").screenshot(path=str(SHOTS / f"keystone-{re.sub(r'[^a-z0-9]+', '_', remedy)}-{window}.png"))
        problems += [f"{remedy} at {window} px: {problem}" for problem in found["problems"]]
    assert problems == [], "\n".join(problems)
