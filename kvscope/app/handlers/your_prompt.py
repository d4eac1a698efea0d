"""The Your prompt tab's audits: a request log audited as traffic (its token pass shown while the model pass runs), or
one prompt with a value changed, every repair measured; what the session keeps of them is in ``audit_kept``, their
panels in ``audit_view``, the log given in ``audit_log``, the settings in ``audit_settings``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from kvscope.app.handlers.audit_kept import keep_audit
from kvscope.app.handlers.audit_log import audit_text
from kvscope.app.handlers.audit_progress import AuditPhases
from kvscope.app.handlers.audit_settings import AuditInputs, EngineInputs
from kvscope.app.handlers.audit_view import AuditView, audit_view
from kvscope.app.handlers.common import AppError, guarded, number
from kvscope.app.state import ModelRegistry, SessionStore
from kvscope.engine import (
    DEFAULT_SAMPLE,
    MessageProgress,
    ModelKV,
    RenderedRequest,
    Request,
    StepProgress,
    audit_traffic,
    audit_value,
    bounded_sample,
    candidate_menu,
    candidate_span,
    candidate_spans,
    find_span,
    parse_prompt,
    pending_report,
    read_log,
    render_request,
    traffic_scan,
)
from kvscope.viz import audit as audit_figures


@dataclass(frozen=True)
class StartedAudit:
    """An audit whose token pass is done: its view while the model pass runs (None when no turn is measured), and the
    model pass that gives the audit's view."""

    pending: AuditView | None
    finish: Callable[[], AuditView]


@guarded
def start_audit(
    registry: ModelRegistry,
    sessions: SessionStore,
    text: str | None,
    *,
    session: str,
    spec: str | None = None,
    inputs: AuditInputs = AuditInputs(),
    sample=DEFAULT_SAMPLE,
    engines: EngineInputs = EngineInputs(),
    progress: MessageProgress | None = None,
) -> StartedAudit:
    """Audit a request log as traffic, its token pass first: every request (sessions, matches, causes, the simulated
    ``engines``, the observed cached counts against the engine it names, and its fleets), shown while the model pass
    (``finish``) measures every repair on up to ``sample`` turns of each change signature (malformed records are skipped
    and named). The measured turns are kept for this session (Open in Notes, export, redrawn axes). ``progress`` hears
    every phase on one bar (:class:`AuditPhases`); with ``sample`` 0 only the tokenizer is loaded."""
    phases = AuditPhases(progress)
    phases.report("reading", "reading the log")
    log = read_log(audit_text(text, "a request log (one JSON request a line)"))
    sample = number(sample, "--sample K", DEFAULT_SAMPLE)
    profile = registry.profile
    # at most this many turns are measured: every request, or the profile's bound that ``bounded_sample`` keeps to
    measured = min(len(log.requests), profile.max_audit_requests or len(log.requests))
    measure = inputs.measure(profile, measured)
    phases.report("loading", "loading the model" if sample > 0 else "loading the tokenizer (the token pass needs no weights)")
    loading = phases.messages("loading")
    lm = registry.get(spec, progress=loading) if sample > 0 else registry.token_model(spec, progress=loading)
    settings = engines.scan(profile.max_context_tokens, ModelKV.known(lm))
    scan = traffic_scan(lm, log, settings, progress=phases.steps("token pass", "token pass: requests"))
    most = profile.max_audit_requests
    fits = bounded_sample(scan, sample, most)
    bound = None if fits == sample else f"{profile.label} measures at most {most} turns of a log: --sample lowered from {sample} to {fits}"
    shown = inputs.x, inputs.y
    pending = None
    if fits > 0 and scan.requests:
        waiting = dataclasses.replace(pending_report(lm, scan, fits, measure), sample_bound=bound)
        why = "the model pass is running: Open in Notes is offered once it has measured the turns"
        pending = audit_view(waiting.measured_report(), *shown, why, waiting.as_dict())

    @guarded
    def finish() -> AuditView:
        traffic = audit_traffic(
            lm,
            log,
            scan=scan,
            sample=fits,
            measure=measure,
            messages=phases.model_pass(),
        )
        data = dataclasses.replace(traffic, sample_bound=bound).as_dict()
        return keep_audit(registry, sessions, session, spec, lm, traffic.measured_report(), shown, data, phases)

    return StartedAudit(pending, finish)


def run_audit(registry: ModelRegistry, sessions: SessionStore, text: str | None, **options) -> AuditView:
    """The audit :func:`start_audit` starts, run to its end: its view."""
    return start_audit(registry, sessions, text, **options).finish()


def _rendered_prompt(registry: ModelRegistry, spec: str | None, text: str | None) -> tuple[Request, RenderedRequest]:
    request = parse_prompt(audit_text(text, "a prompt (plain text or messages JSON)"))
    return request, render_request(registry.get(spec), request, registry.profile.max_context_tokens)


@guarded
def prompt_candidates(registry: ModelRegistry, text: str | None, *, spec: str | None = None) -> tuple[str, list[tuple[str, int]]]:
    """One prompt rendered with the model's chat template, its volatile-looking spans highlighted and numbered, and
    the menu naming them: (label, number) pairs such as ``("3 · datetime · 2026-05-12 09:41", 3)``."""
    _, rendered = _rendered_prompt(registry, spec, text)
    found = candidate_spans(rendered)
    marks = [
        audit_figures.Mark(c.char_span[0], c.char_span[1], "candidate", f"{index} · {c.kind}: {c.text}", str(index))
        for index, c in enumerate(found, 1)
    ]
    return audit_figures.candidates_html(rendered.text, marks), candidate_menu(found)


@guarded
def run_audit_value(
    registry: ModelRegistry,
    sessions: SessionStore,
    text: str | None,
    *,
    session: str,
    spec: str | None = None,
    candidate=None,
    find: str | None = None,
    new_value: str | None = None,
    inputs: AuditInputs = AuditInputs(),
    progress: StepProgress = None,
) -> AuditView:
    """One prompt as cached, then as it arrives with one value changed: candidate span number ``candidate`` (as
    :func:`prompt_candidates` numbers them), or the first occurrence of ``find`` (which wins when given), set to
    ``new_value``."""
    request, rendered = _rendered_prompt(registry, spec, text)
    measure = inputs.measure(registry.profile, 2)
    if (find or "").strip():
        site = find_span(request, find)
    elif candidate is not None and str(candidate).strip():
        site = candidate_span(rendered, candidate_spans(rendered), number(candidate, "the candidate span", 0))
    else:
        raise AppError("pick a candidate span (Find volatile spans) or type the text to change")
    if new_value is None or not str(new_value).strip():
        raise AppError("type the new value the changed request carries")
    lm = registry.get(spec)
    report = audit_value(
        lm,
        request,
        site.chars,
        str(new_value),
        message=site.message,
        measure=measure,
        progress=progress,
    )
    return keep_audit(registry, sessions, session, spec, lm, report, (inputs.x, inputs.y))
