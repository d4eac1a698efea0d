"""The audit's repairs as text: their names and where each runs, the request each prompt-level repair sends, and the
fidelity a measurement fills in. Nothing here imports torch: the template (``template``), the spans (``spans``), the
endpoint (``endpoint``, ``endpoint_audit``) and the rewrite's pairing (``rewrite``) read these with the tokenizer
alone; the model's half, each repair built on a cache and measured, is :mod:`kvscope.engine.audit.measure.repairs`.

A **prompt-level** repair only rewrites the request, so any prefix cache (vLLM, SGLang, llama.cpp) serves it today;
:func:`repaired_request` builds that request, for the measurement and for the template a user deploys alike. A
**KV-level** repair edits cached entries, which needs a cache-editing engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvscope.engine.audit.changes.fields import DATETIME, FieldChange, TurnDiff, common_prefix
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import Request
from kvscope.engine.edit.erratum import DEFAULT_ERRATUM, erratum_text
from kvscope.engine.errors import KVScopeError


class Level(StrEnum):
    """Where a repair can run."""

    PROMPT = "prompt"  # the request is rewritten and the cache only reused: any prefix cache serves it today
    KV = "kv"  # cached entries are edited: it needs an engine that edits its cache (vLLM, SGLang, llama.cpp do not)


LEVEL_WORDS = {Level.PROMPT: "prompt-level, any prefix cache serves it today", Level.KV: "KV-level, needs a cache-editing engine"}

REPAIR_LEVELS = {  # every repair, in the audit's order, and where it runs (each one's line: repairs.REPAIR_SUMMARIES)
    "recompute": Level.PROMPT,
    "field_only": Level.KV,
    "erratum": Level.PROMPT,
    "field_erratum": Level.KV,
    "hoist": Level.PROMPT,
    "coarsen": Level.PROMPT,
}
REPAIRS = tuple(REPAIR_LEVELS)
PROMPT_REPAIRS = tuple(name for name, level in REPAIR_LEVELS.items() if level is Level.PROMPT)  # a request carries them
GRAINS = ("date", "hour", "minute")


class RepairNotApplicable(KVScopeError):
    """A repair that cannot apply to this turn; the message says why (reported in the audit, not raised)."""


@dataclass(frozen=True)
class OutputFidelity:
    """A state's output against the reference's."""

    kl: float
    top1_agree: bool
    top5_overlap: float
    generation_agreement: float
    generated_common_prefix: int


def greedy_agreement(reference: Sequence, other: Sequence) -> tuple[float, int]:
    """Two greedy generations compared: the share of positions (of the longer) holding the same token, and how many
    agree in a row from the first."""
    count = max(len(reference), len(other), 1)
    return sum(a == b for a, b in zip(reference, other)) / count, common_prefix(tuple(reference), tuple(other))


# -------------------------------------- the request a repair sends, each changed field's text given by a ``Value``
Value = Callable[[FieldChange], str]  # its old or new value, a coarser one, or the template's placeholder


def old_value(change: FieldChange) -> str:
    return change.old


def new_value(change: FieldChange) -> str:
    return change.new


def content_chars(rendered: RenderedRequest, message: int, chars: tuple[int, int]) -> tuple[int, int]:
    """Characters ``chars`` of the rendered text as characters of message ``message``'s content string."""
    content_start = rendered.content_spans[message][0]
    message_text = rendered.request.contents[message]
    lead = len(message_text) - len(message_text.lstrip())  # the template strips the content it was located by
    return chars[0] - content_start + lead, chars[1] - content_start + lead


def _located(rendered: RenderedRequest, fields: Sequence[FieldChange], older: bool) -> list[tuple[FieldChange, int, int]]:
    """Each field with its characters in its message's content string, in the older request (``older``) or the
    newer one, last first so that editing one keeps the others' offsets."""
    side: Callable[[FieldChange], tuple[int, int]] = (lambda c: c.old_char_span) if older else (lambda c: c.char_span)
    return [(change, *content_chars(rendered, change.message, side(change))) for change in sorted(fields, key=lambda c: -side(c)[0])]


def with_values(rendered: RenderedRequest, fields: Sequence[FieldChange], value_of: Value, older: bool = False) -> Request:
    """``rendered``'s request with each field's text set to ``value_of`` it."""
    contents = list(rendered.request.contents)
    for change, start, end in _located(rendered, fields, older):
        text = contents[change.message]
        contents[change.message] = text[:start] + value_of(change) + text[end:]
    return rendered.request.with_contents(contents)


def with_lines_appended(text: str, lines: Sequence[str]) -> str:
    """``text`` (a request's last message) with ``lines`` after a blank line: where ``hoist`` moves its lines and
    ``erratum`` states its values (and where a template puts them: :mod:`kvscope.engine.audit.prompts.template`)."""
    return text.rstrip() + "\n\n" + "\n".join(lines)


