"""The Your prompt tab's rewrite of a log (a linter's rewritten log, or a prompt template applied to the log's values)
measured against it: on the loaded model, or on the user's own OpenAI-compatible server (a URL and a model; a shared
server, the public profile, refuses that before any request). Both simulate the tab's engines."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvscope.app.handlers.audit_log import audit_text
from kvscope.app.handlers.audit_settings import DEFAULTS, EngineInputs
from kvscope.app.handlers.common import AppError, AppUnreachable, guarded, number
from kvscope.app.state import ModelRegistry
from kvscope.engine import (
    EndpointClient,
    EndpointSettings,
    ModelKV,
    StepProgress,
    Unreachable,
    apply_template,
    measure_rewrite,
    measure_rewrite_on_endpoint,
    read_log,
    rewrite_markdown,
)

if TYPE_CHECKING:
    from kvscope.engine.audit.logs.requests import RequestLog


class ServerUnreachable(AppUnreachable):
    """Nothing answers at the server's URL: said in the tab's words (the URL box it was typed in), with the URL as given."""

    SAID = "nothing answers at {url}: start the server there, or correct the URL in the box above"

    def __init__(self, url: str) -> None:
        super().__init__(self.SAID.format(url=url))
        self.url = url

    def markdown(self) -> str:
        """The sentence for the panel, the URL as code (shown as typed: no escapes, no link)."""
        said = self.SAID.format(url=f"`{self.url.replace('`', '')}`")
        return f"⚠️ {said[:1].upper()}{said[1:]}."


@dataclass(frozen=True)
class RewriteInputs:
    """A rewrite as the tab gives it: the original log, the rewritten one (or a template, ``template``), and the greedy
    tokens each prompt reads."""

    text: str | None
    rewritten: str | None
    template: bool = False
    tokens: int | float | str | None = DEFAULTS.tokens


def _logs(registry: ModelRegistry, given: RewriteInputs) -> tuple[RequestLog, RequestLog, int]:
    """The original log, the rewritten one and the greedy tokens, checked (the profile bounds the requests and tokens)."""
    log = read_log(audit_text(given.text, "the original request log"))
    rewritten = audit_text(given.rewritten, "the rewritten log (or a prompt template)")
    changed = apply_template(rewritten, log) if given.template else read_log(rewritten)
    tokens = number(given.tokens, "greedy tokens N", DEFAULTS.tokens)
    registry.profile.check_audit(len(log.requests), tokens)
    return log, changed, tokens


@guarded
def run_rewrite(
    registry: ModelRegistry,
    given: RewriteInputs,
    *,
    spec: str | None = None,
    engines: EngineInputs = EngineInputs(),
    progress: StepProgress = None,
) -> tuple[str, dict]:
    """The rewrite measured against the log on the loaded model: each engine's reuse before and after (simulated with
    the tab's ``engines``), and each rewritten prompt's output against the original's clean prefill."""
    log, changed, tokens = _logs(registry, given)
    lm = registry.get(spec)
    measured = measure_rewrite(
        lm,
        log,
        changed,
        settings=engines.scan(registry.profile.max_context_tokens, ModelKV.known(lm)),
        tokens=tokens,
        progress=progress,
    )
    rows = [row.as_dict() for row in measured.requests]
    return rewrite_markdown(measured.verdict(), rows), {"rewrite": rows, "verdict": measured.verdict()}


@guarded
def run_rewrite_on_server(
    registry: ModelRegistry,
    given: RewriteInputs,
    *,
    spec: str | None = None,
    url: str | None,
    model: str | None = None,
    engines: EngineInputs = EngineInputs(),
    progress: StepProgress = None,
) -> tuple[str, dict]:
    """The rewrite measured on the server at ``url`` serving ``model`` (the loaded model gives the tokenizer; the tab's
    ``engines`` simulate each engine's reuse): the same rows and verdict as on the loaded model, each with its KL bound
    and the server's own cached tokens."""
    registry.profile.check_measure_on_server()
    if not (url or "").strip():
        raise AppError("type the server's base URL, e.g. http://127.0.0.1:8000 (vLLM, SGLang, llama-server)")
    log, changed, tokens = _logs(registry, given)
    lm = registry.get(spec)
    client = EndpointClient(EndpointSettings(url.strip(), (model or "").strip() or None))
    settings = engines.scan(None, ModelKV.known(lm))
    try:
        measured = measure_rewrite_on_endpoint(
            client, log, changed, tokenizer=lm.tokenizer, settings=settings, tokens=tokens, model=lm.name, progress=progress
        )
    except Unreachable as error:
        raise ServerUnreachable(client.settings.base) from error
    rows = measured.rows()
    endpoint = measured.endpoint
    where = f"{html.escape(str(endpoint.model))} at {html.escape(endpoint.url)}"
    lead = f"Measured on {where} ({endpoint.sent_as}); top {endpoint.top_k} log-probs.\n\n"
    return lead + rewrite_markdown(measured.report.verdict(), rows), {
        "rewrite": rows,
        "verdict": measured.report.verdict(),
        "endpoint": endpoint.as_dict(),
    }
