"""The erratum: one appended line that states a field's new value (the paper's append-only repair).

Every erratum KVScope writes (the ``erratum`` and ``field_erratum`` strategies, the hybrid edit, the agent loop,
the serving benchmark) comes from a template here, so the wording is written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_ERRATUM = "[STATE UPDATE] {field} -> {new}; overrides any earlier value and conclusion"
# The wordings the paper compares (its "disregard" variant hurt: agreement 0.81).
WORDINGS: Mapping[str, str] = {
    "bare": "{field}: {new}",
    "tagged": "[STATE UPDATE] {field} -> {new}",
    "override": DEFAULT_ERRATUM,
    "disregard": "[STATE UPDATE] {field} -> {new}. Disregard your earlier conclusion.",
}
LINE_END = "\n\n"  # an erratum is its own paragraph after the context


def erratum_text(field: str, new: str, old: str = "", template: str = DEFAULT_ERRATUM) -> str:
    """The erratum line for ``field`` → ``new`` (``old`` is there for templates that name it)."""
    return template.format(field=field, new=new, old=old)


def erratum_ids(tokenizer: "PreTrainedTokenizerBase", field: str, new: str, old: str = "", template: str = DEFAULT_ERRATUM) -> list[int]:
    """The erratum line's token ids, ending its paragraph, as appended after a context."""
    return tokenizer(erratum_text(field, new, old, template) + LINE_END, add_special_tokens=False).input_ids
