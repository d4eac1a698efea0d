"""The report is the schema: every part of the report is a record (its JSON derived from its declaration), the published
JSON Schema (docs/audit-report.schema.json) is the one generated from them and is what ``audit-schema`` prints, each
bundled log's report validates against it, and a report missing a required key or holding an unnamed one does not."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import io
import json
import pkgutil
import typing
from pathlib import Path

import jsonschema
import pytest
import typing_extensions

import kvscope.engine.audit
from kvscope.engine.audit.ci.report import PUBLISHED, LogAudit, PromptAudit, report_schema
from kvscope.engine.audit.report.records import Record, json_text
from kvscope.engine.cli import main
from tests.shared import assert_valid_report

ROOT = Path(__file__).resolve().parents[4]
LOGS = sorted((ROOT / "demos" / "logs").glob("*.jsonl"))
OPTIONAL_STAGES = ("distributed",)  # Ray is an extra: its modules are walked where it is installed


def _cli(*args: str) -> tuple[int, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*args, "--json"])
    return code, json.loads(out.getvalue())


def _audit_modules() -> list:
    modules = []
    for info in pkgutil.walk_packages(kvscope.engine.audit.__path__, "kvscope.engine.audit."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:
            assert info.name.split(".")[2] in OPTIONAL_STAGES, info.name
    return modules


def test_every_part_of_the_report_is_a_record():
    """A part's JSON is its declaration's (``records.Record``); only the log's report (``TrafficReport``, ``LogAudit`` in
    ``ci.report``) is assembled by hand, from the records."""
    records, written = [], set()
    for module in _audit_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or cls is Record or typing_extensions.is_protocol(cls):  # a protocol is no part
                continue
            if issubclass(cls, Record):
                assert dataclasses.is_dataclass(cls) and "as_dict" not in vars(cls), f"{cls.__qualname__}: a record declares its JSON"
                records.append(cls.__qualname__)
            elif "as_dict" in vars(cls):
                written.add(cls.__qualname__)
    assert written == {"TrafficReport"}, written
    parts = {"AuditReport", "TrafficRequest", "TrafficGroup", "Skipped", "Recommendation", "AuditTurn", "RepairResult", "ObservedSummary"}
    assert parts | {"EngineTotals", "EndpointAudit", "EndpointTurn", "RewrittenRequest", "Gate"} <= set(records), records


def test_the_published_schema_is_the_generated_one_and_the_cli_prints_it():
    assert (ROOT / PUBLISHED).read_text(encoding="utf-8") == json_text(report_schema()), "regenerate it: python -m kvscope audit-schema"
    jsonschema.Draft202012Validator.check_schema(report_schema())
    code, printed = _cli("audit-schema")
    assert code == 0 and printed == report_schema()
    defs = report_schema()["$defs"]
    assert {"LogAudit", "PromptAudit", "TrafficRequest", "Skipped"} <= set(defs)
    assert defs["TrafficRequest"]["additionalProperties"] is False and "cache_breakpoints" in defs["TrafficRequest"]["required"]
    assert "prompts_only_reused_tokens" not in defs["TrafficRequest"]["properties"]  # a hidden field stays out of the report
    assert defs["RepairResult"]["description"].startswith("One repair on one turn")  # each part described by its docstring
    assert defs["ObservedSummary"]["description"].startswith("The cached tokens the log reports")


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """Each bundled log's token-pass report (``--sample 0``: the embedded model's tokenizer, no weights)."""
    found = {}
    for log in LOGS:
        code, found[log.stem] = _cli("audit", str(log), "--sample", "0")
        assert code == 0, found[log.stem]
    return found


@pytest.mark.parametrize("name", [log.stem for log in LOGS])
def test_each_bundled_log_s_report_validates(reports, name):
    assert_valid_report(reports[name])
    assert set(reports[name]) <= set(typing.get_type_hints(LogAudit))


def test_a_report_missing_a_key_or_holding_an_unnamed_one_fails(reports):
    report = reports["support_agent"]
    assert LogAudit.__required_keys__ <= set(report)
    for path in (("engines",), ("engines", "tokens"), ("requests", 0, "causes"), ("groups", 0, "fidelity"), ("observed", "equal")):
        broken = copy.deepcopy(report)
        *parents, key = path
        holder = broken
        for step in parents:
            holder = holder[step]
        del holder[key]
        with pytest.raises(jsonschema.ValidationError):
            assert_valid_report(broken)
    with pytest.raises(jsonschema.ValidationError):
        assert_valid_report(report | {"unnamed": 1})
    with pytest.raises(jsonschema.ValidationError):
        assert_valid_report(report | {"skipped_count": "none"})
    assert_valid_report(report | {"cancelled": "asked"})  # an optional key, of its type


def test_one_prompt_s_report_validates_and_its_gate_refuses_reuse_by_name(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Session started: 2026-12-01 09:14\nWhat time did the session start?", encoding="utf-8")
    args = ("audit", str(prompt), "--model", "tiny-qwen2", "--find", "09:14", "--new", "09:15", "--tokens", "2", "--repairs", "field_only")
    code, report = _cli(*args, "--fail-on", "kl>100")
    assert code == 0 and report["gate"]["failed"] is False, report
    assert_valid_report(report)
    assert set(report) == set(typing.get_type_hints(PromptAudit))  # one prompt's report, with its gate
    code, error = _cli(*args, "--fail-on", "reuse<0.5")
    assert code == 2 and "one prompt's audit (--new) simulates no serving engine" in error["error"]
