"""Repairs of a cached request whose fields changed, each measured against a clean prefill of the new request.

The server holds the older request's K/V; the newer request arrives with some fields changed (and maybe new turns).
Every repair builds the state it would serve from, computes only the tokens it must, and is read the same way:

| repair | runs on | what is reused | what is computed | exact? |
|---|---|---|---|---|
| ``recompute`` | prompt | the common prefix (exact prefix caching) | everything from the first changed token | yes: the reference |
| ``field_only`` | KV | every cached entry but the fields' | the fields' new tokens, then the new turns | no: later tokens keep stale K/V |
| ``erratum`` | prompt | the whole older request (fields unchanged) | ``[STATE UPDATE] field -> new`` after the last message, and new turns | no: the old value is still read |
| ``field_erratum`` | KV | as ``field_only`` | the fields' tokens and the erratum | no |
| ``hoist`` | prompt | the prefix before the moved lines | the volatile lines moved to the end of the last message | prompt changes: judged against the original |
| ``coarsen`` | prompt | the prefix, when the coarse value did not change | from the first changed token | prompt changes: judged against the original |

``field_only``, ``erratum`` and ``field_erratum`` are the edit strategies of :mod:`engine.edit.strategies` applied to
a request: named and described by its ``REGISTRY``. ``recompute`` is what ``full_downstream`` computes, named for
the prefix cache that runs it; ``hoist`` (the lines moved, not restated: that is the strategy ``restate``) and
``coarsen`` rewrite the request's text, which no edit strategy does.

A **prompt-level** repair only rewrites the request, so any prefix cache (vLLM, SGLang, llama.cpp) serves it today;
:func:`repaired_request` builds that request, for the measurement and for the template a user deploys alike. A
**KV-level** repair edits cached entries, which needs a cache-editing engine.

Output fidelity (:class:`OutputFidelity`) is measured against the clean prefill of the newer request, by the
next-token distribution (KL divergence, top-1 agreement, top-5 overlap) and by greedy generation of N tokens from
both (common prefix, fraction agreeing). That reference is computed as an exact prefix cache serves the request
(:func:`reference`: recompute's own state), and every state comes from the run's store
(:mod:`engine.audit.states`), so no prompt is computed or read twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from engine.audit.fields import DATETIME, FieldChange, TurnDiff, common_prefix
from engine.audit.requests import RenderedRequest, Request, render_request
from engine.audit.states import ComputedStates, Reference
from engine.cache.decision import kl_divergence
from engine.cache.loaded import LoadedModel
from engine.cache.notebook import Notebook
from engine.edit.erratum import DEFAULT_ERRATUM, erratum_text
from engine.edit.strategies import REGISTRY as STRATEGY_REGISTRY
from engine.errors import KVScopeError


class Level(StrEnum):
    """Where a repair can run."""

    PROMPT = "prompt"  # the request is rewritten and the cache only reused: any prefix cache serves it today
    KV = "kv"  # cached entries are edited: it needs an engine that edits its cache (vLLM, SGLang, llama.cpp do not)


LEVEL_WORDS = {Level.PROMPT: "prompt-level, any prefix cache serves it today", Level.KV: "KV-level, needs a cache-editing engine"}


@dataclass(frozen=True)
class Repair:
    """An audit repair: where it runs and what it does, in one plain line (the table above)."""

    level: Level
    summary: str


def _strategy(name: str, level: Level) -> Repair:
    """An edit strategy applied to a request, described by the strategy registry."""
    return Repair(level, STRATEGY_REGISTRY[name].summary)


_REGISTRY: dict[str, Repair] = {
    "recompute": Repair(
        Level.PROMPT, "recompute everything from the first changed token, reusing the common prefix (exact: the reference)"
    ),
    "field_only": _strategy("field_only", Level.KV),
    "erratum": _strategy("erratum", Level.PROMPT),
    "field_erratum": _strategy("field_erratum", Level.KV),
    "hoist": Repair(Level.PROMPT, "move the changing lines to the end of the last message, so the prefix before them stays cached"),
    "coarsen": Repair(Level.PROMPT, "round the date-time to a coarser grain, so the cached prefix survives while it does not change"),
}
REPAIRS = tuple(_REGISTRY)
REPAIR_LEVELS = {name: repair.level for name, repair in _REGISTRY.items()}
PROMPT_REPAIRS = tuple(name for name, level in REPAIR_LEVELS.items() if level is Level.PROMPT)  # a request carries them
REPAIR_SUMMARIES = {name: f"{repair.summary} ({LEVEL_WORDS[repair.level]})" for name, repair in _REGISTRY.items()}  # the app shows these
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


@dataclass(frozen=True)
class RepairResult:
    """One repair on one turn: its cost and its fidelity (``reason`` instead when it does not apply)."""

    name: str
    applicable: bool
    reused_tokens: int = 0
    computed_tokens: int = 0
    ttft_ms: float = 0.0
    fidelity: OutputFidelity | None = None
    generated: tuple[int, ...] = ()
    reason: str | None = None
    detail: dict = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = ()  # the request it serves, as token ids (its cache may hold stale entries of them)

    @property
    def level(self) -> Level:
        return REPAIR_LEVELS[self.name]

    def as_dict(self, full_ttft_ms: float) -> dict:
        if not self.applicable:
            keys = (
                "reused_tokens",
                "computed_tokens",
                "ttft_ms",
                "ttft_ratio",
                "kl",
                "top1_agree",
                "top5_overlap",
                "generation_agreement",
                "generated_common_prefix",
            )
            return {"applicable": False, "level": self.level.value, "reason": self.reason, **dict.fromkeys(keys)}
        return {
            "applicable": True,
            "level": self.level.value,
            "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "ttft_ms": round(self.ttft_ms, 2),
            "ttft_ratio": round(full_ttft_ms / self.ttft_ms, 3) if self.ttft_ms > 0 else None,
            "kl": round(self.fidelity.kl, 8),
            "top1_agree": self.fidelity.top1_agree,
            "top5_overlap": round(self.fidelity.top5_overlap, 4),
            "generation_agreement": round(self.fidelity.generation_agreement, 4),
            "generated_common_prefix": self.fidelity.generated_common_prefix,
            **self.detail,
        }


@dataclass(frozen=True)
class Turn:
    """What the repairs of one turn work from: the cached older request, the newer one and their diff."""

    lm: LoadedModel
    old: RenderedRequest
    new: RenderedRequest
    diff: TurnDiff
    cached: Notebook  # the older request's K/V, as the server holds them
    store: ComputedStates  # every state this audit run computed (the greedy tokens per state are its ``tokens``)
    grain: str | None = None  # for ``coarsen``
    max_tokens: int | None = None

    def render(self, request: Request) -> RenderedRequest:
        return render_request(self.lm, request, self.max_tokens)


def reference(turn: Turn) -> Reference:
    """The newer request as an exact prefix cache serves it: the prefix it shares with the older request taken from
    that request's cache, the rest computed. It is recompute's state, so one computation serves both (its time is
    recompute's TTFT; the clean prefill's, ``turn.store.prefill_ms``, adds the prefix's share of its own prefill)."""
    keep = min(common_prefix(turn.old.ids, turn.new.ids), len(turn.new) - 1)
    return turn.store.read(turn.cached.prefix(keep), turn.new.ids[keep:], turn.new.ids)


def fidelity(state: torch.Tensor, generated: Sequence[int], clean: Reference) -> OutputFidelity:
    """KL(clean ‖ state) of the next token, top-1 / top-5 agreement, and the greedy generations compared. The top token
    is read as greedy decoding reads it (``argmax``: the first of tied logits, which bfloat16 produces), not by
    ``topk``, whose order among ties is arbitrary."""
    p, q = clean.logprobs, state
    kl = kl_divergence(p, q)
    top_p, top_q = p.topk(5).indices.tolist(), q.topk(5).indices.tolist()
    top1 = int(p.argmax()) == int(q.argmax())
    return OutputFidelity(kl, top1, len(set(top_p) & set(top_q)) / 5, *greedy_agreement(clean.generated, generated))


def greedy_agreement(reference: Sequence, other: Sequence) -> tuple[float, int]:
    """Two greedy generations compared: the share of positions (of the longer) holding the same token, and how many
    agree in a row from the first."""
    count = max(len(reference), len(other), 1)
    return sum(a == b for a, b in zip(reference, other)) / count, common_prefix(tuple(reference), tuple(other))


def run_repair(name: str, turn: Turn, clean: Reference) -> RepairResult:
    """One repair on ``turn``, measured against ``clean``; a repair that does not apply says why."""
    try:
        built = _BUILDERS[name](turn)
    except RepairNotApplicable as error:
        return RepairResult(name, False, reason=str(error))
    prefix, rest = built.prefix, built.rest
    computed = prefix.pending_tokens + len(rest)  # recorded, not yet run: what this repair computes
    read = turn.store.read(prefix, rest, built.prompt, exact=REPAIR_LEVELS[name] is Level.PROMPT)
    result = fidelity(read.logprobs, read.generated, clean)
    return RepairResult(
        name, True, read.reused_tokens, computed, read.ttft_ms, result, read.generated, detail=built.detail, prompt_ids=built.prompt
    )


# -------------------------------------- the request a repair sends, each changed field's text given by a ``Value``
Value = Callable[[FieldChange], str]  # its old or new value, a coarser one, or the template's placeholder


def _old(change: FieldChange) -> str:
    return change.old


def _new(change: FieldChange) -> str:
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


def _with_values(rendered: RenderedRequest, fields: Sequence[FieldChange], value_of: Value, older: bool = False) -> Request:
    """``rendered``'s request with each field's text set to ``value_of`` it."""
    contents = list(rendered.request.contents)
    for change, start, end in _located(rendered, fields, older):
        text = contents[change.message]
        contents[change.message] = text[:start] + value_of(change) + text[end:]
    return rendered.request.with_contents(contents)


def with_lines_appended(text: str, lines: Sequence[str]) -> str:
    """``text`` (a request's last message) with ``lines`` after a blank line: where ``hoist`` moves its lines and
    ``erratum`` states its values (and where a template puts them: :mod:`engine.audit.template`)."""
    return text.rstrip() + "\n\n" + "\n".join(lines)


def _with_erratum(new: RenderedRequest, fields: Sequence[FieldChange], kept: Value, stated: Value) -> Request:
    """The newer request with each field's text at ``kept`` and a ``[STATE UPDATE]`` line stating ``stated`` after
    the last message."""
    request = _with_values(new, fields, kept)
    contents = list(request.contents)
    contents[-1] = with_lines_appended(
        contents[-1], [erratum_text(change.name, stated(change), change.old, DEFAULT_ERRATUM) for change in fields]
    )
    return request.with_contents(contents)


def _erratum_kept(new: RenderedRequest, fields: Sequence[FieldChange], value_of: Value) -> Request:
    """The older request kept (every field at its old value, new turns after it), the erratum stating ``value_of``."""
    return _with_erratum(new, fields, _old, value_of)


def _hoisted(rendered: RenderedRequest, fields: Sequence[FieldChange], value_of: Value, older: bool = False) -> Request:
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
    "recompute": _with_values,
    "erratum": _erratum_kept,
    "hoist": _hoisted,
    "coarsen": _with_values,  # at the coarse values
}


