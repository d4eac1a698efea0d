"""The audit's repairs applied where the traffic runs: the LiteLLM proxy with KVScope's policy hook in front of vLLM's
CPU build, the bundled agents' sessions replayed through it with each reply fed back, and per variant vLLM's own
prefix-cache hit rate, the time to the first streamed token, and how often the answers agree with clean prefills of
the requests the agent sent.

    bash scripts/vllm_cpu.sh && bash scripts/litellm_proxy.sh      # once: each in its own environment
    python -m benchmarks.interop.deploy [--model embedded|qwen-1.5b] [--variants none,policy,erratum,hoist,coarsen]
                                        [--reps 2] [--max-tokens 16] [--upstream http://127.0.0.1:PORT]

The sessions (``LOGS``): the coding agent, whose system prompt carries a clock line that changes every turn, and the
support agent, whose customer profile changes tier mid-session. Each logged request is sent again with the replies
of this replay in place of the logged ones (the k-th assistant message is the answer to the k-th request), except an
assistant message a tool answered (the tool's output answers that call, so the logged call stays).

The variants (``VARIANTS``), one proxy each on 127.0.0.1 (``scripts/litellm_proxy.sh serve``), all routed to one vLLM:
``none`` is the proxy without the hook; ``policy`` the hook on the audit's policy for these sessions (``kvscope audit
LOG --policy-out``, measured on ``--model``); ``erratum``, ``hoist`` and ``coarsen`` the hook with that repair forced
on every changed field. Variants are interleaved: each repetition replays every variant in turn (the order rotated per
repetition), each replay from an emptied prefix cache (``/reset_prefix_cache``), so timings taken on a shared machine
meet the same disturbance.

Per request: the server's ``usage.prompt_tokens_details.cached_tokens`` (streamed usage, where the proxy passes it on),
the prefix-cache hits and queries vLLM's ``/metrics`` counted for it (read before and after; the hit rate is their
ratio), the time to the first streamed content token through the proxy, and the answer. Then the clean reference: the
request the agent sent (unrewritten) answered by vLLM directly from an emptied cache, greedy, with the same token
budget; an answer agrees when it has the same first ``--agree-tokens`` tokens, and the same text. The ``none``
variant's agreement is vLLM's own floor: a cached prefix against a clean prefill of the same prompt.

Writes benchmarks/interop/results/deploy-<model>-cpu.json: per variant the hit rates, TTFT p50/p90 with min/median/max
over repetitions and the ratio to ``none``, the agreement counts; every request's row; the servers' settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import ROOT, cpu_info, free_port, percentile, results_dir, spread
from benchmarks.serving.serving_servers import OpenAIServer, VllmServer, started, stopped
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLog, RequestLogError
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.audit.policy.build import forced_policy, policy_from_report
from kvscope.engine.audit.policy.document import Policy, load_policy
from kvscope.engine.audit.prompts.repair_requests import PROMPT_REPAIRS
from kvscope.engine.audit.scan.traffic_scan import scan_log
from kvscope.engine.audit.simulate.metrics import parse_prometheus

RESULTS = results_dir(__file__)
PROXY_SCRIPT = ROOT / "scripts" / "litellm_proxy.sh"
LOGS = {"coding_agent": ROOT / "demos" / "logs" / "coding_agent.jsonl", "support_agent": ROOT / "demos" / "logs" / "support_agent.jsonl"}
VARIANTS = {  # name -> what the proxy applies
    "none": "the proxy without the hook (the baseline)",
    "policy": "the hook on the audit's policy (repairs measured within the bars only)",
    "erratum": "the hook with the erratum forced: the session's first value kept in place, the update appended",
    "hoist": "the hook with hoist forced: the changing lines moved after the stable prefix",
    "coarsen": "the hook with coarsen forced: the value rounded to its grain",
}
_PROXY_STARTUP_S = 300.0


def logged_sessions() -> dict[str, list[dict]]:
    """Each bundled session's logged requests, in order (``LOGS``)."""
    return {name: [json.loads(line) for line in path.read_text().splitlines() if line.strip()] for name, path in LOGS.items()}


def fed_back(messages: Sequence[dict], replies: Sequence[str]) -> list[dict]:
    """A logged request's messages with this replay's replies in place of the logged ones: the k-th assistant message
    becomes ``replies[k]``, unless a tool message follows it (a tool call the tool answered stays as logged)."""
    out, k = [], 0
    for place, message in enumerate(messages):
        if message.get("role") == "assistant":
            answered_by_tool = place + 1 < len(messages) and messages[place + 1].get("role") == "tool"
            message = message if answered_by_tool else {**message, "content": replies[k]}
            k += 1
        out.append(dict(message))
    return out


