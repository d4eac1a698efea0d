"""Fixtures shared by engine tests that do not define their own: a tiny Qwen2 model and a skill store."""

import pytest

from kvscope.engine.compose.skills import SkillStore
from kvscope.engine.models.tiny import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def store():
    return SkillStore()
