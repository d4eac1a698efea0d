"""Scenario files: a policy context with mutable fields, a question, and the answers to score (TOML).

The format is documented in docs/scenarios.md. :func:`render` turns a scenario into token ids whose field spans are
exact by construction: every piece is tokenized on its own and the pieces are concatenated. The package: ``text``
(placeholders, escapes, the bundled demos), ``files`` (parse, validate, write back), ``rendering`` (token ids).
"""

from kvscope.engine.scenario.files import Field, Scenario, Skill
from kvscope.engine.scenario.rendering import RenderedPrompt, Span, context_text, encode, render
from kvscope.engine.scenario.text import (
    DEMOS,
    ScenarioError,
    bundled_logs,
    bundled_scenarios,
    bundled_skills,
    escape_braces,
    is_aggregator,
    toml_string,
    unescape_braces,
)

__all__ = [
    "DEMOS",
    "Field",
    "RenderedPrompt",
    "Scenario",
    "ScenarioError",
    "Skill",
    "Span",
    "bundled_logs",
    "bundled_scenarios",
    "bundled_skills",
    "context_text",
    "encode",
    "escape_braces",
    "is_aggregator",
    "render",
    "toml_string",
    "unescape_braces",
]