class Proxy:
    """``scripts/litellm_proxy.sh serve`` on a free loopback port in front of ``upstream``: with the hook on
    ``policy``, or without it (``policy`` None)."""

    def __init__(self, upstream: str, model: str, policy: Path | None, folder: Path) -> None:
        self.upstream, self.model, self.policy, self.folder = upstream, model, policy, folder
        self.base_url, self.headers = "", {}
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> Proxy:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        hook = ["--policy", str(self.policy)] if self.policy else ["--no-hook"]
        command = ["bash", str(PROXY_SCRIPT), "serve", "--upstream", f"{self.upstream}/v1", "--model", self.model,
                   "--port", str(port), "--dir", str(self.folder), *hook]  # fmt: skip
        self._process = started(
            command, self.folder / "proxy.log", "LiteLLM proxy", f"{self.base_url}/health/liveliness", None, _PROXY_STARTUP_S
        )
        self.headers = {"Authorization": f"Bearer {(self.folder / 'master_key').read_text().strip()}"}
        return self

    def __exit__(self, *exc: object) -> None:
        stopped(self._process)
        self._process = None


def streamed(client: httpx.Client, base_url: str, body: dict, headers: dict[str, str]) -> dict:
    """One streamed chat completion: the seconds to the first content token and to the end, the text, the usage."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    sent, first, parts, usage = time.perf_counter(), None, [], None
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{base_url} answered {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first if first is not None else time.perf_counter() - sent
                    parts.append(content)
            usage = chunk.get("usage") or usage
    return {"ttft_s": first, "total_s": time.perf_counter() - sent, "text": "".join(parts), "usage": usage}


def cached_tokens(usage: dict | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``, or None where the answer did not carry it."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return None if value is None else int(value)


def replay(server: OpenAIServer, proxy: Proxy, sessions: dict[str, list[dict]], max_tokens: int) -> list[dict]:
    """Every session replayed through ``proxy`` from an emptied prefix cache, each reply fed back; a row per request
    with the agent's messages, the answer, its timing, its cached count and the hits and queries vLLM counted for it."""
    server.reset_cache()
    rows = []
    with httpx.Client(trust_env=False, timeout=900.0) as client:
        for name, records in sessions.items():
            replies: list[str] = []
            for turn, record in enumerate(records):
                messages = fed_back(record["messages"], replies)
                body = {"model": proxy.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                        "litellm_session_id": name, "metadata": {"session_id": name}}  # fmt: skip
                before = server.cache_counters()
                answer = streamed(client, proxy.base_url, body, proxy.headers)
                counted = server.cache_counters().since(before)
                replies.append(answer["text"])
                rows.append({"session": name, "turn": turn + 1, "messages": messages, "text": answer["text"],
                             "ttft_s": answer["ttft_s"], "total_s": answer["total_s"],
                             "prompt_tokens": (answer["usage"] or {}).get("prompt_tokens"), "cached_tokens": cached_tokens(answer["usage"]),
                             "metrics_hits": counted.hits, "metrics_queries": counted.queries})  # fmt: skip
    return rows


def clean_answer(server: OpenAIServer, messages: Sequence[dict], max_tokens: int) -> dict:
    """The request as the agent sent it, answered by vLLM directly from an emptied prefix cache (a clean prefill),
    greedy: its text, its token ids and its prompt's length."""
    server.reset_cache()
    body = {"model": server.model, "messages": list(messages), "max_tokens": max_tokens, "temperature": 0.0, "return_token_ids": True}
    with httpx.Client(trust_env=False, timeout=900.0) as client:
        response = client.post(f"{server.base_url}/v1/chat/completions", json=body)
    response.raise_for_status()
    answer = response.json()
    choice = answer["choices"][0]
    return {
        "text": choice["message"]["content"] or "",
        "token_ids": choice.get("token_ids"),
        "prompt_tokens": answer["usage"]["prompt_tokens"],
    }


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two answers share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def with_agreement(rows: list[dict], cleans: dict[str, dict], tokenizer: Any, agree_tokens: int) -> None:
    """Each row given its clean reference (``cleans``, keyed by the messages' JSON) and how far its answer agrees
    with it: the shared leading tokens (both texts tokenized alike), the same first ``agree_tokens``, the same text."""
    for row in rows:
        clean = cleans[json.dumps(row["messages"], sort_keys=True)]
        ours = tokenizer(row["text"], add_special_tokens=False).input_ids
        theirs = tokenizer(clean["text"], add_special_tokens=False).input_ids
        shared = common_prefix(ours, theirs)
        row |= {"clean_text": clean["text"], "clean_prompt_tokens": clean["prompt_tokens"], "shared_tokens": shared,
                "same_first_tokens": shared >= min(agree_tokens, len(theirs)) and len(ours) >= min(agree_tokens, len(theirs)),
                "same_text": row["text"] == clean["text"]}  # fmt: skip


