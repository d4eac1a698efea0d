"""The report's types and the dataclasses behind them do not drift apart: where an ``as_dict`` returns a key named as one of
its dataclass's fields, the field's JSON form (a tuple an array, a dataclass its ``as_dict``'s type) fits the type the
report declares for that key (the same, or one arm of a union that widens it: e.g. null where a repair does not apply).
The schema test checks keys a test's report holds; this one checks every shared key, in any report."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import types as python_types
import typing
from typing import Any, Union, get_args, get_origin

from kvscope.engine.audit.report import types
from kvscope.engine.audit.report.schema import _schema
from tests.engine.audit.report.test_schema import _audit_modules

# keys whose value ``as_dict`` builds from the field otherwise, on purpose: (class, key) -> what it does
RESHAPED = {
    ("EndpointTurn", "repairs"): "each repair's fidelity as the endpoint's repair entry, or why it does not apply",
    ("TrafficReport", "groups"): "each group with its measured turns beside it",
    ("TrafficReport", "turns"): "the measured turns keyed by request, as the report's list",
    ("AuditTurn", "repairs"): "each repair with whether it holds the recommendation's bars",
    ("ObservedSummary", "shortfalls"): "the requests served short, counted and summed",
    ("ObservedSummary", "excesses"): "the requests served more than simulated, counted and summed",
    ("ObservedSummary", "server_counted"): "the requests the server counted, with their tokens",
}


def _json_form(tp: Any) -> Any:
    """The report type a value of ``tp`` becomes in JSON, or None where there is no plain one."""
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and "as_dict" in vars(tp):
        return _returned(tp)
    if origin is tuple:
        items = {arg for arg in args if arg is not Ellipsis}
        form = _json_form(items.pop()) if len(items) == 1 else None
        return None if form is None else list[form]
    if origin is list:
        form = _json_form(args[0])
        return None if form is None else list[form]
    if origin is dict and args[0] is str:
        form = _json_form(args[1])
        return None if form is None else dict[str, form]
    if origin in (Union, python_types.UnionType):
        forms = [_json_form(arg) for arg in args]
        return None if None in forms else Union[tuple(forms)]
    return tp if tp in (str, int, float, bool, type(None)) else None


def _without_none(tp: Any) -> Any:
    arms = [arm for arm in get_args(tp) if arm is not type(None)] if get_origin(tp) in (Union, python_types.UnionType) else [tp]
    return Union[tuple(arms)]


def _returned(cls: type) -> Any:
    return typing.get_type_hints(cls.as_dict, vars(importlib.import_module(cls.__module__)), vars(types))["return"]


def _fits(value: dict, declared: dict) -> bool:
    """Whether every JSON value of schema ``value`` is one of schema ``declared`` (same, or an arm of its union)."""
    if value == declared:
        return True
    if "anyOf" in value:
        return all(_fits(arm, declared) for arm in value["anyOf"])
    if "anyOf" in declared:
        return any(_fits(value, arm) for arm in declared["anyOf"])
    if value.get("type") == declared.get("type") == "array":
        return _fits(value["items"], declared["items"])
    if value.get("type") == declared.get("type") == "object" and "additionalProperties" in value:
        return _fits(value["additionalProperties"], declared.get("additionalProperties", {}))
    return False


def _shared_keys() -> list[tuple[str, str, Any, Any]]:
    """(class, key, the field's JSON form, the declared type) of every dataclass field its ``as_dict`` also names."""
    shared = []
    for module in _audit_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or "as_dict" not in vars(cls) or not dataclasses.is_dataclass(cls):
                continue
            report = _returned(cls)
            declared = typing.get_type_hints(report)
            fields = typing.get_type_hints(cls, vars(module) | vars(types))
            for field in dataclasses.fields(cls):
                if field.name in declared and (cls.__name__, field.name) not in RESHAPED:
                    form = _json_form(fields[field.name])
                    if field.name not in report.__required_keys__ and form is not None:  # None: the key left out
                        form = _without_none(form)
                    shared.append((cls.__name__, field.name, form, declared[field.name]))
    return shared


def test_every_key_a_dataclass_shares_with_its_report_type_has_a_fitting_type():
    shared = _shared_keys()
    drifted = [
        f"{cls}.{key}: the field is {_schema(form, {})}, the report says {_schema(declared, {})}"
        for cls, key, form, declared in shared
        if form is not None and not _fits(_schema(form, {}), _schema(declared, {}))
    ]
    assert not drifted, "\n".join(drifted)
    checked = [(cls, key) for cls, key, form, _ in shared if form is not None]
    assert len(checked) >= 100, checked  # every shared key have a plain JSON form, so the check covers them


def test_a_drifted_field_is_found():
    declared, field = _schema(types.TrafficRequestDict, {}), _schema(list[int], {})
    assert not _fits(field, _schema(str, {})) and not _fits(_schema(int | None, {}), _schema(int, {}))
    assert _fits(_schema(int, {}), _schema(int | None, {})) and _fits(field, _schema(list[int], {}))
    assert declared == {"$ref": "#/$defs/TrafficRequestDict"}