def repaired_request(name: str, new: RenderedRequest, fields: Sequence[FieldChange], value_of: Value = _new) -> Request:
    """The newer request as prompt-level repair ``name`` sends it, each changed field's text at ``value_of``: the
    audit measures it at the values it served (the new ones; ``coarsen``'s coarse ones), the deployable template has
    a placeholder there. A KV-level repair is refused: no request carries it."""
    if name not in _REWRITES:
        raise RepairNotApplicable(f"{name} is {LEVEL_WORDS[REPAIR_LEVELS[name]]}: it edits cached entries, no request carries it")
    return _REWRITES[name](new, fields, value_of)


# ------------------------------------------------------------------------------------------------------- builders
@dataclass(frozen=True)
class _Built:
    """What a repair serves from: a state computed up to where its reuse stops (its recorded steps not yet run), the
    tokens still to run, and the whole request it serves."""

    prefix: Notebook
    rest: tuple[int, ...]
    prompt: tuple[int, ...]
    detail: dict = field(default_factory=dict)


def _sent(turn: Turn, name: str, value_of: Value = _new) -> tuple[int, ...]:
    """The token ids of the newer request as prompt-level repair ``name`` sends it."""
    return turn.render(repaired_request(name, turn.new, turn.diff.fields, value_of)).ids


