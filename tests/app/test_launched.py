"""The test apps' launch: a launch that failed Gradio's localhost check (a slow machine) is closed and tried again."""

import urllib.request

import gradio as gr
import pytest
from gradio import networking

from tests.app.conftest import LAUNCH_ATTEMPTS, launched


def _blocks() -> gr.Blocks:
    with gr.Blocks() as blocks:
        gr.Markdown("served")
    return blocks


def test_a_launch_that_failed_the_localhost_check_is_tried_again_and_serves(monkeypatch):
    answers = iter([False, True])
    checked = []
    monkeypatch.setattr(networking, "url_ok", lambda url: checked.append(url) or next(answers))
    blocks = _blocks()
    try:
        url = launched(blocks)
        assert len(checked) == 2 and checked[1] == url
        assert urllib.request.urlopen(url, timeout=10).status == 200
    finally:
        blocks.close()


def test_a_launch_that_keeps_failing_the_check_raises_gradios_error(monkeypatch):
    checked = []
    monkeypatch.setattr(networking, "url_ok", lambda url: checked.append(url) and False)
    with pytest.raises(ValueError, match="localhost is not accessible"):
        launched(_blocks())
    assert len(checked) == LAUNCH_ATTEMPTS
