"""The audit's model pass on an endpoint: a log's sampled turns with each prompt-level repair, and a rewrite of the log,
measured on the served model (:mod:`kvscope.engine.audit.endpoint.client`) instead of in torch.

The token pass is the same as in-process (``traffic_scan.scan_log`` with the local tokenizer, which must be the served
model's for token ids to mean the same). Each prompt is sent once, greedy, with the top-k log-probs of its tokens:

- **sampled turns** (``audit --endpoint``): per turn the newer request as logged is the reference (``recompute`` is
  that same request: a prefix cache serves it exactly), and erratum, hoist and coarsen send the request
  :func:`kvscope.engine.audit.prompts.repair_requests.prompt_repair_request` builds, as the in-process audit measures it. A KV-level repair
  (``field_only``, ``field_erratum``) edits cached entries, which no endpoint exposes: it is listed with that reason.
  Turns go side by side (one lane each), each turn's prompts one after another.
- **a rewrite** (``--rewritten`` / ``--template``): the original log, then the rewritten log, each in log order, each
  session in its own lane (pinned to a slot or named by a header), and every rewritten request compared with its
  original. The server's reported cached tokens stand beside the simulated engine's reuse for both logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from kvscope.engine.audit.endpoint.answers import Answer, Probe
from kvscope.engine.audit.endpoint.client import CHAT, COMPLETIONS, EndpointClient, EndpointDescription, Server
from kvscope.engine.audit.endpoint.fidelity import EndpointFidelity, NotApplicable, compare
from kvscope.engine.audit.logs.render import RenderedRequest, render_batch, template_messages
from kvscope.engine.audit.logs.requests import Request, RequestLog, RequestLogError
from kvscope.engine.audit.measure.fidelity import EndpointRepairFidelity
from kvscope.engine.audit.measure.settings import MeasureSettings
from kvscope.engine.audit.prompts.repair_requests import LEVEL_WORDS, REPAIR_LEVELS, Level, RepairNotApplicable, prompt_repair_request
from kvscope.engine.audit.report.records import HIDDEN, Record, derived, init_values, rounded
from kvscope.engine.audit.rewrite.measure import RewriteReport, RewrittenRequest, check_pairing, check_rendered
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficGroup, TrafficScan, scan_log
from kvscope.engine.progress import StepProgress


def probe_for(server: Server, rendered: RenderedRequest, tokens: int, top_k: int, lane: str | None) -> Probe:
    """The greedy request that asks the endpoint for ``rendered``'s next ``tokens`` tokens with their top-k log-probs:
    its token ids where the server takes them, else its messages (its prompt text for a completions request)."""
    request = rendered.request
    greedy = {"max_tokens": tokens, "temperature": 0.0}
    if server.tokens:
        return Probe(COMPLETIONS, {"prompt": list(rendered.ids), "logprobs": top_k, **greedy}, lane)
    if request.messages is None:
        return Probe(COMPLETIONS, {"prompt": request.prompt, "logprobs": top_k, **greedy}, lane)
    body: dict[str, Any] = {"messages": template_messages(request), "logprobs": True, "top_logprobs": top_k, **greedy}
    if request.tools:
        body["tools"] = request.tool_definitions()
    return Probe(CHAT, body, lane)


def _not_measurable(names: Sequence[str]) -> dict[str, str]:
    """The KV-level repairs among ``names``, each with why an endpoint cannot measure it."""
    return {
        name: f"{LEVEL_WORDS[Level.KV]}: it edits cached K/V in place, which an endpoint does not expose"
        for name in names
        if REPAIR_LEVELS[name] is Level.KV
    }


# ----------------------------------------------------------------------------------------------- sampled turns
@dataclass(frozen=True)
class EndpointTurn(Record):
    """One sampled turn on the endpoint: the server's cached tokens for the reference, the simulation's, and each
    prompt-level repair against the reference (or why it does not apply)."""

    request: int
    matched_request: int
    reference: Annotated[Answer, HIDDEN]  # the request as logged, answered
    server_cached_tokens: int | None = derived()  # the reference's
    simulated_reused_tokens: dict[str, int]
    repairs: dict[str, EndpointFidelity | NotApplicable]

    def __post_init__(self) -> None:
        self.derive(server_cached_tokens=self.reference.cached_tokens)


@dataclass(frozen=True)
class EndpointAudit(EndpointDescription):
    """``--endpoint``: the endpoint, the repairs it cannot measure and why, and the sampled turns of a log measured on it."""

    not_measurable: dict[str, str]
    turns: tuple[EndpointTurn, ...]

    def group_fidelity(self, requests: Sequence[int]) -> dict[str, EndpointRepairFidelity]:
        """Per prompt-level repair over a group's measured turns: how many it applied to and held the bars on, its worst
        KL (with its bound) and its least agreement."""
        turns = [turn for turn in self.turns if turn.request in requests]
        summary: dict[str, EndpointRepairFidelity] = {}
        for name in dict.fromkeys(name for turn in turns for name in turn.repairs if name != "recompute"):
            applied = [turn.repairs[name] for turn in turns if isinstance(turn.repairs.get(name), EndpointFidelity)]
            worst = max(applied, key=lambda m: m.kl, default=None)
            summary[name] = EndpointRepairFidelity(
                measured=len(turns),
                applicable=len(applied),
                within_bars=sum(m.within_bars for m in applied),
                worst_kl=worst.kl if worst else None,
                worst_kl_bound=worst.kl_bound if worst else None,
                min_agreement=min((m.generation_agreement for m in applied), default=None),
            )
        return summary


def audit_on_endpoint(
    client: EndpointClient,
    scan: TrafficScan,
    groups: Sequence[TrafficGroup],
    *,
    tokenizer: Any,
    measure: MeasureSettings,
    model: str = "this model",
    progress: StepProgress = None,
) -> EndpointAudit:
    """The groups' sampled turns (``traffic_scan.sample_groups``) measured on the endpoint with every prompt-level repair
    of ``measure`` (its greedy tokens, grain and bars), each prompt cut at the token pass's limit."""
    repairs, tokens = measure.repairs, measure.tokens
    server = client.connect()
    matched = {row.request: row for row in scan.requests}
    chosen = sorted(index for group in groups for index in group.measured)
    plans: list[tuple[int, dict[str, RenderedRequest | str]]] = []
    for index in chosen:
        new, diff = scan.rendered[index], scan.diffs[index]
        built: dict[str, Request | str] = {}
        for name in repairs:
            if name == "recompute" or REPAIR_LEVELS[name] is Level.KV:
                continue
            try:
                built[name] = prompt_repair_request(name, new, diff, measure.grain)
            except RepairNotApplicable as error:
                built[name] = str(error)
        requests = [item for item in built.values() if isinstance(item, Request)]
        rendered = iter(render_batch(tokenizer, requests, scan.settings.limit, model))
        plans.append((index, {name: item if isinstance(item, str) else _rendered(next(rendered)) for name, item in built.items()}))
    probes, where = [], []
    for index, plan in plans:
        lane = f"turn-{index}"
        probes.append(probe_for(server, scan.rendered[index], tokens, client.settings.top_k, lane))
        where.append((index, None))
        for name, item in plan.items():
            if not isinstance(item, str):
                probes.append(probe_for(server, item, tokens, client.settings.top_k, lane))
                where.append((index, name))
    answers = dict(zip(where, client.answer(probes, progress)))
    turns = []
    for index, plan in plans:
        reference = answers[(index, None)]
        measured: dict[str, EndpointFidelity | NotApplicable] = {}
        if "recompute" in repairs:
            measured["recompute"] = NotApplicable("the reference itself: the request as logged, which a prefix cache serves exactly")
        for name, item in plan.items():
            if isinstance(item, str):
                measured[name] = NotApplicable(item)
            else:
                found = compare(reference, answers[(index, name)])
                measured[name] = dataclasses.replace(found, within_bars=found.fidelity.within(measure.threshold, measure.min_agreement))
        row = matched[index]
        turns.append(EndpointTurn(index, row.matched_request, reference, dict(row.reused_tokens), measured))
    return EndpointAudit(**init_values(client.describe()), not_measurable=_not_measurable(repairs), turns=tuple(turns))