def _prefix_cached(turn: Turn, cached: Sequence[int], target: Sequence[int], detail: dict | None = None) -> _Built:
    """Exact prefix caching: the common prefix reused (at least the last token is run), the rest computed. The
    older request's own cache is cut to that prefix; a rewritten one's (hoisted, coarsened) is computed first, from
    whatever the run's store shares with it (the server held it: not this repair's time)."""
    keep = min(common_prefix(tuple(cached), tuple(target)), len(target) - 1)
    prefix = turn.cached.prefix(keep) if tuple(cached) == turn.old.ids else turn.store.state(target[:keep])
    return _Built(prefix, tuple(target[keep:]), tuple(target), detail or {})


def _recompute(turn: Turn) -> _Built:
    return _prefix_cached(turn, turn.old.ids, _sent(turn, "recompute"))


def _field_only(turn: Turn) -> _Built:
    return _edited_in_place(turn, turn.new)


def _edited_in_place(turn: Turn, target: RenderedRequest) -> _Built:
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
    return _Built(cached, target.ids[shared:], target.ids)


def _erratum(turn: Turn) -> _Built:
    check_applies("erratum", turn.new, turn.diff, turn.grain)
    return _prefix_cached(turn, turn.old.ids, _sent(turn, "erratum"))


def _field_erratum(turn: Turn) -> _Built:
    return _edited_in_place(turn, turn.render(_with_erratum(turn.new, turn.diff.fields, _new, _new)))


