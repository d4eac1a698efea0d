"""A CI gate on an audit: ``--fail-on`` conditions over the audit's JSON report, and a Markdown summary of that same
report for a pull-request comment.

A condition is ``QUANTITY OP NUMBER`` (``OP``: ``<``, ``<=``, ``>``, ``>=``); several are joined by commas or given
as repeated flags. Each quantity is read from the report (``QUANTITIES`` says exactly what it is over): over the
rewrite when the audit measured one (``--rewritten`` / ``--template``), else over the log. The audit exits 1 when any
condition holds, 0 when none does; a malformed condition, or one over nothing measured, is bad input (exit 2).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvscope.engine.audit.ci.report import AuditJSON, Gate, GateCondition, LogAudit
from kvscope.engine.audit.simulate.budgets import Budget
from kvscope.engine.audit.simulate.registry import DEFAULT_ENGINE, ENGINES, LABELS
from kvscope.engine.audit.simulate.step import replies_sentence
from kvscope.engine.errors import KVScopeError

EXIT_FAILED = 1  # a --fail-on condition holds (2 stays bad input)
QUANTITIES = {
    "reuse": "the simulated vLLM hit rate: prompt tokens reused / prompt tokens, over every request (of the rewritten log with a rewrite)",
    **{f"reuse.{engine}": f"the same hit rate under the simulated {LABELS[engine]}" for engine in ENGINES},
    "kl": "the largest next-token KL over the measured requests: each rewritten prompt against the original's clean "
    "prefill, or without a rewrite each measured turn's recommended repair against its clean prefill",
    "agreement": "the smallest share of greedy tokens agreeing, over the same requests",
    "top1": "the share of the same requests whose first token is unchanged",
}
SHARES = ("reuse", "agreement", "top1")  # quantities between 0 and 1 (reuse.* included)
OPERATORS: dict[str, Callable[[float, float], bool]] = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}
_CONDITION = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(<=|>=|<|>)\s*(\S+)\s*$")


class GateError(KVScopeError):
    """A --fail-on condition that cannot be read or evaluated; the message names it."""


@dataclass(frozen=True)
class Condition:
    """One ``QUANTITY OP NUMBER`` condition, as written."""

    text: str
    quantity: str
    op: str
    bound: float

    def holds(self, value: float) -> bool:
        return OPERATORS[self.op](value, self.bound)


def parse_conditions(flags: Sequence[str]) -> tuple[Condition, ...]:
    """Every condition of the ``--fail-on`` flags (each may hold several, comma-separated); a malformed one is named."""
    conditions = []
    for flag in flags:
        for text in flag.split(","):
            conditions.append(_condition(text.strip(), flag))
    return tuple(conditions)


def _condition(text: str, flag: str) -> Condition:
    if not text:
        raise GateError(f"--fail-on {flag!r} holds an empty condition")
    match = _CONDITION.match(text)
    if match is None:
        raise GateError(f"--fail-on condition {text!r} is not QUANTITY<NUMBER (or >, <=, >=), e.g. reuse<0.5 or kl>0.05")
    name, op, number = match.groups()
    if name not in QUANTITIES:
        raise GateError(f"--fail-on condition {text!r}: unknown quantity {name!r}; choose from {', '.join(QUANTITIES)}")
    try:
        bound = float(number)
    except ValueError:
        raise GateError(f"--fail-on condition {text!r}: {number!r} is not a number") from None
    if not math.isfinite(bound):
        raise GateError(f"--fail-on condition {text!r}: the bound must be a finite number, got {number!r}")
    if name.split(".")[0] in SHARES and not 0.0 <= bound <= 1.0:
        raise GateError(f"--fail-on condition {text!r}: {name} is a share between 0 and 1, got {number}")
    if name == "kl" and bound < 0:
        raise GateError(f"--fail-on condition {text!r}: a KL divergence is never negative, got {number}")
    return Condition(text, name, op, bound)


def quantity(name: str, report: AuditJSON) -> float:
    """A quantity of ``QUANTITIES`` read from an audit report (its JSON, ``types.AuditJSON``)."""
    rewrite = report.get("rewrite")
    if name.startswith("reuse"):
        engine = name.partition(".")[2] or DEFAULT_ENGINE
        if rewrite is not None:
            tokens = sum(row["tokens_after"] for row in rewrite)
            reused = sum(row["reused_tokens_after"][engine] for row in rewrite)
        elif "engines" in report:
            tokens, reused = report["engines"]["tokens"], report["engines"]["reused_tokens"][engine]
        else:
            raise GateError(f"--fail-on {name}: one prompt's audit (--new) simulates no serving engine; gate it on kl, agreement or top1")
        return reused / tokens if tokens else 0.0
    rows = rewrite if rewrite is not None else _recommended(report)
    if not rows:
        raise GateError(f"--fail-on {name}: no request was measured with the model (--sample 0?), so there is no {name} to gate on")
    if name == "kl":
        return max(row["kl"] for row in rows)
    if name == "agreement":
        return min(row["generation_agreement"] for row in rows)
    return sum(bool(row["top1_agree"]) for row in rows) / len(rows)


def _recommended(report: AuditJSON) -> list[dict[str, Any]]:
    """Each measured turn's recommended repair, as its JSON row."""
    return [turn["repairs"][turn["recommendation"]["repair"]] for turn in report.get("turns", ()) if turn.get("recommendation")]