def with_erratum(new: RenderedRequest, fields: Sequence[FieldChange], kept: Value, stated: Value) -> Request:
    """The newer request with each field's text at ``kept`` and a ``[STATE UPDATE]`` line stating ``stated`` after
    the last message."""
    request = with_values(new, fields, kept)
    contents = list(request.contents)
    contents[-1] = with_lines_appended(
        contents[-1], [erratum_text(change.name, stated(change), change.old, DEFAULT_ERRATUM) for change in fields]
    )
    return request.with_contents(contents)


def _erratum_kept(new: RenderedRequest, fields: Sequence[FieldChange], value_of: Value) -> Request:
    """The older request kept (every field at its old value, new turns after it), the erratum stating ``value_of``."""
    return with_erratum(new, fields, old_value, value_of)


def hoisted(rendered: RenderedRequest, fields: Sequence[FieldChange], value_of: Value, older: bool = False) -> Request:
    """``rendered``'s request with each field's whole line (stripped, the field at ``value_of``) moved to the end of
    the last message."""
    contents = list(rendered.request.contents)
    moved = []
    for change, start, end in _located(rendered, fields, older):
        text = contents[change.message]
        line_start, line_end = text.rfind("\n", 0, start) + 1, text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        moved.append((text[line_start:start] + value_of(change) + text[end:line_end]).strip())
        contents[change.message] = text[:line_start] + text[min(line_end + 1, len(text)) :]
    contents[-1] = with_lines_appended(contents[-1], moved[::-1])
    return rendered.request.with_contents(contents)


_REWRITES: dict[str, Callable[[RenderedRequest, Sequence[FieldChange], Value], Request]] = {  # the prompt-level repairs
    "recompute": with_values,
    "erratum": _erratum_kept,
    "hoist": hoisted,
    "coarsen": with_values,  # at the coarse values
}


def repaired_request(name: str, new: RenderedRequest, fields: Sequence[FieldChange], value_of: Value = new_value) -> Request:
    """The newer request as prompt-level repair ``name`` sends it, each changed field's text at ``value_of``: the
    audit measures it at the values it served (the new ones; ``coarsen``'s coarse ones), the deployable template has
    a placeholder there. A KV-level repair is refused: no request carries it."""
    if name not in _REWRITES:
        raise RepairNotApplicable(f"{name} is {LEVEL_WORDS[REPAIR_LEVELS[name]]}: it edits cached entries, no request carries it")
    return _REWRITES[name](new, fields, value_of)


def coarse(value: str, grain: str) -> str:
    """A date-time value at a coarser grain (``date``, ``hour`` or ``minute``); refused for anything else."""
    if grain not in GRAINS:
        raise RepairNotApplicable(f"unknown grain {grain!r}; choose one of {', '.join(GRAINS)}")
    match = DATETIME.fullmatch(value.strip())
    if not match:
        raise RepairNotApplicable(f"{value!r} is not a date or date-time, so it has no {grain} grain")
    date, hour, minute = match.group("date", "hour", "minute")
    if grain == "date" or hour is None:
        return date
    return f"{date} {int(hour):02d}:00" if grain == "hour" else f"{date} {int(hour):02d}:{minute}"


def check_applies(name: str, new: RenderedRequest, diff: TurnDiff, grain: str | None) -> None:
    """Refuse (``RepairNotApplicable``, saying why) a prompt-level repair that cannot apply to this turn."""
    if name == "coarsen" and grain is None:
        raise RepairNotApplicable("name a grain to coarsen to (date, hour or minute)")
    if name != "recompute" and not diff.fields:
        nothing = {
            "erratum": "there is nothing to state",
            "hoist": "there is no volatile line to move",
            "coarsen": "there is nothing to coarsen",
        }
        raise RepairNotApplicable(f"no field changed: {nothing[name]}")
    if name == "hoist" and any(change.message == len(new.request.contents) - 1 for change in diff.fields):
        raise RepairNotApplicable("the changed value is already in the last message")


def prompt_repair_request(name: str, new: RenderedRequest, diff: TurnDiff, grain: str | None = None) -> Request:
    """The request prompt-level repair ``name`` sends for the newer request of a turn, at the values it serves (the new
    ones; ``coarsen``'s coarse ones), refused as its builder refuses: what a server is asked to measure it."""
    if REPAIR_LEVELS[name] is not Level.PROMPT:
        raise RepairNotApplicable(f"{name} is {LEVEL_WORDS[REPAIR_LEVELS[name]]}: it edits cached entries, no request carries it")
    check_applies(name, new, diff, grain)
    value_of = (lambda change: coarse(change.new, grain)) if name == "coarsen" else new_value
    return repaired_request(name, new, diff.fields, value_of)
