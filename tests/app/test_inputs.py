"""The lenient inputs are drawn by their Gradio parent's own frontend: Gradio finds a template's frontend through the
class's first base (``__base__``) and its class id, so both must be the parent's (a mixin first in the bases made the
page ask for a custom component that does not exist, and the Notes tab never finished loading)."""

import gradio as gr
import pytest

from kvscope.app.inputs import LenientCheckboxGroup, LenientSlider


@pytest.mark.parametrize(("lenient", "parent"), [(LenientCheckboxGroup, gr.CheckboxGroup), (LenientSlider, gr.Slider)])
def test_a_lenient_input_is_drawn_as_its_gradio_parent(lenient, parent):
    assert lenient.__base__ is parent and lenient.is_template
    assert lenient.get_component_class_id() == parent.get_component_class_id()


def test_a_missing_value_is_read_as_the_handler_expects():
    assert LenientCheckboxGroup(choices=["a", "b"]).preprocess(None) == []
    assert LenientSlider(0, 10).preprocess(None) is None and LenientSlider(0, 10).preprocess(3) == 3
