"""``rewrite``: a request log rewritten by a policy (what ``audit --policy-out`` wrote) or by one repair forced on the
fields the token pass finds, written for ``audit --rewritten`` to measure; ``policy-schema``: the JSON Schema a policy
follows (docs/audit-policy.schema.json)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvscope.engine.audit.logs.requests import RequestLogError
from kvscope.engine.audit.logs.shards import LogFiles
from kvscope.engine.audit.policy.build import DEPLOYABLE, forced_policy
from kvscope.engine.audit.policy.document import load_policy, policy_schema
from kvscope.engine.audit.policy.offline import log_text, rewrite_log
from kvscope.engine.audit.policy.rewrite import DEFAULT_SESSIONS
from kvscope.engine.audit.prompts.repair_requests import GRAINS
from kvscope.engine.audit.scan.settings import ScanSettings
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.cli.common import LOG_FORMAT, Group, Handler, arg, log, progress, read_text
from kvscope.engine.models import load_tokenizer


def cmd_rewrite(args: argparse.Namespace) -> dict:
    """Rewrite a request log by a policy (--policy, from audit --policy-out) or one repair forced on every changed field
    (--repair): the rewritten log as JSONL (--out), which `audit LOG --rewritten OUT` measures."""
    if (args.policy is None) == (args.repair is None):
        raise RequestLogError("give --policy FILE (what audit --policy-out wrote) or --repair NAME, one of them")
    files = LogFiles.of(args.log, args.format)
    request_log = files.log
    if args.policy:
        policy = load_policy(read_text(args.policy))
    else:  # the fields the token pass finds, with this model's tokenizer
        lm = load_tokenizer(args.model, progress=log)
        scan = scan_log(lm.tokenizer, request_log, ScanSettings(), model=lm.name, progress=progress("token pass: requests"))
        policy = forced_policy(scan, args.repair, args.grain, lm.name, " ".join(args.log))
    rewritten = rewrite_log(request_log.requests, policy, args.sessions)
    Path(args.out).write_text(log_text(rewritten), encoding="utf-8")
    changed = [old.index for old, new in zip(request_log.requests, rewritten) if old.contents != new.contents]
    log(f"rewrite: {len(changed)} of {len(rewritten)} requests rewritten, written to {args.out}")
    return {"out": args.out, "requests": len(rewritten), "rewritten_requests": changed, "policy": policy.words()}


REWRITE: Group = (
    arg("log", nargs="+", help="request log (any format audit reads; several files, directories of shards, gzip'd JSONL)"),
    LOG_FORMAT,
    arg("--policy", help="the policy to apply (audit LOG --policy-out FILE writes it): its measured repairs only"),
    arg("--repair", choices=DEPLOYABLE, help="force this prompt-level repair on every field the token pass finds, unmeasured"),
    arg("--grain", choices=GRAINS, help="with --repair coarsen: the grain date-times are rounded to"),
    arg("--out", required=True, help="where the rewritten log goes (JSONL; measure it with audit LOG --rewritten OUT)"),
    arg("--sessions", type=int, default=DEFAULT_SESSIONS, help="sessions whose first values the erratum keeps (least recent forgotten)"),
)


def cmd_policy_schema(args: argparse.Namespace) -> dict:
    """Print the JSON Schema of a policy (docs/audit-policy.schema.json holds the same)."""
    return policy_schema()


COMMANDS: dict[str, tuple[Handler, tuple[Group, ...]]] = {"rewrite": (cmd_rewrite, (REWRITE,)), "policy-schema": (cmd_policy_schema, ())}
