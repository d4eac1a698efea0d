"""The audit's records, declared once: each is a dataclass of the stage that makes it, and its JSON form (``as_dict``)
and its part of the published JSON Schema (``ci.report``) are derived from that declaration by pydantic.

A record subclasses :class:`Record` and says on its fields what the JSON does otherwise: a field left out is
``Annotated[T, HIDDEN]``, a key named otherwise ``Annotated[T, Field(serialization_alias=…)]``, a rounded number
``Annotated[float, rounded(2)]``, a key left out where empty ``Annotated[T, OMITTED]``, a key derived from the other fields
a ``derived()`` field set in ``__post_init__`` (it keeps its place among them; a ``computed_field`` property follows
them all). Text only, no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from pydantic import ConfigDict, Field, PlainSerializer, TypeAdapter

HIDDEN = Field(exclude=True)  # kept for the stages, left out of the report
DIALECT = "https://json-schema.org/draft/2020-12/schema"  # of the published schemas
OMITTED = Field(exclude_if=lambda value: value is None or value == "")  # a key the report holds only where it has a value


class Record:
    """A part of the report: its JSON is its declaration's. The schema is closed (no key it does not name) and every key
    it names is there, as the report is this version's."""

    __pydantic_config__ = ConfigDict(
        extra="forbid",
        json_schema_serialization_defaults_required=True,
    )

    def as_dict(self) -> dict[str, Any]:
        """The record as the report holds it."""
        return _adapter(type(self)).dump_python(self, mode="json", by_alias=True)

    def derive(self, **values: Any) -> None:
        """Sets the record's ``derived()`` keys (in its ``__post_init__``: a record is frozen)."""
        for name, value in values.items():
            object.__setattr__(self, name, value)


@functools.cache
def _adapter(tp: Any) -> TypeAdapter:
    """The one ``TypeAdapter`` of a record, built on first use."""
    return TypeAdapter(tp)


def init_values(record: Any) -> dict[str, Any]:
    """A record's values as its constructor takes them (``derived()`` keys left out): to build one that extends it."""
    return {field.name: getattr(record, field.name) for field in dataclasses.fields(record) if field.init}


def derived() -> Any:
    """A key derived from the record's other fields, declared where the report holds it and set by the record's
    ``__post_init__`` (``Record.derive``), never passed in."""
    return dataclasses.field(init=False, default=None)


def rounded(digits: int) -> PlainSerializer:
    """A number written to ``digits`` places (None stays null)."""
    return PlainSerializer(lambda value: round(value, digits), when_used="unless-none")


def published_schema(adapter: TypeAdapter, title: str, description: str) -> dict:
    """A JSON Schema as docs/ publishes it: the dialect, a title and description, the schema with its ``$defs`` sorted."""
    generated = adapter.json_schema(mode="serialization", by_alias=True)
    defs = generated.pop("$defs")
    return {"$schema": DIALECT, "title": title, "description": description, **generated, "$defs": dict(sorted(defs.items()))}


def json_text(value: Any) -> str:
    """JSON as the published files hold it (two-space indent, a final newline)."""
    return json.dumps(value, indent=2, ensure_ascii=False) + "\n"
