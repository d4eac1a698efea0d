"""Gradio inputs that accept what an API client may send: a missing value reaches the handler.

Gradio's own CheckboxGroup and Slider fail in preprocessing on ``None`` (before any handler runs), which a public
server reports only as a generic error; here it reaches the handler, which applies its default or names
what is missing.
"""

from __future__ import annotations

from typing import Any

import gradio as gr


class LenientCheckboxGroup(gr.CheckboxGroup):
    """A CheckboxGroup whose missing value (``None`` from an API client) is the empty selection."""

    is_template = True  # the browser draws it with CheckboxGroup's own frontend...

    @classmethod
    def get_component_class_id(cls) -> str:
        return gr.CheckboxGroup.get_component_class_id()  # ...which it finds by the parent's class id

    def preprocess(self, payload: Any) -> Any:
        return super().preprocess([] if payload is None else payload)


class LenientSlider(gr.Slider):
    """A Slider whose missing value stays ``None`` (the handler applies its default) instead of failing."""

    is_template = True  # the browser draws it with Slider's own frontend...

    @classmethod
    def get_component_class_id(cls) -> str:
        return gr.Slider.get_component_class_id()  # ...which it finds by the parent's class id

    def preprocess(self, payload: Any) -> Any:
        return None if payload is None else super().preprocess(payload)
