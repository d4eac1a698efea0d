"""Jupyter's rich display of a Notebook: its numbers, spans and pending steps, every label escaped, no forward run."""

import torch

from kvscope.engine.cache import display
from kvscope.engine.cache.notebook import Notebook


def _ids(count: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 590, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_helpers_escape_everything_but_their_own_html():
    page = display.block("<b>title</b>", display.table([("<i>", 1.5, None)], header=("a&b", "x", "y")), subtitle="<s>")
    assert "&lt;b&gt;title&lt;/b&gt;" in page and "&lt;i&gt;" in page and "a&amp;b" in page and "&lt;s&gt;" in page
    assert "<i>" not in page and "<s>" not in page and page.count("<table") == 1 and "–" in page
    assert display.number(0.123456) == "0.1235" and display.number(2.0, 2, signed=True) == "+2.00" and display.number(None) == "–"
    assert display.card("<b>", display.fields([("k", "<v>")])).count("&lt;") == 2


def test_a_notebook_shows_tokens_segments_layers_heads_memory_and_pending_steps(lm):
    ids = _ids(30)
    notebook = Notebook.prefill(lm, ids[:20], ["context"] * 8 + ["field:<b>"] * 4 + ["context"] * 8).materialized()
    edited = notebook.replace(range(8, 12), ids[20:23])  # pending: 3 new tokens, the 4 old ones hidden
    page = edited._repr_html_()
    assert edited.pending_tokens == 3 and "_computed" not in edited.__dict__  # displaying ran no forward
    config = lm.model.config
    assert f"{len(edited)} tokens" in page and f"{len(edited)} visible, 4 hidden" in page
    assert f">{config.num_hidden_layers}<" in page and f">{config.num_key_value_heads}<" in page
    memory = sum(t.numel() * t.element_size() for t in (*notebook.computed_keys, *notebook.computed_values))
    assert f"{memory:,} bytes" in page
    assert "1 (3 tokens, computed by the next read)" in page
    assert "field:&lt;b&gt;" in page and "field:<b>" not in page  # a user-derived label is escaped
    assert ">8–10<" in page and ">0–7<" in page and ">11–18<" in page  # the runs of segments with their positions, in reading order
    assert "replace field:&lt;b&gt; at 8..11" in page  # the operation log
    done = edited.materialized()._repr_html_()
    assert "pending steps" in done and "none" in done


def test_a_long_notebook_shows_a_bounded_number_of_segment_rows(lm):
    labels = [f"s{i % 100}" for i in range(300)]  # 300 runs of one token
    page = Notebook.prefill(lm, _ids(300, 1), labels)._repr_html_()
    assert page.count("<tr>") < 80 and "more runs" in page and len(page) < 40_000