def _rendered(item: RenderedRequest | RequestLogError) -> RenderedRequest:
    if isinstance(item, RequestLogError):
        raise item
    return item


# ----------------------------------------------------------------------------------------------------- a rewrite
@dataclass(frozen=True)
class EndpointRewrittenRequest(RewrittenRequest):
    """A rewritten request measured on an endpoint: the KL's bound, and the server's cached tokens beside the simulated."""

    kl_bound: Annotated[float, rounded(8)]
    tail_mass: Annotated[float, rounded(8)]
    top_k: int
    server_cached_tokens_before: int | None
    server_cached_tokens_after: int | None
    simulated_engine: str
    simulated_reused_tokens_before: int = derived()
    simulated_reused_tokens_after: int = derived()

    def __post_init__(self) -> None:
        super().__post_init__()
        engine = self.simulated_engine
        self.derive(simulated_reused_tokens_before=self.reused_before[engine], simulated_reused_tokens_after=self.reused_after[engine])


@dataclass(frozen=True)
class EndpointRewrite:
    """A rewrite measured on an endpoint: the in-process report's rows and verdict, each row with the KL's bound and
    the server's reported cached tokens before and after, and the endpoint."""

    report: RewriteReport
    endpoint: EndpointDescription

    def verdict(self) -> str:
        return self.report.verdict()

    def rows(self) -> list[dict[str, Any]]:
        return self.report.rows()


