"""Each repair of :data:`~kvscope.engine.audit.prompts.repair_requests.REGISTRY` (its text half, no torch) run on a
turn's cache (:class:`Turn`) and measured against the clean prefill of the newer request (docs/audit.md: the repairs).

Output fidelity is read by the next-token distribution (KL divergence, top-1 agreement, top-5 overlap) and by greedy
generation of N tokens from both. The reference is computed as an exact prefix cache serves the request
(:func:`reference`: recompute's own state), and every state comes from the run's store (``measure.kv_store``), so no
prompt is computed or read twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import torch

from kvscope.engine.audit.changes.fields import TurnDiff, common_prefix
from kvscope.engine.audit.logs.render import RenderedRequest, render_request
from kvscope.engine.audit.logs.requests import Request
from kvscope.engine.audit.measure.kv_store import ComputedStates, Reference
from kvscope.engine.audit.prompts.repair_requests import LEVEL_WORDS, REGISTRY, Level, OutputFidelity, RepairNotApplicable, greedy_agreement
from kvscope.engine.audit.report.records import HIDDEN, OMITTED, Record, derived, rounded
from kvscope.engine.cache.decision import kl_divergence
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.edit.strategies import REGISTRY as STRATEGY_REGISTRY

REPAIR_SUMMARIES = {  # each repair in a line, where it runs said (the app shows these): its own, or its edit strategy's
    name: f"{STRATEGY_REGISTRY[repair.strategy].summary if repair.strategy else repair.summary} ({LEVEL_WORDS[repair.level]})"
    for name, repair in REGISTRY.items()
}


@dataclass(frozen=True)
class RepairResult(Record):
    """One repair on one turn: its cost and its fidelity against the clean prefill (null where it does not apply, with
    its ``reason``), what a prompt-level repair changed (``detail``), and as the turn judged it: the clean prefill's
    TTFT over its own (``ttft_ratio``) and whether it holds the bars the recommendation judged it against."""

    name: Annotated[str, HIDDEN]
    applicable: bool
    level: Level = derived()
    reason: Annotated[str | None, OMITTED] = field(default=None, kw_only=True)  # why it does not apply
    reused_tokens: int | None = None
    computed_tokens: int | None = None
    ttft_ms: Annotated[float | None, rounded(2)] = None
    ttft_ratio: Annotated[float | None, rounded(3)] = field(default=None, kw_only=True)  # set by the turn
    fidelity: Annotated[OutputFidelity | None, HIDDEN] = None
    kl: Annotated[float | None, rounded(8)] = derived()  # the fidelity's fields, in the report
    top1_agree: bool | None = derived()
    top5_overlap: Annotated[float | None, rounded(4)] = derived()
    generation_agreement: Annotated[float | None, rounded(4)] = derived()
    generated_common_prefix: int | None = derived()
    generated: Annotated[tuple[int, ...], HIDDEN] = ()
    prompt_changed: Annotated[bool | None, OMITTED] = derived()  # the detail's keys, in the report
    grain: Annotated[str | None, OMITTED] = derived()
    coarse_values: Annotated[dict[str, str] | None, OMITTED] = derived()
    within_bars: bool | None = field(default=None, kw_only=True)  # set by the turn
    detail: Annotated[dict, HIDDEN] = field(default_factory=dict)
    prompt_ids: Annotated[tuple[int, ...], HIDDEN] = ()  # the request it serves, as token ids (its cache may hold stale entries of them)

    def __post_init__(self) -> None:
        measured = dataclasses.asdict(self.fidelity) if self.fidelity is not None else dict.fromkeys(_FIDELITY_KEYS)
        self.derive(level=REGISTRY[self.name].level, **measured, **{key: self.detail.get(key) for key in _DETAIL_KEYS})


_FIDELITY_KEYS = tuple(item.name for item in dataclasses.fields(OutputFidelity))
_DETAIL_KEYS = ("prompt_changed", "grain", "coarse_values")  # what a prompt-level repair's ``Built.detail`` may say


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
        built = REGISTRY[name].build(turn)
    except RepairNotApplicable as error:
        return RepairResult(name, False, reason=str(error))
    prefix, rest = built.prefix, built.rest
    computed = prefix.pending_tokens + len(rest)  # recorded, not yet run: what this repair computes
    read = turn.store.read(prefix, rest, built.prompt, exact=REGISTRY[name].level is Level.PROMPT, draft=clean.generated)
    result = fidelity(read.logprobs, read.generated, clean)
    return RepairResult(
        name, True, read.reused_tokens, computed, read.ttft_ms, result, read.generated, detail=built.detail, prompt_ids=built.prompt
    )