def gate(conditions: Sequence[Condition], report: AuditJSON) -> Gate:
    """Each condition with its value and whether it holds; ``failed`` when any holds."""
    rows = []
    for condition in conditions:
        value = quantity(condition.quantity, report)
        rows.append(GateCondition(condition.text, condition.quantity, value, condition.holds(value)))
    return Gate(tuple(rows))


def exit_code(report: dict) -> int:
    """The audit's exit code: ``EXIT_FAILED`` when a gate condition holds, else 0."""
    return EXIT_FAILED if report.get("gate", {}).get("failed") else 0


# ---------------------------------------------------------------- the Markdown summary for a pull-request comment
def markdown(report: LogAudit) -> str:
    """The report as Markdown: the engines' reuse, the table of turns with their causes, the rewrite's verdict and
    each changed answer side by side, and the gate's outcome."""
    engines = report["engines"]
    rates = ", ".join(f"{LABELS[e]} {rate:.1%}" for e, rate in engines["hit_rate"].items())
    parts = [
        f"## KVScope audit ({report['model']})",
        "",
        f"{engines['requests']} requests, {engines['tokens']:,} prompt tokens; simulated reuse: {rates}; "
        f"{report['skipped_count']} records skipped.",
        "",
        replies_sentence(engines),
        "",
        "KV budgets simulated:",
        *(f"- {line}" for line in budget_lines(engines["budgets"])),
        "",
        _turns_table(report),
    ]
    if "rewrite" in report:
        parts += ["", "### Rewrite", "", rewrite_markdown(report["verdict"], report["rewrite"])]
    if "gate" in report:
        parts += ["", "### Gate", ""]
        for row in report["gate"]["conditions"]:
            outcome = "holds: fail" if row["holds"] else "does not hold"
            parts.append(f"- `{row['condition']}`: {row['quantity']} = {row['value']:.4g}, {outcome}")
        parts += ["", "**failed**" if report["gate"]["failed"] else "**passed**"]
    return "\n".join(parts) + "\n"


def budget_lines(budgets: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each serving engine's budget as the report holds it (``engines.budgets``), a line each: its limit and where it
    came from, or that it ran unbounded (what the CLI logs, the Markdown lists and the app says)."""
    lines = []
    for item in budgets:
        budget = Budget(**{key: value for key, value in item.items() if key != "unbounded"})
        warning = "; it never evicted, which no real server does" if budget.unbounded else ""
        lines.append(f"{LABELS[budget.engine]}: {budget.words()}{warning}")
    return lines


def rewrite_markdown(verdict: str, rows: list[dict[str, Any]]) -> str:
    """A measured rewrite (``RewrittenRequest.as_dict()`` rows): its verdict, the table per request and each answer that
    changes beside the original's."""
    parts = [f"**{verdict}**", "", _rewrite_table(rows)]
    changed = [row for row in rows if not row["same_text"]]
    if changed:
        cells = [(row["request"], _cell(row["original_text"]), _cell(row["rewritten_text"])) for row in changed]
        parts += ["", "Answers that change:", "", _table(("request", "original", "rewritten"), cells)]
    return "\n".join(parts)


def _turns_table(report: LogAudit) -> str:
    recommended = {turn["request"]: turn["recommendation"]["repair"] for turn in report.get("turns", ()) if turn.get("recommendation")}
    heads = ["request", "session", "matched", "tokens", *(LABELS[engine] for engine in ENGINES), "causes", "recommended"]
    rows = []
    for row in report["requests"]:
        causes = ", ".join(f"{c['name']}:{c['field']}" if c["field"] else c["name"] for c in row["causes"]) or "–"
        reused = [row["reused_tokens"][engine] for engine in ENGINES]
        session, matched = _cell(row["session"] or "–"), row["matched_request"] or "–"
        rows.append([row["request"], session, matched, row["tokens"], *reused, _cell(causes), recommended.get(row["request"], "–")])
    return _table(heads, rows)


def _rewrite_table(rows: list[dict[str, Any]]) -> str:
    heads = ["request", f"{LABELS[DEFAULT_ENGINE]} reuse before → after", "KL", "top-1", "top-5", "agreement", "common prefix", "same text"]
    cells = []
    for row in rows:
        reuse = f"{row['reused_tokens_before'][DEFAULT_ENGINE]} → {row['reused_tokens_after'][DEFAULT_ENGINE]}"
        top1, same = ("yes" if row[key] else "no" for key in ("top1_agree", "same_text"))
        shares = f"{row['top5_overlap']:.0%}", f"{row['generation_agreement']:.0%}"
        cells.append([row["request"], reuse, f"{row['kl']:.3g}", top1, *shares, row["generated_common_prefix"], same])
    return _table(heads, cells)


def _table(heads: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table: its header, then a line per row."""
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    return "\n".join([*lines, *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def _cell(text: str) -> str:
    """Text fit for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "<br>")
