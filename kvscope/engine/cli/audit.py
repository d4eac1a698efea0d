"""``audit``: a request log (or one prompt with a new value) audited, a rewrite of it measured, a CI gate on it;
``audit-schema``: the JSON Schema its report follows (docs/audit-report.schema.json)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from kvscope.engine.audit.ci.gate import QUANTITIES, budget_lines, gate, markdown, parse_conditions
from kvscope.engine.audit.ci.report import AuditJSON, report_schema
from kvscope.engine.audit.logs.reading import parse_prompt, read_log
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError
from kvscope.engine.audit.logs.shards import LogFiles
from kvscope.engine.audit.measure.kv_store import ComputedStates
from kvscope.engine.audit.measure.settings import DEFAULT_MIN_AGREEMENT, DEFAULT_THRESHOLD, DEFAULT_TOKENS, MeasureSettings
from kvscope.engine.audit.measure.traffic import DEFAULT_SAMPLE, audit_traffic
from kvscope.engine.audit.measure.turn import audit_value, repaired_template, scenario_toml
from kvscope.engine.audit.policy.build import policy_from_report
from kvscope.engine.audit.prompts.repair_requests import GRAINS, PROMPT_REPAIRS, REPAIRS
from kvscope.engine.audit.prompts.text_spans import find_span
from kvscope.engine.audit.rewrite.measure import apply_template, check_pairing, measure_rewrite
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.audit.simulate.metrics import observed_aggregate
from kvscope.engine.audit.simulate.observed import NO_OBSERVED_COUNTS, OBSERVED_ENGINES
from kvscope.engine.audit.simulate.registry import budgets
from kvscope.engine.cli.common import LOG_FORMAT, Group, Handler, arg, load, log, names, progress, read_text
from kvscope.engine.cli.endpoint import ENDPOINT, measure_on_endpoint
from kvscope.engine.cli.scale import SCALE, SERVER_SIZE, log_files, scan_settings, token_pass, turn_pass
from kvscope.engine.models import load_tokenizer


def cmd_audit(args: argparse.Namespace) -> dict:
    """Audit a request log (or one prompt with --find/--new): a token pass over every request (sessions, matches, causes,
    simulated vLLM / SGLang / llama.cpp reuse), then every repair's cost and fidelity on --sample turns per change;
    with --rewritten / --template, the rewrite's reuse and output against the original's; --fail-on gates on it."""
    files = log_files(args)
    # one prompt, with --new (read before the model loads); a log's text is never held whole (``LogFiles.log`` streams it)
    text = files.text() if args.new is not None and files.one_text and not args.ray else None
    conditions = parse_conditions(args.fail_on)
    _check_outputs(args)
    measure = MeasureSettings(tuple(names(args.repairs) or REPAIRS), args.tokens, args.threshold, args.min_agreement, args.grain)
    # no weights where no forward runs here: the token pass alone, or every measurement on an endpoint
    tokens_only = args.new is None and (bool(args.endpoint) or (args.sample == 0 and not (args.rewritten or args.template)))
    lm = load_tokenizer(args.model, progress=log) if tokens_only else load(args)
    if args.new is None:
        settings = scan_settings(args, lm)
        for line in budget_lines([budget.as_dict() for budget in budgets(settings.cache)]):
            log(f"KV budget: {line}")
        if not args.ray:  # read here, once (with --ray the workers read the files, and the driver never holds the log)
            request_log = files.log
            if args.fit_observed and all(request.observed_cached_tokens is None for request in request_log.requests):
                raise RequestLogError(NO_OBSERVED_COUNTS)  # before the model measures anything
        scrapes = [read_text(path) for path in args.metrics]
        if scrapes:
            observed_aggregate(scrapes, {})  # a scrape that cannot be read fails before the model measures anything
        if not args.ray:
            for skipped in files.log.skipped:
                log(f"skipped {skipped.message}")
        steps = {"scan_progress": progress("token pass: requests"), "messages": log}  # the model pass a forward at a time
        rewritten = _rewritten(args, files)
        if args.endpoint:
            return _finish(args, conditions, measure_on_endpoint(args, lm, files, rewritten, settings, measure))
        scale = {"token_pass": token_pass(args, lm), "measure_turns": turn_pass(args, lm)}
        # a rewrite reads the log's requests again: from the audit's own store, and after its own token pass (one process)
        shared = rewritten is not None and not args.ray
        states = ComputedStates(lm, args.tokens) if shared else None
        traffic = audit_traffic(
            lm,
            files,
            sample=args.sample,
            settings=settings,
            measure=measure,
            states=states,
            **steps,
            **scale,
        )
        measured = None
        if rewritten is not None:
            measured = measure_rewrite(
                lm,
                files.log,
                rewritten,
                settings=settings,
                tokens=args.tokens,
                progress=progress("rewrite: requests"),
                before=traffic.scan if shared else None,
                reuse=states,
            )
        traffic = dataclasses.replace(traffic, fit=args.fit_observed, scrapes=tuple(scrapes), rewrite=measured)
        result, report = traffic.as_dict(), traffic.measured_report()
    else:
        if text is None:
            raise RequestLogError("--new audits one prompt: give one plain file")
        if args.endpoint:
            raise RequestLogError("--endpoint measures a log's sampled turns or its rewrite; it does not combine with --new")
        request = parse_prompt(text)
        if not args.find:
            raise RequestLogError("--new needs --find TEXT: the value to change in the prompt")
        site = find_span(request, args.find)
        report = audit_value(lm, request, site.chars, args.new, message=site.message, measure=measure, progress=progress("audit steps"))
        result = report.as_dict()
    template = (args.template_out, lambda: repaired_template(report, args.template_repair))
    policy = (args.policy_out, lambda: policy_from_report(report, " ".join(args.log)).text())
    for path, build in ((args.scenario_out, lambda: scenario_toml(report)), template, policy):
        if path:
            Path(path).write_text(build(), encoding="utf-8")
    return _finish(args, conditions, result)


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is read or loaded, the flags that ask for a rewrite or a file this run cannot make."""
    if args.rewritten and args.template:
        raise RequestLogError("--rewritten and --template are two rewrites: measure one at a time")
    if args.template_repair and not args.template_out:
        raise RequestLogError("--template-repair names the repair whose template --template-out writes: add --template-out FILE")
    if args.policy_out and (args.endpoint or (args.sample == 0 and args.new is None)):
        raise RequestLogError("--policy-out writes the repairs measured in this process: measure turns (--sample > 0), without --endpoint")
    if (args.rewritten or args.template) and args.new is not None:
        raise RequestLogError("--rewritten and --template measure a log's rewrite; they do not combine with --new")


