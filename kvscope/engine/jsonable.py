"""The JSON form of the engine's results, in one place: a key named as the attribute it reads, a nested result by its
own ``as_dict``. (The audit's records derive theirs from their declaration: ``kvscope.engine.audit.report.records``.)"""

from __future__ import annotations

import dataclasses
from typing import Any


def as_json(value: Any) -> Any:
    """``value`` as a result's JSON holds it: a result by its ``as_dict``, dicts and lists item by item, else as it is."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, dict):
        return {key: as_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_json(item) for item in value]
    return value


def rounded(value: float | None, digits: int = 4) -> float | None:
    """A float rounded for JSON (None stays None)."""
    return None if value is None else round(float(value), digits)


def attributes(record: Any, *names: str) -> dict[str, Any]:
    """``{name: record.name}`` for each of ``names`` (each dataclass field, in order, when none is named), every value
    through :func:`as_json`: the part of a result's ``as_dict`` that restates its own attributes."""
    names = names or tuple(field.name for field in dataclasses.fields(record))
    return {name: as_json(getattr(record, name)) for name in names}


class JsonFields:
    """A result whose JSON is its fields, each by its name (:func:`attributes`): its ``as_dict`` written once, here."""

    def as_dict(self) -> dict[str, Any]:
        """The result's fields as JSON holds them."""
        return attributes(self)
