"""A request log (or one prompt with a new value) audited turn by turn: what a prefix cache reuses, which fields
changed, what each repair costs and keeps, and the cheapest prompt-level repair within a fidelity threshold (with the
KV-level one beside it), said in numbers.

Also builds what lets every other analysis run on the user's own prompt: a scenario TOML with the field as a
placeholder (the Notes tab and ``python -m kvscope edit`` read it) and the repaired prompt template (the measured prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import InstanceOf

from kvscope.engine.audit.changes.fields import Candidate, FieldChange, TurnDiff, candidate_spans, diff_requests
from kvscope.engine.audit.logs.render import RenderedRequest, render_request
from kvscope.engine.audit.logs.requests import Request, RequestLogError
from kvscope.engine.audit.measure.kv_store import ComputedStates
from kvscope.engine.audit.measure.recommend import Recommendation, recommend
from kvscope.engine.audit.measure.repairs import RepairResult, Turn, reference, run_repair
from kvscope.engine.audit.measure.settings import MeasureSettings
from kvscope.engine.audit.prompts.repair_requests import RepairNotApplicable
from kvscope.engine.audit.prompts.template import written_template
from kvscope.engine.audit.report.records import HIDDEN, Record, derived, rounded
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.progress import StepProgress, Tick, ticker
from kvscope.engine.scenario import Field, Scenario, escape_braces


@dataclass(frozen=True)
class AuditTurn(Record):
    """One request against the one it was matched with (none for the first): reuse, the fields changed, every repair
    measured (none for a cold prefill), each judged against the clean prefill and the recommendation's bars, and the
    repair recommended."""

    request: int
    matched_request: int | None = field(default=None, kw_only=True)  # the earlier request it was compared with
    tokens: int
    diff: Annotated[TurnDiff | None, HIDDEN]  # None for the first request
    common_prefix_tokens: int = derived()
    block_prefix_tokens: int = derived()
    appended_tokens: int = derived()
    fields: tuple[FieldChange, ...] = derived()
    full_ttft_ms: Annotated[float | None, rounded(2)]
    repairs: dict[str, RepairResult]
    recommendation: Recommendation | None

    def __post_init__(self) -> None:
        diff = self.diff
        self.derive(
            common_prefix_tokens=diff.common_prefix_tokens if diff else 0,
            block_prefix_tokens=diff.block_prefix_tokens if diff else 0,
            appended_tokens=self.tokens - diff.growth_start if diff else 0,
            fields=diff.fields if diff else (),
            repairs={name: self._judged(result) for name, result in self.repairs.items()},
        )

    def _judged(self, result: RepairResult) -> RepairResult:
        """A repair with the clean prefill's TTFT over its own, and whether it holds the bars the recommendation judged
        it against (null where it does not apply)."""
        if not result.applicable:
            return result
        bars = self.recommendation.bars if self.recommendation else None
        full = self.full_ttft_ms or 0.0
        ratio = full / result.ttft_ms if result.ttft_ms > 0 else None
        return dataclasses.replace(result, ttft_ratio=ratio, within_bars=bars.holds(result) if bars is not None else None)


@dataclass(frozen=True)
class AuditReport(Record):
    """Every turn of a log on one model, with the settings that produced it (the report's ``PromptAudit``)."""

    model: str
    dtype: str
    threshold: float
    min_agreement: float
    generated_tokens: int
    repairs: tuple[str, ...]
    grain: str | None
    turns: tuple[AuditTurn, ...]
    rendered: Annotated[tuple[InstanceOf[RenderedRequest], ...], HIDDEN]  # InstanceOf: numpy arrays have no pydantic schema

    def last_with_fields(self) -> AuditTurn | None:
        return next((turn for turn in reversed(self.turns) if turn.fields), None)


def audit_requests(
    lm: LoadedModel, requests: Sequence[Request], *, measure: MeasureSettings = MeasureSettings(), progress: StepProgress = None
) -> AuditReport:
    """Audit each request against the one before it (all rendered first, so a bad request fails before any forward)."""
    settings = measure  # checked in its constructor
    names, grain, limit = settings.repairs, settings.grain, settings.context_limit
    rendered = [render_request(lm, request, limit) for request in requests]
    diffs = [diff_requests(old, new, CacheSettings.block) for old, new in zip(rendered, rendered[1:])]
    tick = ticker(progress, len(diffs) * (len(names) + 1))
    turns = [AuditTurn(rendered[0].request.index, len(rendered[0]), None, None, {}, None)]
    store = ComputedStates(lm, settings.tokens)
    for old, new, diff in zip(rendered, rendered[1:], diffs):
        # the older request's state: the previous turn's newer one (the server now holds it), or the first, prefilled
        turn = measure_turn(Turn(lm, old, new, diff, store.state(old.ids), store, grain, limit), settings, tick)
        turns.append(turn)
    return AuditReport(
        lm.fingerprint.name,
        lm.fingerprint.dtype,
        settings.threshold,
        settings.min_agreement,
        settings.tokens,
        names,
        grain,
        tuple(turns),
        tuple(rendered),
    )


def measure_turn(turn: Turn, settings: MeasureSettings, tick: Tick = lambda: None) -> AuditTurn:
    """One turn measured: the newer request as an exact prefix cache serves it (the reference, which is recompute's
    state), then every repair against it (one tick each). Every state comes from the run's store (``turn.store``), so
    nothing another turn or repair computed is computed again; each repair's TTFT is its own forward
    (:mod:`kvscope.engine.audit.measure.kv_store`), the clean prefill's the time every token of the request took along the forwards that
    computed it."""
    clean = reference(turn)
    tick()
    results = {}
    for name in settings.repairs:
        results[name] = run_repair(name, turn, clean)
        tick()
    recommendation = recommend(results, settings.threshold, settings.min_agreement)
    index = turn.new.request.index
    full_ms = turn.store.prefill_ms(turn.new.ids)
    return AuditTurn(index, len(turn.new), turn.diff, full_ms, results, recommendation, matched_request=turn.old.request.index)


def audit_value(
    lm: LoadedModel,
    request: Request,
    chars: tuple[int, int],
    new_value: str,
    *,
    message: int | None = None,
    measure: MeasureSettings = MeasureSettings(),
    progress: StepProgress = None,
) -> AuditReport:
    """One prompt with the span ``chars`` of a message's content (default: the first message holding it) set to
    ``new_value``: the prompt as cached, then as it arrives with the new value, measured with ``measure``."""
    contents = list(request.contents)
    index = message if message is not None else 0
    start, end = chars
    if not (0 <= start < end <= len(contents[index])):
        raise RequestLogError(f"characters {start}..{end} are not inside message {index + 1} ({len(contents[index])} characters)")
    if not new_value or new_value == contents[index][start:end]:
        raise RequestLogError("type a new value that differs from the selected text")
    contents[index] = contents[index][:start] + new_value + contents[index][end:]
    updated = request.with_contents(contents)
    return audit_requests(lm, [request, Request(2, request.line, updated.messages, updated.prompt)], measure=measure, progress=progress)


def candidates(lm: LoadedModel, request: Request) -> tuple[RenderedRequest, list[Candidate]]:
    """One prompt's volatile-looking spans (dates and times, ids, hex strings, numbers, ``key: value`` values)."""
    rendered = render_request(lm, request)
    return rendered, candidate_spans(rendered)


def scenario_toml(report: AuditReport, labels: Sequence[str] | None = None, *, request: int | None = None, field: str | None = None) -> str:
    """A scenario file for the Notes tab and ``python -m kvscope edit``: one changed field of one turn (default: the
    first field of the last turn with a changed field; :func:`changed_field` picks another), its messages before the last
    as the context with the field as a placeholder, the last message as the question.

    ``labels`` are the two answers to read, each its own surface (default: yes / no;
    :func:`kvscope.engine.audit.measure.notes_scenario.notes_scenario` reads the model's own)."""
    turn, change = changed_field(report, request, field)
    new = report.rendered[[t.request for t in report.turns].index(turn.request)]
    contents = [content.strip() for content in new.request.contents]
    if change.message == len(contents) - 1:
        raise RequestLogError(last_message_words(change, turn.request, new))
    start = new.content_spans[change.message][0]  # where the (stripped) content was found in the rendered text
    inner = change.char_span[0] - start, change.char_span[1] - start
    holder = contents[change.message]
    contents[change.message] = escape_braces(holder[: inner[0]]) + "{" + change.name + "}" + escape_braces(holder[inner[1] :])
    context = "\n\n".join(text if i == change.message else escape_braces(text) for i, text in enumerate(contents[:-1]))
    answers = list(labels or ["yes", "no"])
    if len(answers) != 2 or answers[0] == answers[1]:
        raise RequestLogError("name two different answer labels")
    scenario = Scenario(
        name=f"Request {turn.request} ({report.model})",
        description=f"Built from a request log: {change.name} {change.old!r} -> {change.new!r}",
        system=None,
        context=context,
        question=escape_braces(contents[-1]),
        fields={change.name: Field(change.name, change.old, change.new, (change.old, change.new))},
        answers={label: (label,) for label in answers},
        expect={},
    )
    return scenario.to_toml()


def changed_field(report: AuditReport, request: int | None = None, field: str | None = None) -> tuple[AuditTurn, FieldChange]:
    """The turn of request ``request`` (default: the last turn with a changed field) and its changed field ``field``
    (default: its first), refused by name where the audit holds no such change."""
    if request is None:
        turn = report.last_with_fields()
        if turn is None:
            raise RequestLogError("no request of this log changes a field inside shared content, so there is no field to edit")
    else:
        turn = next((t for t in report.turns if t.request == request and t.fields), None)
        if turn is None:
            changed = [t.request for t in report.turns if t.fields]
            raise RequestLogError(f"request {request} changes no field in the measured turns; those that do: {changed or 'none'}")
    if field is None:
        return turn, turn.fields[0]
    change = next((c for c in turn.fields if c.name == field), None)
    if change is None:
        raise RequestLogError(f"request {turn.request} changes no field {field!r}; it changes {', '.join(c.name for c in turn.fields)}")
    return turn, change


def last_message_words(change: FieldChange, request: int, rendered: RenderedRequest) -> str:
    """Why a value changed in the last message cannot be a scenario's field, and what to do instead."""
    count = len(rendered.request.contents)
    role = f", the {rendered.request.messages[-1].role}'s" if rendered.request.messages else ""
    return (
        f"{change.name} changed in message {count} of request {request} (the last{role}), which a scenario reads as its "
        "question, so it cannot hold the field: pick a field of an earlier message, or put the value in a message before "
        "the question (e.g. the system prompt) and audit again"
    )


def repaired_template(report: AuditReport, repair: str | None = None) -> str:
    """The prompt template (:mod:`kvscope.engine.audit.prompts.template`) that sends every request as prompt-level repair ``repair``
    (default: the recommended one) sent the last request with a changed field, each changed field a placeholder.
    It is built by the function that built the prompt the audit measured
    (:func:`kvscope.engine.audit.measure.repairs.repaired_request`), so applied to the log (``--template``) it sends that request as
    the tokens measured."""
    turn = report.last_with_fields()
    if turn is None:
        raise RequestLogError("no field changed in this log: the prompt template needs no repair")
    name = repair or turn.recommendation.repair
    measured = turn.repairs.get(name)
    if measured is None or not measured.applicable:
        why = f"it does not apply: {measured.reason}" if measured else "it was not measured (add it to the repairs)"
        raise RequestLogError(f"no {name} template for request {turn.request}: {why}")
    new = report.rendered[[t.request for t in report.turns].index(turn.request)]
    try:
        return written_template(name, new, turn.fields, measured.detail.get("grain"))
    except RepairNotApplicable as error:
        raise RequestLogError(str(error)) from None
