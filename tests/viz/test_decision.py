"""The decision figure escapes labels, answer strings and the title (plotly renders HTML in text)."""

from __future__ import annotations

import torch

from kvscope.engine.cache.decision import decide
from kvscope.viz.decision import decision_figure


def test_labels_strings_and_title_are_escaped():
    hostile = "<img src=x onerror=alert(1)>"
    decision = decide({hostile: {"<b>yes</b>": -0.5}, "no": {"no": -1.5}}, torch.zeros(4))
    figure = decision_figure(decision, title="<script>t</script>")
    text = figure.to_json()
    assert "<img" not in text and "<b>" not in text and "<script>" not in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in figure.data[0].x[0] and figure.data[1].text[0] == "&lt;b&gt;yes&lt;/b&gt;"
    assert figure.layout.title.text.startswith("&lt;script&gt;t&lt;/script&gt;: &lt;img")
    assert list(figure.data[0].y) == [-0.5, -1.5]
