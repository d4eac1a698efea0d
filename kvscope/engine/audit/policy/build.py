"""A policy made from an audit: per changed field, every repair of the turns it changed in judged by the bars each turn's
recommendation judged them by (``recommend.Bars``), and the prompt-level repair that held them on every such turn and
computed the fewest tokens applied (none where no repair held them: the request passes unchanged, and the entry says
why). KV-level repairs that held them are named, not applied. ``forced_policy`` applies one repair the user names to
the fields the token pass found, unmeasured (``kvscope rewrite --repair``). Text only: the measured report is read, not
computed, here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvscope.engine.audit.changes.fields import FieldChange
from kvscope.engine.audit.logs.render import RenderedRequest
from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.policy.document import VERSION, Fidelity, FieldPolicy, MeasuredRepair, Policy
from kvscope.engine.audit.prompts.repair_requests import LEVEL_WORDS, PROMPT_REPAIRS, REPAIR_LEVELS, Level, content_chars

if TYPE_CHECKING:  # read, not run: the policy imports no torch
    from kvscope.engine.audit.measure.turn import AuditReport, AuditTurn
    from kvscope.engine.audit.scan.traffic_scan import TrafficScan

DEPLOYABLE = tuple(name for name in PROMPT_REPAIRS if name != "recompute")  # what a gateway can apply


def field_site(rendered: RenderedRequest, change: FieldChange) -> tuple[str, str]:
    """The role of the message holding ``change`` and its line with the value as ``{name}`` (the text around the value,
    what finds it in a new request)."""
    text = rendered.request.contents[change.message]
    start, end = content_chars(rendered, change.message, change.char_span)
    line_start, line_end = text.rfind("\n", 0, start) + 1, text.find("\n", end)
    line = text[line_start:start] + "{" + change.name + "}" + text[end : len(text) if line_end < 0 else line_end]
    role = rendered.request.messages[change.message].role if rendered.request.messages else "prompt"
    return role, line.strip()


def policy_from_report(report: AuditReport, source: str = "") -> Policy:
    """The policy of a measured audit (``TrafficReport.measured_report()`` or one prompt's ``audit_value``)."""
    sites: dict[str, tuple[RenderedRequest, FieldChange]] = {}
    turns: dict[str, list[AuditTurn]] = {}
    for turn, rendered in zip(report.turns, report.rendered):
        if turn.recommendation is None:  # a cold prefill: nothing measured
            continue
        for change in turn.fields:
            sites[change.name] = (rendered, change)  # the last measured turn's line
            turns.setdefault(change.name, []).append(turn)
    if not sites:
        raise RequestLogError("no measured turn changes a field: there is no policy to write (measure turns with --sample)")
    entries = tuple(_entry(name, *sites[name], turns[name], report.grain) for name in sites)
    return Policy(VERSION, report.model, report.dtype, report.threshold, report.min_agreement, entries, source)


def forced_policy(scan: TrafficScan, repair: str, grain: str | None, model: str, source: str = "") -> Policy:
    """``repair`` applied to every field the token pass found (unmeasured: ``forced``), each found by the line of the
    last request it changed in."""
    if repair not in DEPLOYABLE:
        raise RequestLogError(f"--repair {repair}: a rewrite applies one of {', '.join(DEPLOYABLE)}")
    if repair == "coarsen" and grain is None:
        raise RequestLogError("--repair coarsen needs --grain (date, hour or minute)")
    sites = {change.name: (scan.rendered[index], change) for index, diff in sorted(scan.diffs.items()) for change in diff.fields}
    if not sites:
        raise RequestLogError("no request of this log changes a field inside shared content: there is nothing to repair")
    why = "forced by the user (kvscope rewrite --repair), not measured: measure the rewrite with kvscope audit --rewritten"
    entries = []
    for name, (rendered, change) in sites.items():
        role, pattern = field_site(rendered, change)
        kept = grain if repair == "coarsen" else None
        entries.append(FieldPolicy(name, role, change.message, pattern, change.new, repair, why, kept, forced=True))
    return Policy(VERSION, model, "", 0.0, 0.0, tuple(entries), source)


def _entry(name: str, rendered: RenderedRequest, change: FieldChange, turns: Sequence[AuditTurn], grain: str | None) -> FieldPolicy:
    """One field's entry from the turns it changed in."""
    role, pattern = field_site(rendered, change)
    measured = {repair: _measured(repair, turns) for repair in _repair_names(turns)}
    exact = measured.get("recompute")
    deployable = [m for m in measured.values() if m.repair in DEPLOYABLE and m.within_bars]
    chosen = min(deployable, key=lambda m: m.computed_tokens, default=None)
    editing = tuple(m.repair for m in measured.values() if m.level == Level.KV.value and m.within_bars)
    common = {"field": name, "role": role, "message": change.message, "pattern": pattern, "example": change.new}
    tokens = exact.reused_tokens + exact.computed_tokens if exact else 0
    baseline = exact.reused_tokens if exact else 0
    if chosen is None:
        return FieldPolicy(
            **common,
            repair=None,
            why=_none_why(measured.values()),
            tokens=tokens,
            reused_tokens=baseline,
            baseline_reused_tokens=baseline,
            measured=tuple(measured.values()),
            needs_cache_editing=editing,
        )
    why = f"the prompt-level repair within the bars on every turn measured that computes the fewest tokens ({chosen.computed_tokens:,})"
    return FieldPolicy(
        **common,
        repair=chosen.repair,
        why=why,
        grain=grain if chosen.repair == "coarsen" else None,
        fidelity=chosen.fidelity,
        tokens=tokens,
        reused_tokens=chosen.reused_tokens,
        baseline_reused_tokens=baseline,
        measured=tuple(measured.values()),
        needs_cache_editing=editing,
    )


def _repair_names(turns: Iterable[AuditTurn]) -> list[str]:
    return list(dict.fromkeys(name for turn in turns for name in turn.repairs))


def _measured(repair: str, turns: Sequence[AuditTurn]) -> MeasuredRepair:
    """``repair`` over ``turns``: within the bars only where it applied and held them on every one."""
    results = [(turn, turn.repairs[repair]) for turn in turns if repair in turn.repairs]
    level = REPAIR_LEVELS[repair].value
    missing = next(((turn, result) for turn, result in results if not result.applicable), None)
    if missing is not None or len(results) < len(turns):
        reason = f"request {missing[0].request}: {missing[1].reason}" if missing else "not measured on every turn"
        return MeasuredRepair(repair, level, False, None, 0, 0, reason)
    bars = [turn.recommendation.bars for turn, _ in results]
    fidelities = [result.fidelity for _, result in results]
    fidelity = Fidelity(
        max(f.kl for f in fidelities),
        min(f.generation_agreement for f in fidelities),
        all(f.top1_agree for f in fidelities),
        len(results),
        min(b.kl for b in bars),
        max(b.min_agreement for b in bars),
    )
    within = fidelity.within_bars and all(b.holds(result) for b, (_, result) in zip(bars, results))
    reused, computed = sum(r.reused_tokens for _, r in results), sum(r.computed_tokens for _, r in results)
    return MeasuredRepair(repair, level, within, fidelity, reused, computed)


def _none_why(measured: Iterable[MeasuredRepair]) -> str:
    """Why no repair is applied: each prompt-level repair's miss, from its numbers."""
    misses = [
        f"{m.repair} {m.fidelity.words()}" if m.fidelity else f"{m.repair} does not apply ({m.reason})"
        for m in measured
        if m.repair in DEPLOYABLE
    ]
    head = f"no {LEVEL_WORDS[Level.PROMPT].split(',')[0]} repair held the bars on every turn measured"
    return head + (f": {'; '.join(misses)}" if misses else "")
