"""Gradio inputs that accept what an API client may send: a missing value reaches the handler.

Gradio's own CheckboxGroup and Slider fail in preprocessing on ``None`` (before any handler runs), which a public
server reports only as a generic error; here it reaches the handler, which applies its default or names
what is missing.
"""

from __future__ import annotations

from typing import Any

import gradio as gr


class _DrawnAsParent:
    """A Gradio component that the browser draws with its Gradio parent's own frontend (a template)..."""

    is_template = True

    @classmethod
    def get_component_class_id(cls) -> str:
        parent = next(base for base in cls.__mro__ if base.__module__.startswith("gradio."))
        return parent.get_component_class_id()  # ...which it finds by the parent's class id


class LenientCheckboxGroup(_DrawnAsParent, gr.CheckboxGroup):
    """A CheckboxGroup whose missing value (``None`` from an API client) is the empty selection."""

    def preprocess(self, payload: Any) -> Any:
        return super().preprocess([] if payload is None else payload)


class LenientSlider(_DrawnAsParent, gr.Slider):
    """A Slider whose missing value stays ``None`` (the handler applies its default) instead of failing."""

    def preprocess(self, payload: Any) -> Any:
        return None if payload is None else super().preprocess(payload)
