"""The Your prompt tab's "Measure on a server": the rewrite of a log measured on the user's own OpenAI-compatible server
(a URL and a model) instead of the loaded model; a shared server (the public profile) refuses it before any request."""

from __future__ import annotations

import html

from kvscope.app.handlers.common import AppError, guarded, number
from kvscope.app.handlers.your_prompt import DEFAULTS, audit_text
from kvscope.app.state import ModelRegistry
from kvscope.engine import (
    EndpointClient,
    EndpointSettings,
    ScanSettings,
    StepProgress,
    apply_template,
    measure_rewrite_on_endpoint,
    read_log,
    rewrite_markdown,
)


@guarded
def run_rewrite_on_server(
    registry: ModelRegistry,
    text: str | None,
    *,
    spec: str | None = None,
    rewritten: str | None,
    template: bool = False,
    url: str | None,
    model: str | None = None,
    tokens=DEFAULTS.tokens,
    progress: StepProgress = None,
) -> tuple[str, dict]:
    """The rewrite measured on the server at ``url`` serving ``model`` (the loaded model gives the tokenizer): the same
    rows and verdict as the in-process measurement, each with its KL bound and the server's own cached tokens."""
    registry.profile.check_measure_on_server()
    if not (url or "").strip():
        raise AppError("type the server's base URL, e.g. http://127.0.0.1:8000 (vLLM, SGLang, llama-server)")
    log = read_log(audit_text(text, "the original request log"))
    given = audit_text(rewritten, "the rewritten log (or a prompt template)")
    changed = apply_template(given, log) if template else read_log(given)
    tokens = number(tokens, "greedy tokens N", DEFAULTS.tokens)
    registry.profile.check_audit(len(log.requests), tokens)
    lm = registry.get(spec)
    client = EndpointClient(EndpointSettings(url.strip(), (model or "").strip() or None))
    measured = measure_rewrite_on_endpoint(
        client, log, changed, tokenizer=lm.tokenizer, settings=ScanSettings(), tokens=tokens, model=lm.name, progress=progress
    )
    rows = measured.rows()
    endpoint = measured.endpoint
    where = f"{html.escape(str(endpoint['model']))} at {html.escape(endpoint['url'])}"
    lead = f"Measured on {where} ({endpoint['sent_as']}); top {endpoint['top_k']} log-probs.\n\n"
    return lead + rewrite_markdown(measured.report.verdict(), rows), {
        "rewrite": rows,
        "verdict": measured.report.verdict(),
        "endpoint": endpoint,
    }