def _finish(args: argparse.Namespace, conditions: list, result: AuditJSON) -> AuditJSON:
    """The gate over the result, and its Markdown summary where asked for."""
    if conditions:
        result["gate"] = gate(conditions, result).as_dict()
    if args.markdown and not args.json:
        print(markdown(result), end="")
    return result


def _rewritten(args: argparse.Namespace, files: LogFiles) -> RequestLog | None:
    """The rewritten log of --rewritten, or --template applied to the original (``files``, read here; None without
    either), paired with it."""
    if not (args.rewritten or args.template):
        return None
    original = files.log
    if args.rewritten:
        rewritten = read_log(read_text(args.rewritten), args.format)
    elif args.template:
        rewritten = apply_template(read_text(args.template), original)
        changed = sum(old.contents != new.contents for old, new in zip(original.requests, rewritten.requests))
        kept = " (the others' prompt lacks its read lines, or is the template's already)" if changed < len(original.requests) else ""
        log(f"template: {changed} of {len(original.requests)} requests rewritten{kept}")
    check_pairing(original.requests, rewritten.requests)
    return rewritten


AUDIT: Group = (
    arg(
        "log",
        nargs="+",
        help="request log (JSONL or a JSON array, in any of --format's formats; several files, directories of shards, "
        "gzip'd JSONL), or one prompt with --new",
    ),
    LOG_FORMAT,
    arg("--sample", type=int, default=DEFAULT_SAMPLE, help="turns measured with the model per change signature (0: token pass only)"),
    arg(
        "--block-size",
        type=int,
        help=f"vLLM KV block size in tokens (default: read from a vLLM log's cached counts, else {CacheSettings.block})",
    ),
    arg("--kv-budget-blocks", type=int, help="vLLM KV budget in blocks (default: unbounded)"),
    arg("--kv-budget-tokens", type=int, help="SGLang radix-cache budget in tokens (default: unbounded)"),
    arg("--slots", type=int, help="llama.cpp server slots (default: one per session)"),
    arg("--cache-reuse", type=int, default=0, help="llama.cpp --cache-reuse N: shift cached chunks of at least N tokens (0: off)"),
    arg(
        "--prompt-cache",
        action="store_const",
        const=True,
        default=None,
        help="llama.cpp as a client that pins no slot meets it: slots chosen by prompt similarity and its RAM prompt cache "
        "(--cache-ram, on by default); --slots N: the server's -np (default: 4 slots, one KV cache). The default, unless "
        "the log pins slots (id_slot) or --cache-reuse is given",
    ),
    arg(
        "--slot-per-session",
        dest="prompt_cache",
        action="store_const",
        const=False,
        help="llama.cpp with a slot per session (a client that pins each session to a slot, id_slot), its RAM prompt cache "
        "off; the default where the log pins slots",
    ),
    arg(
        "--observed-engine",
        default=None,
        choices=OBSERVED_ENGINES,
        help="the simulated engine the log's observed cached tokens are compared with (observed_shortfall / observed_excess); "
        "default: the server the log's answers name (llama-server's timings, vLLM's and SGLang's own fields), else vllm",
    ),
    arg(
        "--fit-observed",
        action="store_true",
        help="search the compared engine's settings (vLLM: block size and KV budget; SGLang: page size and budget; llama.cpp: "
        "slots, prompt cache, --cache-reuse) for those that reproduce the most observed cached counts exactly",
    ),
    arg(
        "--metrics",
        action="append",
        default=[],
        metavar="SCRAPE",
        help="a Prometheus /metrics scrape of the server (vLLM, SGLang): its prefix-cache counters beside the simulation, "
        "for logs without usage; twice: before and after the log, for the log's window",
    ),
    arg("--repairs", help=f"comma-separated subset of: {', '.join(REPAIRS)} (recompute always runs)"),
    arg("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens generated per state"),
    arg("--threshold", type=float, default=DEFAULT_THRESHOLD, help="largest next-token KL a recommended repair may have"),
    arg("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT, help="smallest share of agreeing greedy tokens"),
    arg("--grain", choices=GRAINS, help="coarsen date-times to this grain (the coarsen repair)"),
    arg("--find", help="one prompt: the text of the value to change"),
    arg("--new", help="one prompt: its new value (the file is then one prompt, not a log)"),
    arg("--scenario-out", help="write the auto-built scenario TOML here (Notes tab, `edit`)"),
    arg("--template-out", help="write the recommended prompt-level repair here, as the prompt template it measured"),
    arg("--template-repair", choices=PROMPT_REPAIRS, help="the prompt-level repair --template-out writes (default: the recommended one)"),
    arg("--policy-out", help="write the policy here: per changed field, the prompt-level repair measured within the bars (docs/deploy.md)"),
    arg("--rewritten", help="a rewrite of the log (same requests, same order): its reuse and output against the original's"),
    arg("--template", help="a prompt template (as --template-out writes) applied to the log's values: the rewrite to measure"),
    arg(
        "--fail-on",
        action="append",
        default=[],
        metavar="CONDITION",
        help=f"exit 1 when a condition holds, e.g. reuse<0.5,kl>0.05 (over the rewrite if one is measured): {', '.join(QUANTITIES)}",
    ),
    arg("--markdown", action="store_true", help="print a Markdown summary for a pull-request comment (ignored with --json)"),
    *ENDPOINT,
)


def cmd_audit_schema(args: argparse.Namespace) -> dict:
    """Print the JSON Schema of audit's --json report (docs/audit-report.schema.json holds the same), for CI to validate."""
    return report_schema()


COMMANDS: dict[str, tuple[Handler, tuple[Group, ...]]] = {
    "audit": (cmd_audit, (AUDIT, SERVER_SIZE, SCALE)),
    "audit-schema": (cmd_audit_schema, ()),
}