def variant_summary(runs: Sequence[list[dict]], baseline_ttft: Sequence[float] | None) -> dict:
    """One variant over its repetitions: hit rates (from /metrics, and from the answers' cached counts), TTFT p50/p90
    as min/median/max over repetitions (and the median's ratio to the baseline's), agreement counts."""
    rows = [row for run in runs for row in run]
    hits, queries = sum(r["metrics_hits"] for r in rows), sum(r["metrics_queries"] for r in rows)
    reported = [r for r in rows if r["cached_tokens"] is not None and r["prompt_tokens"]]
    p50s = [percentile([r["ttft_s"] for r in run], 50) for run in runs]
    p90s = [percentile([r["ttft_s"] for r in run], 90) for run in runs]
    summary = {
        "requests": len(rows),
        "repetitions": len(runs),
        "hit_rate_metrics": round(hits / queries, 4) if queries else None,
        "hit_rate_usage": round(sum(r["cached_tokens"] for r in reported) / sum(r["prompt_tokens"] for r in reported), 4)
        if reported
        else None,
        "usage_reported": len(reported),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in reported),
        "metrics_hits": hits,
        "metrics_queries": queries,
        "ttft_p50_s": spread(p50s, runs=True),
        "ttft_p90_s": spread(p90s, runs=True),
        "same_first_tokens": sum(r["same_first_tokens"] for r in rows),
        "same_text": sum(r["same_text"] for r in rows),
        "mean_shared_tokens": round(statistics.mean(r["shared_tokens"] for r in rows), 2),
    }
    if baseline_ttft:
        summary["ttft_p50_ratio_to_none"] = round(statistics.median(p50s) / statistics.median(baseline_ttft), 4)
    return summary


def sessions_log(sessions: dict[str, list[dict]]) -> RequestLog:
    """The logged sessions as one request log, each record keyed by its session (``session_id``), as the proxy's
    requests are keyed here."""
    return read_log("\n".join(json.dumps(record | {"session_id": name}) for name, records in sessions.items() for record in records))


def audited_policy(model: str, log: RequestLog, grain: str, sample: int) -> Policy:
    """The policy of the log's measured audit on ``model`` (what ``kvscope audit LOG --policy-out`` writes), with
    ``sample`` turns measured per group and the prompt-level repairs only (the ones a gateway applies; a KV-level one
    would only be named in the policy)."""
    from kvscope.engine.models import load_model

    lm = load_model(model, device="cpu", dtype="auto", progress=print)
    measure = measure_settings(repairs=PROMPT_REPAIRS, grain=grain)
    report = audit_traffic(lm, log, sample=sample, measure=measure).measured_report()
    return policy_from_report(report, "demos/logs/coding_agent.jsonl demos/logs/support_agent.jsonl")


def policy_files(
    variants: Sequence[str], model: str, grain: str, tokenizer: Any, folder: Path, audited: Path | None = None, sample: int = 3
) -> tuple[dict[str, Path | None], dict[str, str]]:
    """The policy file each variant's proxy loads (None: no hook), written into ``folder``, and the variants that
    cannot run, with why: ``policy`` from the measured audit (``audited``: one ``--policy-out`` already wrote), each
    forced repair on the fields the token pass found."""
    log = sessions_log(logged_sessions())
    files: dict[str, Path | None] = {}
    not_run: dict[str, str] = {}
    for name in variants:
        if name == "none":
            files[name] = None
            continue
        try:
            if name == "policy":
                policy = load_policy(audited.read_text(encoding="utf-8")) if audited else audited_policy(model, log, grain, sample)
            else:
                policy = forced_policy(scan_log(tokenizer, log), name, grain if name == "coarsen" else None, model)
        except RequestLogError as error:
            not_run[name] = str(error)
            continue
        files[name] = folder / f"{name}.policy.json"
        files[name].write_text(policy.text(), encoding="utf-8")
    return files, not_run


def block_size(server: OpenAIServer) -> int | None:
    """The block size vLLM reports on ``/metrics`` (``vllm:cache_config_info``), or None."""
    text = server.metrics() or ""
    info = [sample for sample in parse_prometheus(text) if sample.name == "vllm:cache_config_info"]
    value = info[0].labels.get("block_size") if info else None
    return int(value) if value else None


@contextmanager
def vllm_server(args: argparse.Namespace, model_dir: Path, served: str) -> Iterator[OpenAIServer]:
    """The vLLM to measure: one already running (``--upstream``, started with VLLM_SERVER_DEV_MODE=1), else vLLM's CPU
    build started here (``scripts/vllm_cpu.sh``) at block ``--block``."""
    if args.upstream:
        yield OpenAIServer("vllm", args.upstream, served)
        return
    with VllmServer(model_dir, RESULTS / f"deploy-{args.model}-vllm.log", block=args.block, name=served) as server:
        yield server