def _hoist(turn: Turn) -> _Built:
    check_applies("hoist", turn.new, turn.diff, turn.grain)
    cached = turn.render(_hoisted(turn.old, turn.diff.fields, _old, older=True))
    return _prefix_cached(turn, cached.ids, _sent(turn, "hoist"), {"prompt_changed": True})


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


def _coarsen(turn: Turn) -> _Built:
    check_applies("coarsen", turn.new, turn.diff, turn.grain)
    olds = {change.name: coarse(change.old, turn.grain) for change in turn.diff.fields}
    news = {change.name: coarse(change.new, turn.grain) for change in turn.diff.fields}
    cached = turn.render(_with_values(turn.old, turn.diff.fields, lambda change: olds[change.name], older=True))
    target = _sent(turn, "coarsen", lambda change: news[change.name])
    return _prefix_cached(turn, cached.ids, target, {"prompt_changed": True, "grain": turn.grain, "coarse_values": news})


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
    value_of = (lambda change: coarse(change.new, grain)) if name == "coarsen" else _new
    return repaired_request(name, new, diff.fields, value_of)


_BUILDERS: dict[str, Callable[[Turn], _Built]] = {
    "recompute": _recompute,
    "field_only": _field_only,
    "erratum": _erratum,
    "field_erratum": _field_erratum,
    "hoist": _hoist,
    "coarsen": _coarsen,
}
