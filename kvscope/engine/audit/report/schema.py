"""The audit report's JSON Schema, generated from its types (``kvscope.engine.audit.report.types``) and published for CI users
as docs/audit-report.schema.json (``python -m kvscope audit-schema --json`` prints it; a test keeps the file equal).

A ``TypedDict`` becomes a closed object (its required keys required, no key it does not name: the schema is exactly this
version's report), ``list[X]`` an array, ``dict[str, X]`` an object of X values, ``X | None`` an ``anyOf`` with null,
``Literal`` a ``const``. Each ``TypedDict`` is one entry of ``$defs``, described by its docstring. Text only, no torch.
"""

from __future__ import annotations

import inspect
import json
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints, is_typeddict

from kvscope.engine.audit.report.types import AuditJSON

DIALECT = "https://json-schema.org/draft/2020-12/schema"
PUBLISHED = Path("docs") / "audit-report.schema.json"  # relative to the repository root
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def report_schema() -> dict:
    """The JSON Schema of ``AuditJSON``: a log's report or one prompt's."""
    defs: dict[str, dict] = {}
    top = _schema(AuditJSON, defs)
    return {
        "$schema": DIALECT,
        "title": "KVScope audit report",
        "description": "What `python -m kvscope audit … --json` prints (kvscope/engine/audit/report/types/; docs/audit.md).",
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    """The schema as the published file holds it (two-space indent, a final newline)."""
    return json.dumps(report_schema(), indent=2, ensure_ascii=False) + "\n"


def _schema(tp: Any, defs: dict[str, dict]) -> dict:
    if is_typeddict(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # taken before its fields: a type that refers to itself stops here
            hints = get_type_hints(tp)
            defs[name] = {
                "type": "object",
                "description": inspect.cleandoc(tp.__doc__ or name),
                "properties": {key: _schema(hint, defs) for key, hint in hints.items()},
                "required": [key for key in hints if key in tp.__required_keys__],
                "additionalProperties": False,
            }
        return {"$ref": f"#/$defs/{name}"}
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [_schema(arg, defs) for arg in args]}
    if origin is Literal:
        return {"const": args[0]} if len(args) == 1 else {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": _schema(args[0], defs)}
    if origin is dict and args[0] is str:
        return {"type": "object", "additionalProperties": _schema(args[1], defs)}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    raise TypeError(f"the report's schema has no JSON form for {tp!r}: use a TypedDict, list, dict[str, …] or a scalar")
