"""Records of any shape never raise a traceback: 10,000 records mutated from every bundled export and log (keys
dropped, values of other types, JSON written as text, nesting changed), each read with every source or format named
or detected, are read or skipped by name; the requests read render and pass the token pass."""

from __future__ import annotations

import json
import random

import pytest

from kvscope.engine.audit.logs.formats import AUTO, FORMATS
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.sources import EXPORT_SOURCES
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.models.tiny import tiny_tokenizer
from kvscope.engine.scenario import DEMOS
from tests.engine.audit.measure.test_traffic import QWEN_TEMPLATE

MUTATED = 10_000
ODD = [None, 0, -1, 1.5, True, "", "x", [], {}, [None], {"a": None}, "{", "[1]", 10**20, {"stringValue": 3}, {"intValue": "n"}]


def _seeds() -> list:
    """The first records of every bundled export (those written by the client libraries too) and request log."""
    records = []
    exports = sorted(p for p in (DEMOS / "logs" / "exports").rglob("*.json*") if not p.name.endswith(".answers.json"))
    for path in exports + sorted((DEMOS / "logs").glob("*.jsonl")):
        text = path.read_text()
        if path.suffix == ".json":
            whole = json.loads(text)
            records += (whole["data"] if isinstance(whole, dict) else whole)[:3]
        else:
            records += [json.loads(line) for line in text.splitlines()[:3] if line.strip()]
    return records


def _mutated(value, rng: random.Random):
    """One change somewhere in ``value``: a key dropped, a value replaced by an odd one or by its JSON text, or a change
    one level down."""
    if isinstance(value, dict) and value and rng.random() < 0.9:
        value, key = dict(value), rng.choice(list(value))
        roll = rng.random()
        if roll < 0.3:
            value[key] = rng.choice(ODD)
        elif roll < 0.45:
            del value[key]
        elif roll < 0.55:
            value[key] = json.dumps(value[key])
        else:
            value[key] = _mutated(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.9:
        value, at = list(value), rng.randrange(len(value))
        roll = rng.random()
        if roll < 0.3:
            value[at] = rng.choice(ODD)
        elif roll < 0.45:
            del value[at]
        else:
            value[at] = _mutated(value[at], rng)
        return value
    return rng.choice(ODD)


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


def test_ten_thousand_mutated_records_are_read_or_skipped_by_name_never_a_traceback(tokenizer):
    rng, seeds = random.Random(0), _seeds()
    formats = [AUTO, *EXPORT_SOURCES, *FORMATS]
    lines, read, skipped = [], 0, 0
    for _ in range(MUTATED):
        record = rng.choice(seeds)
        for _ in range(rng.randrange(1, 4)):
            record = _mutated(record, rng)
        line = json.dumps(record)
        fmt = AUTO if rng.random() < 0.5 else rng.choice(formats)
        log = read_log(line, fmt)  # raises nothing but the empty log's RequestLogError
        read += len(log.requests)
        skipped += len(log.skipped)
        assert all(item.key is not None and item.reason for item in log.skipped)
        lines.append(line)
    assert read > MUTATED // 5 and skipped > MUTATED // 10  # both ways are exercised
    whole = read_log("\n".join(['{"prompt": "a JSONL log"}', *lines]))  # a first line that makes the text JSONL
    scan = scan_log(tokenizer, whole)
    assert len(scan.requests) + sum(item.key == "rendering" for item in scan.skipped) == len(whole.requests)