def interleaved(
    server: OpenAIServer, proxies: dict[str, Proxy], sessions: dict[str, list[dict]], reps: int, max_tokens: int
) -> dict[str, list]:
    """Every variant replayed ``reps`` times, interleaved: repetition r replays the variants in turn, rotated by r."""
    names = list(proxies)
    runs: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            started_at = time.monotonic()
            runs[name].append(replay(server, proxies[name], sessions, max_tokens))
            print(f"rep {rep + 1} {name}: {time.monotonic() - started_at:.0f} s", flush=True)
    return runs


def clean_references(server: OpenAIServer, runs: dict[str, list], max_tokens: int) -> dict[str, dict]:
    """The clean answer of every distinct request the agent sent in any replay (keyed by its messages' JSON)."""
    cleans: dict[str, dict] = {}
    for variant_runs in runs.values():
        for row in (row for run in variant_runs for row in run):
            key = json.dumps(row["messages"], sort_keys=True)
            if key not in cleans:
                cleans[key] = clean_answer(server, row["messages"], max_tokens)
    return cleans


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="embedded or qwen-1.5b (their converted safetensors copies)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="each answer's token budget (replies are fed back cut)")
    parser.add_argument("--agree-tokens", type=int, default=8, help="an answer agrees when its first N tokens equal the clean one's")
    parser.add_argument("--policy", type=Path, default=None, help="the audit's policy (kvscope audit --policy-out); default: audited here")
    parser.add_argument("--sample", type=int, default=3, help="turns the audit measures per group for the policy (kvscope audit --sample)")
    parser.add_argument("--grain", default="hour", help="coarsen's grain (date, hour or minute)")
    parser.add_argument("--block", type=int, default=32, help="vLLM's block size (a multiple of 32 on CPU)")
    parser.add_argument("--upstream", default="", help="an already-running vLLM (VLLM_SERVER_DEV_MODE=1) instead of starting one")
    parser.add_argument("--out", type=Path, default=None, help="default: results/deploy-<model>-cpu.json")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from kvscope.engine.models.gguf import converted_alias

    args = _parser().parse_args(argv)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; use {', '.join(VARIANTS)}")
    model_dir, _, _ = converted_alias(args.model, print)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sessions = logged_sessions()
    with tempfile.TemporaryDirectory(prefix="kvscope-deploy-") as tmp, ExitStack() as stack:
        folder = Path(tmp)
        server = stack.enter_context(vllm_server(args, model_dir, args.model))
        policies, not_run = policy_files(variants, args.model, args.grain, tokenizer, folder, args.policy, args.sample)
        not_run |= {name: "not in --variants" for name in VARIANTS if name not in variants}
        proxies = {
            name: stack.enter_context(Proxy(server.base_url, server.model, policy, folder / name)) for name, policy in policies.items()
        }
        runs = interleaved(server, proxies, sessions, args.reps, args.max_tokens)
        cleans = clean_references(server, runs, args.max_tokens)
        settings = server.settings() | {"started_here": not args.upstream, "block_size_metrics": block_size(server)}
        policy_texts = {name: json.loads(path.read_text()) for name, path in policies.items() if path}
    for variant_runs in runs.values():
        for run in variant_runs:
            with_agreement(run, cleans, tokenizer, args.agree_tokens)
    baseline = [percentile([r["ttft_s"] for r in run], 50) for run in runs.get("none", [])]
    summaries = {name: variant_summary(variant_runs, baseline) for name, variant_runs in runs.items()}
    for name, summary in summaries.items():
        n = summary["requests"]
        print(f"{name:8s} hit rate {summary['hit_rate_metrics']}  TTFT p50 {summary['ttft_p50_s']['median']} s "
              f"(x{summary.get('ttft_p50_ratio_to_none', 1)})  same first {args.agree_tokens} tokens "
              f"{summary['same_first_tokens']}/{n}, same text {summary['same_text']}/{n}", flush=True)  # fmt: skip
    out = {
        "benchmark": "deploy",
        "model": args.model,
        "cpu": cpu_info(),
        "load_average": list(os.getloadavg()),
        "server": settings,
        "proxy": "litellm[proxy] (scripts/litellm_proxy.sh)",
        "sessions": {name: len(records) for name, records in sessions.items()},
        "reps": args.reps,
        "max_tokens": args.max_tokens,
        "grain": args.grain,
        "agree_tokens": args.agree_tokens,
        "variants": {name: {"what": VARIANTS[name], **summaries[name]} for name in runs},
        "not_run": not_run,
        "policies": policy_texts,
        "runs": {
            name: [[{k: v for k, v in row.items() if k != "messages"} for row in run] for run in variant_runs]
            for name, variant_runs in runs.items()
        },
    }
    path = args.out or RESULTS / f"deploy-{args.model}-cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
