"""Any rewrite of a log measured against the original: what each simulated engine reuses before and after, and what
the rewrite does to the model's output, request by request.

The rewritten log is someone else's (a linter's ``fix`` output) or a prompt template applied to the original's values
(``apply_template``: the format ``--template-out`` writes). It must hold the same requests in the same order: the same
count, the same session keys, and no request carrying another request's last user turn (a rewrite may reword a
request's own question; it may not reorder them).

Per request, the rewritten prompt's clean prefill is compared with the original's (``repairs.fidelity``: next-token
KL, top-1, top-5 overlap, N greedy tokens), and both greedy continuations are decoded to say whether the text is the
same. Both logs go through the token pass (``traffic_scan.scan_log``) with the same engine settings for the reuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field

from kvscope.engine.audit.logs.requests import Request, RequestLog, RequestLogError
from kvscope.engine.audit.measure.settings import DEFAULT_TOKENS
from kvscope.engine.audit.prompts.repair_requests import OutputFidelity
from kvscope.engine.audit.prompts.template import Template
from kvscope.engine.audit.report.records import HIDDEN, Record, derived, rounded
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficScan, scan_log
from kvscope.engine.audit.simulate.registry import DEFAULT_ENGINE
from kvscope.engine.progress import StepProgress, ticker

if TYPE_CHECKING:  # the model is read by the measurement alone: pairing, templates and reports import no torch
    from kvscope.engine.audit.measure.kv_store import ComputedStates
    from kvscope.engine.cache.loaded import LoadedModel

REUSE_ENGINE = DEFAULT_ENGINE  # the engine the verdict's reuse is said for


@dataclass(frozen=True)
class RewrittenRequest(Record):
    """One request before and after the rewrite: its tokens and reuse per engine, and the output compared."""

    request: int
    tokens_before: int
    tokens_after: int
    reused_before: Annotated[dict[str, int], Field(serialization_alias="reused_tokens_before")]
    reused_after: Annotated[dict[str, int], Field(serialization_alias="reused_tokens_after")]
    fidelity: Annotated[OutputFidelity, HIDDEN]
    kl: Annotated[float, rounded(8)] = derived()  # the fidelity's fields, in the report
    top1_agree: bool = derived()
    top5_overlap: Annotated[float, rounded(4)] = derived()
    generation_agreement: Annotated[float, rounded(4)] = derived()
    generated_common_prefix: int = derived()
    same_text: bool = derived()
    generated: Annotated[int, HIDDEN]  # greedy tokens compared (the longer of the two continuations)
    original_text: str
    rewritten_text: str
    verdict: str = derived()  # the request's line in words

    def __post_init__(self) -> None:
        self.derive(**dataclasses.asdict(self.fidelity), same_text=self.original_text == self.rewritten_text)
        self.derive(verdict=self.words())

    @property
    def unchanged(self) -> bool:
        """Every greedy token the same, position by position."""
        return self.fidelity.generation_agreement == 1.0

    def words(self) -> str:
        f = self.fidelity
        reuse = f"reuse {self.reused_before[REUSE_ENGINE]:,} → {self.reused_after[REUSE_ENGINE]:,} tokens ({REUSE_ENGINE})"
        first = "the first token unchanged" if f.top1_agree else "the first token changes"
        greedy = f"{f.generation_agreement:.0%} of {self.generated} greedy tokens agree, the first {f.generated_common_prefix} in a row"
        return f"{reuse}; {first}; {greedy}; {'the same text' if self.same_text else 'the text changes'}"


@dataclass(frozen=True)
class RewriteReport:
    """Every request of a rewrite measured, and the verdict for the log."""

    requests: tuple[RewrittenRequest, ...]
    generated_tokens: int  # N asked for

    def hit_rate(self, engine: str, after: bool) -> float:
        rows = self.requests
        tokens = sum(r.tokens_after if after else r.tokens_before for r in rows)
        reused = sum((r.reused_after if after else r.reused_before)[engine] for r in rows)
        return reused / tokens if tokens else 0.0

    def rows(self) -> list[dict[str, Any]]:
        """Each request before and after, as the report holds it."""
        return [row.as_dict() for row in self.requests]

    def verdict(self) -> str:
        rows, n = self.requests, len(self.requests)
        changed = [r.request for r in rows if not r.same_text]
        words = (
            f"reuse {self.hit_rate(REUSE_ENGINE, False):.0%} → {self.hit_rate(REUSE_ENGINE, True):.0%} ({REUSE_ENGINE}); "
            f"the first token unchanged on {sum(r.fidelity.top1_agree for r in rows)}/{n}; "
            f"the first {self.generated_tokens} tokens unchanged on {sum(r.unchanged for r in rows)}/{n}"
        )
        return words + (f"; the text changes on request{'s' * (len(changed) > 1)} {', '.join(map(str, changed))}" if changed else "")


def check_pairing(original: Sequence[Request], rewritten: Sequence[Request]) -> None:
    """Refuse a rewrite that does not hold the same requests in the same order, with the numbers."""
    if len(original) != len(rewritten):
        raise RequestLogError(
            f"the original log has {len(original)} requests, the rewritten {len(rewritten)}: a rewrite keeps every request, in order"
        )
    for old, new in zip(original, rewritten):
        if old.session != new.session:
            raise RequestLogError(
                f"request {old.index}: session {old.session!r} in the original, {new.session!r} in the rewrite: the order changed"
            )
    turns = [_last_user_turn(request) for request in original]
    for number, (own, new) in enumerate(zip(turns, rewritten), 1):
        text = _last_user_turn(new)
        if own is None or text is None or _same_turn(own, text):
            continue
        other = next((k for k, turn in enumerate(turns, 1) if turn is not None and turn != own and _same_turn(turn, text)), None)
        if other is not None:
            raise RequestLogError(
                f"rewritten request {number} carries the last user turn of original request {other}, not its own: the order changed"
            )


def _last_user_turn(request: Request) -> str | None:
    users = [m.content for m in request.messages or () if m.role == "user"]
    return users[-1].strip() if users else None


def _same_turn(original: str, rewritten: str) -> bool:
    """The same turn, or that turn with lines appended (a hoisted line)."""
    return rewritten == original or rewritten.startswith(original + "\n")


def measure_rewrite(
    lm: LoadedModel,
    original: RequestLog,
    rewritten: RequestLog,
    *,
    settings: ScanSettings = ScanSettings(),
    tokens: int = DEFAULT_TOKENS,
    progress: StepProgress = None,
    before: TrafficScan | None = None,
    reuse: ComputedStates | None = None,
) -> RewriteReport:
    """Both logs through the token pass, then each rewritten request's clean prefill against the original's
    (``before``, ``reuse``: as :func:`measure_rewrites` takes them)."""
    options = {"settings": settings, "tokens": tokens, "progress": progress, "before": before, "reuse": reuse}
    return measure_rewrites(lm, original, {"rewrite": rewritten}, **options)["rewrite"]


def measure_rewrites(
    lm: LoadedModel,
    original: RequestLog,
    rewrites: Mapping[str, RequestLog],
    *,
    settings: ScanSettings = ScanSettings(),
    tokens: int = DEFAULT_TOKENS,
    progress: StepProgress = None,
    before: TrafficScan | None = None,
    reuse: ComputedStates | None = None,
) -> dict[str, RewriteReport]:
    """Several rewrites of one log measured as :func:`measure_rewrite` measures each: every distinct prompt read once
    (:class:`~kvscope.engine.audit.measure.kv_store.ComputedStates`: the original's for all rewrites, a rewritten request that is the
    original's tokens is that reading), each computed from the longest prefix it shares with one read before.

    ``before``: the original's token pass where one was run already with these settings (the audit's, ``audit_traffic``'s
    ``scan``), not run again. ``reuse``: the store the audit's sampled turns were measured in; a prompt it read exactly
    as this measurement reads it (the same reuse, the same forwards: ``ComputedStates``) is taken from it, bit for bit
    the reading this measurement would compute, so the report is the same with or without it."""
    from kvscope.engine.audit.measure.kv_store import ComputedStates
    from kvscope.engine.audit.measure.repairs import fidelity  # the model's half (torch), imported where a model runs

    for rewritten in rewrites.values():
        check_pairing(original.requests, rewritten.requests)
    if tokens < 1:
        raise RequestLogError(f"generate at least one token per state, got {tokens}")
    settings = settings.for_model(lm)
    if before is None:
        before = scan_log(lm.tokenizer, original, settings, model=lm.name)
    afters = {label: scan_log(lm.tokenizer, log, settings, model=lm.name) for label, log in rewrites.items()}
    for after in afters.values():
        check_rendered(before, after)
    tick = ticker(progress, len(before.requests) * (len(afters) + 1))
    rows: dict[str, list[RewrittenRequest]] = {label: [] for label in afters}
    store = ComputedStates(lm, tokens, reuse=reuse)  # each distinct prompt read once, a prefix shared with an earlier one reused
    for position, old in enumerate(before.requests):
        clean = store.read_prompt(before.rendered[old.request].ids)
        tick()
        for label, after in afters.items():
            new = after.requests[position]
            moved = store.read_prompt(after.rendered[new.request].ids, draft=clean.generated)
            measured = fidelity(moved.logprobs, moved.generated, clean)
            texts = (lm.tokenizer.decode(list(clean.generated)), lm.tokenizer.decode(list(moved.generated)))
            generated = max(len(clean.generated), len(moved.generated))
            rows[label].append(
                RewrittenRequest(old.request, old.tokens, new.tokens, old.reused_tokens, new.reused_tokens, measured, generated, *texts)
            )
            tick()
    return {label: RewriteReport(tuple(found), tokens) for label, found in rows.items()}


def check_rendered(before: TrafficScan, after: TrafficScan) -> None:
    """The same requests rendered in both logs (one that renders in one log only is named, with why)."""
    for scan, other, name in ((before, after, "original"), (after, before, "rewritten")):
        missing = sorted(set(other.rendered) - set(scan.rendered))
        if missing:
            where = f"(request {missing[0]})"
            reason = next((item.reason for item in scan.skipped if item.key == "rendering" and where in item.reason), "")
            raise RequestLogError(f"request {missing[0]} of the {name} log cannot be rendered, so it cannot be compared: {reason}")


def apply_template(text: str, log: RequestLog) -> RequestLog:
    """The rewritten log ``--template`` measures: the template (:mod:`kvscope.engine.audit.prompts.template`, the format
    ``--template-out`` writes) applied to each request it is for, the others kept as logged; refused when it is for
    none of them."""
    template = Template.parse(text)
    if not any(template.applies_to(request) for request in log.requests):
        raise RequestLogError(f"the template applies to no request of the log: {template.why_not(log.requests[0])}")
    requests = tuple(template.apply(request) if template.applies_to(request) else request for request in log.requests)
    return dataclasses.replace(log, requests=requests)
