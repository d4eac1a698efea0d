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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvscope.engine.audit.endpoint.answers import Answer, Probe
from kvscope.engine.audit.endpoint.client import CHAT, COMPLETIONS, EndpointClient, Server
from kvscope.engine.audit.endpoint.fidelity import EndpointFidelity, compare
from kvscope.engine.audit.logs.render import RenderedRequest, render_batch, template_messages
from kvscope.engine.audit.logs.requests import Request, RequestLog, RequestLogError
from kvscope.engine.audit.measure.settings import MeasureSettings
from kvscope.engine.audit.prompts.repair_requests import LEVEL_WORDS, REPAIR_LEVELS, Level, RepairNotApplicable, prompt_repair_request
from kvscope.engine.audit.report.records import Record
from kvscope.engine.audit.rewrite.measure import RewriteReport, RewrittenRequest, check_pairing, check_rendered
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import TrafficGroup, TrafficScan, scan_log
from kvscope.engine.progress import StepProgress

if TYPE_CHECKING:
    from kvscope.engine.audit.report.types import (
        EndpointAuditDict,
        EndpointDescriptionDict,
        EndpointRepairDict,
        EndpointRewrittenRequestDict,
        EndpointTurnDict,
        NotApplicableDict,
    )


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
class EndpointTurn:
    """One sampled turn on the endpoint: the reference's answer and each prompt-level repair's against it."""

    request: int
    matched_request: int
    reference: Answer
    simulated_reused_tokens: dict[str, int]
    repairs: dict[str, EndpointFidelity | str]  # the comparison, or why the repair does not apply
    cached_tokens: dict[str, int | None]  # per repair, the server's reported cached tokens

    def as_dict(self, threshold: float, min_agreement: float) -> EndpointTurnDict:
        repairs: dict[str, EndpointRepairDict | NotApplicableDict] = {}
        for name, measured in self.repairs.items():
            if isinstance(measured, str):
                repairs[name] = {"applicable": False, "reason": measured}
                continue
            holds = _holds(measured, threshold, min_agreement)
            repairs[name] = {
                "applicable": True,
                **measured.as_dict(),
                "within_bars": holds,
                "server_cached_tokens": self.cached_tokens[name],
            }
        return {
            "request": self.request,
            "matched_request": self.matched_request,
            "server_cached_tokens": self.reference.cached_tokens,
            "simulated_reused_tokens": dict(self.simulated_reused_tokens),
            "repairs": repairs,
        }


def _holds(measured: EndpointFidelity, threshold: float, min_agreement: float) -> bool:
    """Within the audit's bars: KL ≤ the threshold, the same top token, enough greedy tokens agreeing."""
    f = measured.fidelity
    return f.kl <= threshold and f.top1_agree and f.generation_agreement >= min_agreement


@dataclass(frozen=True)
class EndpointRepairFidelity(Record):
    """One prompt-level repair over a group's turns measured on an endpoint: applicable, within the bars, its worst KL
    with its bound, and its least agreement."""

    measured: int
    applicable: int
    within_bars: int
    worst_kl: float | None
    worst_kl_bound: float | None
    min_agreement: float | None


@dataclass(frozen=True)
class EndpointAudit:
    """The sampled turns of a log measured on an endpoint."""

    endpoint: EndpointDescriptionDict
    turns: tuple[EndpointTurn, ...]
    not_measurable: dict[str, str]
    threshold: float
    min_agreement: float

    def group_fidelity(self, requests: Sequence[int]) -> dict[str, EndpointRepairFidelity]:
        """Per prompt-level repair over a group's measured turns: how many it applied to and held the bars on, its worst
        KL (with its bound) and its least agreement."""
        turns = [turn for turn in self.turns if turn.request in requests]
        summary: dict[str, EndpointRepairFidelity] = {}
        for name in dict.fromkeys(name for turn in turns for name in turn.repairs if name != "recompute"):
            applied = [turn.repairs[name] for turn in turns if isinstance(turn.repairs.get(name), EndpointFidelity)]
            worst = max(applied, key=lambda m: m.fidelity.kl, default=None)
            summary[name] = EndpointRepairFidelity(
                measured=len(turns),
                applicable=len(applied),
                within_bars=sum(_holds(m, self.threshold, self.min_agreement) for m in applied),
                worst_kl=worst.fidelity.kl if worst else None,
                worst_kl_bound=worst.kl_bound if worst else None,
                min_agreement=min((m.fidelity.generation_agreement for m in applied), default=None),
            )
        return summary

    def as_dict(self) -> EndpointAuditDict:
        return {
            **self.endpoint,
            "not_measurable": dict(self.not_measurable),
            "turns": [turn.as_dict(self.threshold, self.min_agreement) for turn in self.turns],
        }


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
        measured = (
            {"recompute": "the reference itself: the request as logged, which a prefix cache serves exactly"}
            if "recompute" in repairs
            else {}
        )
        cached = {}
        for name, item in plan.items():
            measured[name] = item if isinstance(item, str) else compare(reference, answers[(index, name)])
            cached[name] = None if isinstance(item, str) else answers[(index, name)].cached_tokens
        row = matched[index]
        turns.append(EndpointTurn(index, row.matched_request, reference, dict(row.reused_tokens), measured, cached))
    return EndpointAudit(client.describe(), tuple(turns), _not_measurable(repairs), measure.threshold, measure.min_agreement)


def _rendered(item: RenderedRequest | RequestLogError) -> RenderedRequest:
    if isinstance(item, RequestLogError):
        raise item
    return item


# ----------------------------------------------------------------------------------------------------- a rewrite
@dataclass(frozen=True)
class EndpointRewrite:
    """A rewrite measured on an endpoint: the in-process report's rows and verdict, with each row's KL bound and the
    server's reported cached tokens before and after."""

    report: RewriteReport
    measured: tuple[EndpointFidelity, ...]
    cached_before: tuple[int | None, ...]
    cached_after: tuple[int | None, ...]
    endpoint: EndpointDescriptionDict
    simulated_engine: str

    def verdict(self) -> str:
        return self.report.verdict()

    def rows(self) -> list[EndpointRewrittenRequestDict]:
        engine = self.simulated_engine
        return [
            row.as_dict()
            | {key: measured.as_dict()[key] for key in ("kl_bound", "tail_mass", "top_k")}
            | {
                "server_cached_tokens_before": before,
                "server_cached_tokens_after": after,
                "simulated_engine": engine,
                "simulated_reused_tokens_before": row.reused_before[engine],
                "simulated_reused_tokens_after": row.reused_after[engine],
            }
            for row, measured, before, after in zip(self.report.requests, self.measured, self.cached_before, self.cached_after)
        ]


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
    measured = tuple(compare(a, b) for a, b in zip(first, second))
    rows = tuple(
        RewrittenRequest(
            old.request,
            old.tokens,
            new.tokens,
            old.reused_tokens,
            new.reused_tokens,
            m.fidelity,
            max(len(a.generated), len(b.generated)),
            a.text,
            b.text,
        )
        for old, new, m, a, b in zip(rows_before, rows_after, measured, first, second)
    )
    cached_before = tuple(answer.cached_tokens for answer in first)
    cached_after = tuple(answer.cached_tokens for answer in second)
    return EndpointRewrite(RewriteReport(rows, tokens), measured, cached_before, cached_after, client.describe(), server.simulated_engine)


def _shifted(progress: StepProgress, offset: int, total: int) -> StepProgress:
    return None if progress is None else (lambda done, _: progress(offset + done, total))
