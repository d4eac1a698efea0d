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

``field_only``, ``erratum`` and ``field_erratum`` are the edit strategies of :mod:`kvscope.engine.edit.strategies` applied to
a request: named and described by its ``REGISTRY``. ``recompute`` is what ``full_downstream`` computes, named for
the prefix cache that runs it; ``hoist`` (the lines moved, not restated: that is the strategy ``restate``) and
``coarsen`` rewrite the request's text, which no edit strategy does.

A **prompt-level** repair only rewrites the request, so any prefix cache (vLLM, SGLang, llama.cpp) serves it today;
:func:`repaired_request` builds that request, for the measurement and for the template a user deploys alike. A
**KV-level** repair edits cached entries, which needs a cache-editing engine. The repairs' names and levels, the
requests they send and :class:`OutputFidelity` are the text half (:mod:`kvscope.engine.audit.prompts.repair_requests`, no torch),
importable from here too; this module builds each repair on a cache and measures it.

Output fidelity (:class:`OutputFidelity`) is measured against the clean prefill of the newer request, by the
next-token distribution (KL divergence, top-1 agreement, top-5 overlap) and by greedy generation of N tokens from
both (common prefix, fraction agreeing). That reference is computed as an exact prefix cache serves the request
(:func:`reference`: recompute's own state), and every state comes from the run's store
(:mod:`kvscope.engine.audit.measure.kv_store`), so no prompt is computed or read twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvscope.engine.audit.changes.fields import TurnDiff, common_prefix
from kvscope.engine.audit.logs.render import RenderedRequest, render_request
from kvscope.engine.audit.logs.requests import Request
from kvscope.engine.audit.measure.kv_store import ComputedStates, Reference
from kvscope.engine.audit.prompts.repair_requests import (  # the text half, kept importable from here
    GRAINS,
    LEVEL_WORDS,
    PROMPT_REPAIRS,
    REPAIR_LEVELS,
    REPAIRS,
    Level,
    OutputFidelity,
    RepairNotApplicable,
    Value,
    check_applies,
    coarse,
    content_chars,
    greedy_agreement,
    hoisted,
    new_value,
    old_value,
    prompt_repair_request,
    repaired_request,
    with_erratum,
    with_lines_appended,
    with_values,
)
from kvscope.engine.cache.decision import kl_divergence
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.strategies import REGISTRY as STRATEGY_REGISTRY

if TYPE_CHECKING:
    from kvscope.engine.audit.report.types import RepairResultDict


@dataclass(frozen=True)
class Repair:
    """An audit repair: where it runs and what it does, in one plain line (the table above)."""

    level: Level
    summary: str


_SUMMARIES = {
    "recompute": "recompute everything from the first changed token, reusing the common prefix (exact: the reference)",
    "field_only": STRATEGY_REGISTRY["field_only"].summary,
    "erratum": STRATEGY_REGISTRY["erratum"].summary,
    "field_erratum": STRATEGY_REGISTRY["field_erratum"].summary,
    "hoist": "move the changing lines to the end of the last message, so the prefix before them stays cached",
    "coarsen": "round the date-time to a coarser grain, so the cached prefix survives while it does not change",
}  # an edit strategy applied to a request is described by the strategy registry
_REGISTRY = {name: Repair(level, _SUMMARIES[name]) for name, level in REPAIR_LEVELS.items()}  # the names: repair_requests
REPAIR_SUMMARIES = {name: f"{repair.summary} ({LEVEL_WORDS[repair.level]})" for name, repair in _REGISTRY.items()}  # the app shows these


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

    def as_dict(self, full_ttft_ms: float) -> RepairResultDict:
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
    context_limit: int | None = None

    def render(self, request: Request) -> RenderedRequest:
        return render_request(self.lm, request, self.context_limit)


def reference(turn: Turn) -> Reference:
    """The newer request as an exact prefix cache serves it: the prefix it shares with the older request taken from
    that request's cache, the rest computed. It is recompute's state, so one computation serves both (its time is
    recompute's TTFT; the clean prefill's, ``turn.store.prefill_ms``, adds the prefix's share of its own prefill)."""
    keep = min(common_prefix(turn.old.ids, turn.new.ids), len(turn.new) - 1)
    return turn.store.read(turn.store.prefix(turn.cached, keep), turn.new.ids[keep:], turn.new.ids)


def fidelity(state: torch.Tensor, generated: Sequence[int], clean: Reference) -> OutputFidelity:
    """KL(clean ‖ state) of the next token, top-1 / top-5 agreement, and the greedy generations compared. The top token
    is read as greedy decoding reads it (``argmax``: the first of tied logits, which bfloat16 produces), not by
    ``topk``, whose order among ties is arbitrary."""
    p, q = clean.logprobs, state
    kl = kl_divergence(p, q)
    top_p, top_q = p.topk(5).indices.tolist(), q.topk(5).indices.tolist()
    top1 = int(p.argmax()) == int(q.argmax())
    return OutputFidelity(kl, top1, len(set(top_p) & set(top_q)) / 5, *greedy_agreement(clean.generated, generated))


def run_repair(name: str, turn: Turn, clean: Reference) -> RepairResult:
    """One repair on ``turn``, measured against ``clean``; a repair that does not apply says why."""
    try:
        built = _BUILDERS[name](turn)
    except RepairNotApplicable as error:
        return RepairResult(name, False, reason=str(error))
    prefix, rest = built.prefix, built.rest
    computed = prefix.pending_tokens + len(rest)  # recorded, not yet run: what this repair computes
    read = turn.store.read(prefix, rest, built.prompt, exact=REPAIR_LEVELS[name] is Level.PROMPT, draft=clean.generated)
    result = fidelity(read.logprobs, read.generated, clean)
    return RepairResult(
        name, True, read.reused_tokens, computed, read.ttft_ms, result, read.generated, detail=built.detail, prompt_ids=built.prompt
    )


# ------------------------------------------------------------------------------------------------------- builders
@dataclass(frozen=True)
class _Built:
    """What a repair serves from: a state computed up to where its reuse stops (its recorded steps not yet run), the
    tokens still to run, and the whole request it serves."""

    prefix: Notebook
    rest: tuple[int, ...]
    prompt: tuple[int, ...]
    detail: dict = field(default_factory=dict)


def _sent(turn: Turn, name: str, value_of: Value = new_value) -> tuple[int, ...]:
    """The token ids of the newer request as prompt-level repair ``name`` sends it."""
    return turn.render(repaired_request(name, turn.new, turn.diff.fields, value_of)).ids


def _prefix_cached(turn: Turn, cached: Sequence[int], target: Sequence[int], detail: dict | None = None) -> _Built:
    """Exact prefix caching: the common prefix reused (at least the last token is run), the rest computed. The
    older request's own cache is cut to that prefix; a rewritten one's (hoisted, coarsened) is computed first, from
    whatever the run's store shares with it (the server held it: not this repair's time)."""
    keep = min(common_prefix(tuple(cached), tuple(target)), len(target) - 1)
    prefix = turn.store.prefix(turn.cached, keep) if tuple(cached) == turn.old.ids else turn.store.state(target[:keep])
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
    return _edited_in_place(turn, turn.render(with_erratum(turn.new, turn.diff.fields, new_value, new_value)))


def _hoist(turn: Turn) -> _Built:
    check_applies("hoist", turn.new, turn.diff, turn.grain)
    cached = turn.render(hoisted(turn.old, turn.diff.fields, old_value, older=True))
    return _prefix_cached(turn, cached.ids, _sent(turn, "hoist"), {"prompt_changed": True})


def _coarsen(turn: Turn) -> _Built:
    check_applies("coarsen", turn.new, turn.diff, turn.grain)
    olds = {change.name: coarse(change.old, turn.grain) for change in turn.diff.fields}
    news = {change.name: coarse(change.new, turn.grain) for change in turn.diff.fields}
    cached = turn.render(with_values(turn.old, turn.diff.fields, lambda change: olds[change.name], older=True))
    target = _sent(turn, "coarsen", lambda change: news[change.name])
    return _prefix_cached(turn, cached.ids, target, {"prompt_changed": True, "grain": turn.grain, "coarse_values": news})


_BUILDERS: dict[str, Callable[[Turn], _Built]] = {
    "recompute": _recompute,
    "field_only": _field_only,
    "erratum": _erratum,
    "field_erratum": _field_erratum,
    "hoist": _hoist,
    "coarsen": _coarsen,
}


__all__ = [  # with the text half (kvscope.engine.audit.prompts.repair_requests), which the modules that read no model import directly
    "GRAINS",
    "LEVEL_WORDS",
    "PROMPT_REPAIRS",
    "REPAIRS",
    "REPAIR_LEVELS",
    "REPAIR_SUMMARIES",
    "Level",
    "OutputFidelity",
    "Reference",
    "Repair",
    "RepairNotApplicable",
    "RepairResult",
    "Turn",
    "check_applies",
    "coarse",
    "content_chars",
    "fidelity",
    "greedy_agreement",
    "prompt_repair_request",
    "reference",
    "repaired_request",
    "run_repair",
    "with_lines_appended",
]
