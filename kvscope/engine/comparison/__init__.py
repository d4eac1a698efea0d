"""Models side by side: the same scenario and field edit on up to three models (``compare-models``).

It sits above ``kvscope.engine.compose`` (it runs an edit report, two probes and one splice comparison per model) and below
``kvscope.engine.cli``. ``models``: :func:`compare_models`, the per-model row and the paper's 7–9B reference values.
"""

from __future__ import annotations

from kvscope.engine.comparison.models import (
    COMPARED_STRATEGIES,
    MAX_MODELS,
    PAPER_MODELS,
    READ_HEAD_MASS,
    SPLICE_SKILL,
    ComparisonError,
    ModelComparison,
    ModelRow,
    PaperModel,
    compare_model,
    compare_models,
    notes_depth,
    read_heads,
)

__all__ = [
    "COMPARED_STRATEGIES",
    "MAX_MODELS",
    "PAPER_MODELS",
    "READ_HEAD_MASS",
    "SPLICE_SKILL",
    "ComparisonError",
    "ModelComparison",
    "ModelRow",
    "PaperModel",
    "compare_model",
    "compare_models",
    "notes_depth",
    "read_heads",
]