def measure_rewrite_on_endpoint(
    client: EndpointClient,
    original: RequestLog,
    rewritten: RequestLog,
    *,
    tokenizer: Any,
    settings: ScanSettings,
    tokens: int,
    model: str = "this model",
    progress: StepProgress = None,
) -> EndpointRewrite:
    """Both logs through the token pass, both sent in log order (the original first), and every rewritten request's
    answer compared with its original's."""
    check_pairing(original.requests, rewritten.requests)
    if tokens < 1:
        raise RequestLogError(f"generate at least one token per state, got {tokens}")
    server = client.connect()
    before = scan_log(tokenizer, original, settings, model=model)
    after = scan_log(tokenizer, rewritten, settings, model=model)
    check_rendered(before, after)
    top_k = client.settings.top_k
    rows_before, rows_after = before.requests, after.requests
    originals = [probe_for(server, before.rendered[row.request], tokens, top_k, row.session) for row in rows_before]
    rewrites = [probe_for(server, after.rendered[row.request], tokens, top_k, row.session) for row in rows_after]
    total = len(originals) + len(rewrites)
    first = client.answer(originals, _shifted(progress, 0, total))
    second = client.answer(rewrites, _shifted(progress, len(originals), total))
    rows = []
    for old, new, a, b in zip(rows_before, rows_after, first, second):
        m = compare(a, b)
        generated = max(len(a.generated), len(b.generated))
        texts = a.text, b.text
        row = old.request, old.tokens, new.tokens, old.reused_tokens, new.reused_tokens, m.fidelity, generated, *texts
        served = m.kl_bound, m.tail_mass, m.top_k, a.cached_tokens, b.cached_tokens, server.simulated_engine
        rows.append(EndpointRewrittenRequest(*row, *served))
    return EndpointRewrite(RewriteReport(tuple(rows), tokens), client.describe())


def _shifted(progress: StepProgress, offset: int, total: int) -> StepProgress:
    return None if progress is None else (lambda done, _: progress(offset + done, total))
