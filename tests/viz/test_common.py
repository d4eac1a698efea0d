"""Safe labels, column pooling and token axes shared by the figures."""

import numpy as np
import pytest

from kvscope.viz.common import (
    MAX_COLUMNS,
    MAX_TICKS,
    column_of,
    pool_columns,
    safe_label,
    safe_lines,
    token_columns,
)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (" shipped", "·shipped"),
        ("ok \n", "ok ⏎"),
        ("  x  ", "··x··"),
        ("a\tb\r\n", "a⇥b␍⏎"),
        ("   ", "···"),
        ("", "∅"),
        ("x\x00y\x1b[31m", "x�y�[31m"),
        ("\u202eevil\u200b", "�evil�"),
        ("<b>&amp;</b>", "&lt;b&gt;&amp;amp;&lt;/b&gt;"),
        ("in the middle", "in the middle"),
    ],
)
def test_safe_label_shows_whitespace_and_neutralises_controls_and_html(text, shown):
    assert safe_label(text) == shown


def test_safe_label_truncates_before_escaping():
    assert safe_label("abcdefgh", 5) == "abcd…"
    assert safe_label("<<<<<<<<", 3) == "&lt;&lt;…"


def test_safe_lines_wraps_for_hover():
    lines = safe_lines("word " * 30, 20).split("<br>")
    assert len(lines) > 1 and all(len(line) <= 20 for line in lines)


def test_pool_columns_keeps_small_maps_and_caps_big_ones_keeping_signed_peaks():
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    same, runs = pool_columns(small)
    assert np.array_equal(same, small) and [list(r) for r in runs] == [[0], [1], [2]]
    big = np.zeros((3, 2000), dtype=np.float32)
    big[1, 1234] = -5.0
    pooled, runs = pool_columns(big)
    assert pooled.shape[0] == 3 and pooled.shape[1] <= MAX_COLUMNS and pooled.dtype == np.float32
    assert sum(len(r) for r in runs) == 2000
    assert pooled[1, column_of(runs, 1234)] == -5.0 and np.count_nonzero(pooled) == 1


def test_token_columns_are_unique_and_ticks_thinned():
    texts = ["\n"] * 100
    names, axis = token_columns(pool_columns(np.zeros((1, 100)))[1], texts, segments=["context"] * 100)
    assert len(set(names)) == 100 and names[0] == "#0 ⏎ [context]"
    assert len(axis["tickvals"]) <= MAX_TICKS and set(axis["tickvals"]) <= set(names)
    assert axis["ticktext"][0] == "⏎"
