"""The audit's repairs, one registry entry each (``REGISTRY``: a ``Repair``, as ``edit.strategies`` keeps its
strategies): its name, where it runs, its line (its own, or the edit strategy's it applies), the request it sends
(a prompt-level one), why it does not apply where no field changed, and its K/V operation (``build``: the state it
serves from, on the cache of what ``RepairTurn`` provides). Adding a repair is adding an entry here. Nothing here
imports torch: the template (``template``), the spans (``spans``), the endpoint (``endpoint``, ``endpoint_audit``) and
the rewrite's pairing (``rewrite``) read these with the tokenizer alone; the model's half, each repair measured on a
cache (``Turn``, ``run_repair``), is :mod:`kvscope.engine.audit.measure.repairs`.

A **prompt-level** repair only rewrites the request, so any prefix cache (vLLM, SGLang, llama.cpp) serves it today;
:func:`repaired_request` builds that request, for the measurement and for the template a user deploys alike. A
**KV-level** repair edits cached entries, which needs a cache-editing engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

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

    def within(self, kl: float, min_agreement: float) -> bool:
        """Within the bars: KL at most ``kl``, the same top token, at least ``min_agreement`` of greedy tokens agreeing."""
        return self.kl <= kl and self.top1_agree and self.generation_agreement >= min_agreement


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


def repaired_request(name: str, new: RenderedRequest, fields: Sequence[FieldChange], value_of: Value = new_value) -> Request:
    """The newer request as prompt-level repair ``name`` sends it, each changed field's text at ``value_of``: the
    audit measures it at the values it served (the new ones; ``coarsen``'s coarse ones), the deployable template has
    a placeholder there. A KV-level repair is refused: no request carries it."""
    repair = REGISTRY[name]
    if repair.rewrite is None:
        raise RepairNotApplicable(f"{name} is {LEVEL_WORDS[repair.level]}: it edits cached entries, no request carries it")
    return repair.rewrite(new, fields, value_of)


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
    nothing = REGISTRY[name].nothing
    if nothing is not None and not diff.fields:
        raise RepairNotApplicable(f"no field changed: {nothing}")
    if name == "hoist" and any(change.message == len(new.request.contents) - 1 for change in diff.fields):
        raise RepairNotApplicable("the changed value is already in the last message")


def prompt_repair_request(name: str, new: RenderedRequest, diff: TurnDiff, grain: str | None = None) -> Request:
    """The request prompt-level repair ``name`` sends for the newer request of a turn, at the values it serves (the new
    ones; ``coarsen``'s coarse ones), refused as its builder refuses: what a server is asked to measure it."""
    if REGISTRY[name].level is not Level.PROMPT:
        raise RepairNotApplicable(f"{name} is {LEVEL_WORDS[REGISTRY[name].level]}: it edits cached entries, no request carries it")
    check_applies(name, new, diff, grain)
    value_of = (lambda change: coarse(change.new, grain)) if name == "coarsen" else new_value
    return repaired_request(name, new, diff.fields, value_of)


# ------------------------------------------------------------------------------- each repair's K/V operation
class RepairTurn(Protocol):
    """What a repair's K/V operation reads of the turn it repairs (``measure.repairs.Turn`` provides it): the older
    request as the server cached it (``cached``, a ``Notebook``), the newer one, their diff, and the run's store of
    computed states (``store``: ``ComputedStates``)."""

    old: RenderedRequest
    new: RenderedRequest
    diff: TurnDiff
    cached: Any
    store: Any
    grain: str | None

    def render(self, request: Request) -> RenderedRequest: ...


@dataclass(frozen=True)
class Built:
    """What a repair serves from: a state computed up to where its reuse stops (its recorded steps not yet run), the
    tokens still to run, and the whole request it serves."""

    prefix: Any  # a Notebook
    rest: tuple[int, ...]
    prompt: tuple[int, ...]
    detail: dict = field(default_factory=dict)


def _sent(turn: RepairTurn, name: str, value_of: Value = new_value) -> tuple[int, ...]:
    """The token ids of the newer request as prompt-level repair ``name`` sends it."""
    return turn.render(repaired_request(name, turn.new, turn.diff.fields, value_of)).ids


def _prefix_cached(turn: RepairTurn, cached: Sequence[int], target: Sequence[int], detail: dict | None = None) -> Built:
    """Exact prefix caching: the common prefix reused (at least the last token is run), the rest computed. The
    older request's own cache is cut to that prefix; a rewritten one's (hoisted, coarsened) is computed first, from
    whatever the run's store shares with it (the server held it: not this repair's time)."""
    keep = min(common_prefix(tuple(cached), tuple(target)), len(target) - 1)
    prefix = turn.store.prefix(turn.cached, keep) if tuple(cached) == turn.old.ids else turn.store.state(target[:keep])
    return Built(prefix, tuple(target[keep:]), tuple(target), detail or {})


def _edited_in_place(turn: RepairTurn, target: RenderedRequest) -> Built:
    """The older request's cache with each field's tokens replaced (later entries keep their stale K/V), then
    whatever follows in ``target`` after the older request's shared part."""
    if not turn.diff.fields:
        raise RepairNotApplicable("no field changed inside shared content (only growth): nothing to edit in place")
    old, fields = turn.old.ids, sorted(turn.diff.fields, key=lambda c: -c.old_start)
    edited = list(old[: turn.diff.old_growth_start])
    for change in fields:
        edited[change.old_start : change.old_end] = turn.new.ids[change.start : change.end]
    shared = min(common_prefix(tuple(edited), target.ids), len(target) - 1)  # the last token is always run
    if any(change.end > shared for change in fields):
        raise RepairNotApplicable(
            f"the edited cache leaves the target at token {shared}, before a field's end: the fields' tokens do not line up in place"
        )
    keep = shared - sum((c.end - c.start) - (c.old_end - c.old_start) for c in fields)
    cached = turn.cached.prefix(keep)
    for change in fields:
        cached = cached.replace(
            range(change.old_start, change.old_end), list(turn.new.ids[change.start : change.end]), f"field:{change.name}"
        )
    return Built(cached, target.ids[shared:], target.ids)


def _recompute(turn: RepairTurn) -> Built:
    return _prefix_cached(turn, turn.old.ids, _sent(turn, "recompute"))


def _field_only(turn: RepairTurn) -> Built:
    return _edited_in_place(turn, turn.new)


def _erratum(turn: RepairTurn) -> Built:
    check_applies("erratum", turn.new, turn.diff, turn.grain)
    return _prefix_cached(turn, turn.old.ids, _sent(turn, "erratum"))


def _field_erratum(turn: RepairTurn) -> Built:
    return _edited_in_place(turn, turn.render(with_erratum(turn.new, turn.diff.fields, new_value, new_value)))


def _hoist(turn: RepairTurn) -> Built:
    check_applies("hoist", turn.new, turn.diff, turn.grain)
    cached = turn.render(hoisted(turn.old, turn.diff.fields, old_value, older=True))
    return _prefix_cached(turn, cached.ids, _sent(turn, "hoist"), {"prompt_changed": True})


def _coarsen(turn: RepairTurn) -> Built:
    check_applies("coarsen", turn.new, turn.diff, turn.grain)
    olds = {change.name: coarse(change.old, turn.grain) for change in turn.diff.fields}
    news = {change.name: coarse(change.new, turn.grain) for change in turn.diff.fields}
    cached = turn.render(with_values(turn.old, turn.diff.fields, lambda change: olds[change.name], older=True))
    target = _sent(turn, "coarsen", lambda change: news[change.name])
    return _prefix_cached(turn, cached.ids, target, {"prompt_changed": True, "grain": turn.grain, "coarse_values": news})


# ------------------------------------------------------------------------------------------------- the registry
Rewrite = Callable[[RenderedRequest, Sequence[FieldChange], Value], Request]


@dataclass(frozen=True)
class Repair:
    """One audit repair: its name, where it runs, its line (``summary``; or ``strategy``: the edit strategy it applies,
    whose line ``edit.strategies.REGISTRY`` holds), the request it sends (``rewrite``: prompt-level only), why it does
    not apply where no field changed (``nothing``; None: it always applies), and its K/V operation (``build``)."""

    name: str
    level: Level
    build: Callable[[RepairTurn], Built]
    summary: str = ""
    strategy: str | None = None
    rewrite: Rewrite | None = None
    nothing: str | None = None


REGISTRY = {  # every repair, in the audit's order
    repair.name: repair
    for repair in (
        Repair(
            "recompute",
            Level.PROMPT,
            _recompute,
            "recompute everything from the first changed token, reusing the common prefix (exact: the reference)",
            rewrite=with_values,
        ),
        Repair("field_only", Level.KV, _field_only, strategy="field_only"),
        Repair("erratum", Level.PROMPT, _erratum, strategy="erratum", rewrite=_erratum_kept, nothing="there is nothing to state"),
        Repair("field_erratum", Level.KV, _field_erratum, strategy="field_erratum"),
        Repair(
            "hoist",
            Level.PROMPT,
            _hoist,
            "move the changing lines to the end of the last message, so the prefix before them stays cached",
            rewrite=hoisted,
            nothing="there is no volatile line to move",
        ),
        Repair(
            "coarsen",
            Level.PROMPT,
            _coarsen,
            "round the date-time to a coarser grain, so the cached prefix survives while it does not change",
            rewrite=with_values,  # at the coarse values
            nothing="there is nothing to coarsen",
        ),
    )
}
REPAIRS = tuple(REGISTRY)
REPAIR_LEVELS = {name: repair.level for name, repair in REGISTRY.items()}
PROMPT_REPAIRS = tuple(name for name, repair in REGISTRY.items() if repair.level is Level.PROMPT)  # a request carries them
