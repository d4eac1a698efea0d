"""``audit --endpoint URL``: the audit's model pass (sampled groups, ``--rewritten``, ``--template``) measured on an
OpenAI-compatible endpoint (:mod:`kvscope.engine.audit.endpoint.served_measure`); the local ``--model`` gives only the tokenizer's
token pass. The API key comes from the environment (``KVSCOPE_ENDPOINT_KEY``), never from a flag."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvscope.engine.audit.endpoint.client import (
    DEFAULT_CONCURRENCY,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOP_K,
    KEY_ENV,
    SEND_MODES,
    EndpointClient,
    EndpointSettings,
)
from kvscope.engine.audit.endpoint.served_measure import audit_on_endpoint, measure_rewrite_on_endpoint
from kvscope.engine.audit.logs.requests import RequestLog
from kvscope.engine.audit.logs.shards import LogFiles
from kvscope.engine.audit.measure.settings import MeasureSettings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.audit.report.records import init_values
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import sample_groups
from kvscope.engine.cli.common import Group, arg, progress
from kvscope.engine.cli.scale import token_pass
from kvscope.engine.models import LoadedModel

ENDPOINT: Group = (
    arg("--endpoint", help=f"an OpenAI-compatible base URL: measure on the served model (API key from ${KEY_ENV})"),
    arg("--endpoint-model", help="the served model's name (default: the one model the server lists)"),
    arg("--endpoint-top-k", type=int, default=DEFAULT_TOP_K, help="top log-probs asked per token (as many as the server allows)"),
    arg("--endpoint-concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight at most"),
    arg("--endpoint-timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request before it is retried"),
    arg("--endpoint-cache", help="JSONL of answers kept by request hash: a rerun resumes and sends no request twice"),
    arg("--endpoint-send", choices=SEND_MODES, default="auto", help="tokens: the audited ids; chat: messages (auto: ids where taken)"),
)


def endpoint_client(args: argparse.Namespace) -> EndpointClient:
    settings = EndpointSettings(
        args.endpoint,
        args.endpoint_model,
        top_k=args.endpoint_top_k,
        concurrency=args.endpoint_concurrency,
        timeout_s=args.endpoint_timeout,
        cache_path=Path(args.endpoint_cache) if args.endpoint_cache else None,
        send=args.endpoint_send,
    )
    return EndpointClient(settings)


def measure_on_endpoint(
    args: argparse.Namespace,
    lm: LoadedModel,
    log: LogFiles,
    rewritten: RequestLog | None,
    settings: ScanSettings,
    measure: MeasureSettings,
) -> dict:
    """The token pass with the local tokenizer (on Ray with --ray, with the fleets of --replicas), then the sampled turns
    and the rewrite (with one) measured on the endpoint."""
    client = endpoint_client(args)
    text = {"tokenizer": lm.tokenizer, "model": lm.name}
    settings = settings.for_model(lm)
    scan = {"settings": settings, "scan_progress": progress("token pass: requests"), "token_pass": token_pass(args, lm)}
    traffic = audit_traffic(lm, log, sample=0, measure=measure, **scan)
    groups = sample_groups(traffic.scan, args.sample)
    measured = audit_on_endpoint(client, traffic.scan, groups, measure=measure, progress=progress("endpoint: sampled prompts"), **text)
    rewrite = None
    if rewritten is not None:
        rewrite = measure_rewrite_on_endpoint(
            client, log.log, rewritten, settings=settings, tokens=measure.tokens, progress=progress("endpoint: rewrite requests"), **text
        )
        measured = dataclasses.replace(measured, **init_values(rewrite.endpoint))
    return dataclasses.replace(traffic, groups=tuple(groups), sample=args.sample, endpoint=measured, rewrite=rewrite).as_dict()
