"""The audit's model pass measured both ways on the same weights: in torch (the embedded model, dequantized from its
GGUF) and through an OpenAI-compatible endpoint (llama-server serving that GGUF), per bundled log.

    bash scripts/build_llama_server.sh      # once: llama-server built from the pinned llama.cpp source
    python -m benchmarks.interop.audit_endpoint [--logs coding_agent,support_agent,rag,traffic/interleaved_agents]
                                        [--sample 1] [--tokens 16] [--grain date] [--dtype float32] [--threads 2]

Per log: the token pass, then the sampled turns (``--sample`` per change signature) measured with every prompt-level
repair in torch (``traffic.audit_traffic``) and on the endpoint (``model_pass.audit_on_endpoint``, token ids
sent, top 20 log-probs), each timed. Beside them:

- **quantization noise**: on every reference prompt, the largest |log-prob difference| between the server and torch
  over the server's top-20 tokens of the first position (its median too);
- **verdict agreement**: per (turn, repair), the top-1 verdict (the first token kept) and the greedy verdict (all
  ``--tokens`` greedy tokens the same) from both sides; a verdict is *decidable* when torch's top-2 log-prob gap
  exceeds twice the noise at every position it rests on (the first position of both prompts for top-1; every greedy
  step of both generations for the greedy verdict), since each of the two log-probs can move by the noise; both sides
  must agree on every decidable one. Short of that, the greedy tokens both paths fix (the leading steps whose gap
  exceeds twice the noise) must agree as far as they go (``common_prefix_within_decided_tokens``);
- **the KL estimate**: the endpoint's KL̂ (top 20, the tail as one bucket) against the exact KL between the server's
  own two full distributions (asked for with ``logprobs`` = the vocabulary), which must lie in [KL̂, KL̂ + kl_bound]
  (up to the server's rounding: its full distributions sum to 1 within ``rounding``); and against torch's KL.

Writes benchmarks/interop/results/audit_endpoint-<model>-<device>.json with the CPU, the load average and the times.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.common import cpu_info
from benchmarks.serving.serving_servers import SERVER_BINARY, LlamaServer, resolve_gguf
from kvscope.engine.audit.endpoint.answers import Probe
from kvscope.engine.audit.endpoint.client import COMPLETIONS, EndpointClient, EndpointSettings
from kvscope.engine.audit.endpoint.served_measure import EndpointAudit, audit_on_endpoint
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.requests import RequestLog
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import TrafficReport, audit_traffic
from kvscope.engine.audit.prompts.repair_requests import GRAINS, PROMPT_REPAIRS, Level
from kvscope.engine.audit.simulate.caches import CacheSettings
from kvscope.engine.cache.decision import kl_divergence
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.models import LoadedModel
from kvscope.engine.scenario import DEMOS
from kvscope.engine.timing import Stopwatch

LOGS = DEMOS / "logs"
DEFAULT_LOGS = "coding_agent,support_agent,rag,traffic/interleaved_agents"
TOP_K = 20


@dataclass(frozen=True)
class Greedy:
    """A prompt's clean prefill in torch: the first position's log-probs, the greedy tokens, and the top-2 log-prob gap
    at every greedy step."""

    logprobs: torch.Tensor
    generated: tuple[int, ...]
    gaps: tuple[float, ...]


def torch_greedy(lm: LoadedModel, ids: Sequence[int], tokens: int) -> Greedy:
    """Greedy decoding of ``tokens`` tokens with each step's top-2 gap (stopping at a stop token, as the audit does)."""
    state = Notebook.empty(lm).append(list(ids[:-1]), "request") if len(ids) > 1 else Notebook.empty(lm)
    state, logits = state.step([ids[-1]], "request")
    first, generated, gaps = torch.log_softmax(logits.float(), -1), [], []
    for _ in range(tokens):
        logprobs = torch.log_softmax(logits.float(), -1)
        top = logprobs.topk(2).values.tolist()
        gaps.append(top[0] - top[1])
        token = int(logprobs.argmax())
        if token in lm.stop_ids:
            break
        generated.append(token)
        if len(generated) == tokens:
            break
        state, logits = state.step([token], "generated")
    return Greedy(first, tuple(generated), tuple(gaps))


def full_distributions(client: EndpointClient, lm: LoadedModel, prompts: dict[tuple, tuple[int, ...]]) -> dict[tuple, dict]:
    """The server's whole next-token distribution (``logprobs`` = the vocabulary, one token) of each prompt, each turn's
    prompts on the slot its audit used (lanes as ``audit_on_endpoint`` names them), so a prompt still there is reused."""
    vocab = int(lm.model.config.vocab_size)
    full = EndpointClient(EndpointSettings(client.settings.url, client.settings.model, top_k=vocab, concurrency=1, timeout_s=600.0))
    keys = list(prompts)[::-1]  # each turn's last prompt first: it is still in its slot
    keys.sort(key=lambda key: key[0])  # turns in the audit's order, so each lane gets the slot it had there
    probes = [
        Probe(COMPLETIONS, {"prompt": list(prompts[key]), "max_tokens": 1, "temperature": 0.0, "logprobs": vocab}, f"turn-{key[0]}")
        for key in keys
    ]
    return {key: answer.top for key, answer in zip(keys, full.answer(probes))}


def compare_log(lm: LoadedModel, client: EndpointClient, log: RequestLog, sample: int, tokens: int, grain: str) -> dict:
    """One log audited both ways: times, noise, verdicts and the KL estimate's error (the module's docstring)."""
    watch = Stopwatch()
    local: TrafficReport = audit_traffic(
        lm, log, sample=sample, measure=measure_settings(repairs=PROMPT_REPAIRS, tokens=tokens, grain=grain)
    )
    torch_s = watch.ms / 1000
    watch = Stopwatch()
    remote: EndpointAudit = audit_on_endpoint(
        client,
        local.scan,
        local.groups,
        tokenizer=lm.tokenizer,
        measure=local.measure,
        model=lm.name,
    )
    endpoint_s = watch.ms / 1000
    prompts: dict[tuple, tuple[int, ...]] = {}
    pairs = []
    for turn in remote.turns:
        mine = local.turns[turn.request]
        prompts[(turn.request, "reference")] = local.scan.rendered[turn.request].ids
        for name, measured in turn.repairs.items():
            result = mine.repairs[name]
            if not measured.applicable or not result.applicable or result.level is not Level.PROMPT:
                continue
            prompts[(turn.request, name)] = tuple(result.prompt_ids)
            pairs.append((turn, name, measured, result))
    greedy = {key: torch_greedy(lm, ids, tokens) for key, ids in prompts.items()}
    full = full_distributions(client, lm, prompts)
    noise = []
    for turn in remote.turns:
        reference = greedy[(turn.request, "reference")].logprobs
        noise += [abs(value - float(reference[token])) for token, value in turn.reference.top.items()]
    most_noise = max(noise, default=0.0)
    rounding = max((abs(sum(math.exp(v) for v in top.values()) - 1) for top in full.values()), default=0.0)
    rows = []
    for turn, name, measured, result in pairs:
        ref, rep = greedy[(turn.request, "reference")], greedy[(turn.request, name)]
        first_gap = min(ref.gaps[0], rep.gaps[0])
        path_gap = min(ref.gaps + rep.gaps)
        decided = min(_decided(ref.gaps, most_noise), _decided(rep.gaps, most_noise))  # leading tokens both paths fix
        exact = _full_kl(full[(turn.request, "reference")], full[(turn.request, name)])
        f, t = measured.fidelity, result.fidelity
        rows.append(
            {
                "request": turn.request,
                "repair": name,
                "torch_top1_agree": t.top1_agree,
                "endpoint_top1_agree": f.top1_agree,
                "torch_unchanged": t.generation_agreement == 1.0,
                "endpoint_unchanged": f.generation_agreement == 1.0,
                "torch_generation_agreement": round(t.generation_agreement, 4),
                "endpoint_generation_agreement": round(f.generation_agreement, 4),
                "first_gap": round(first_gap, 4),
                "path_gap": round(path_gap, 4),
                "decided_tokens": decided,
                "prefix_agrees_where_decided": min(t.generated_common_prefix, decided) == min(f.generated_common_prefix, decided),
                "top1_decidable": first_gap > 2 * most_noise,
                "greedy_decidable": path_gap > 2 * most_noise,
                "endpoint_kl": round(f.kl, 6),
                "kl_bound": round(measured.kl_bound, 6),
                "tail_mass": round(measured.tail_mass, 6),
                "server_exact_kl": round(exact, 6),
                "torch_kl": round(t.kl, 6),
                "kl_within_bound": f.kl - rounding <= exact <= f.kl + measured.kl_bound + rounding,
            }
        )
    return {
        "requests": len(log.requests),
        "measured_turns": len(remote.turns),
        "compared": len(rows),
        "torch_s": round(torch_s, 2),
        "endpoint_s": round(endpoint_s, 2),
        "endpoint_requests_sent": client.sent,
        "noise": {"max_abs_logprob_difference": round(most_noise, 4), "median": round(statistics.median(noise), 4) if noise else None},
        "rounding": round(rounding, 6),
        "verdicts": _verdicts(rows),
        "kl": {
            "within_bound": sum(row["kl_within_bound"] for row in rows),
            "of": len(rows),
            "max_error_vs_server_exact": max((round(row["server_exact_kl"] - row["endpoint_kl"], 6) for row in rows), default=None),
            "max_abs_error_vs_torch": max((round(abs(row["torch_kl"] - row["endpoint_kl"]), 6) for row in rows), default=None),
        },
        "rows": rows,
    }


def _decided(gaps: Sequence[float], noise: float) -> int:
    """The leading greedy steps whose top-2 gap exceeds twice the noise: tokens the server must pick as torch does."""
    return next((i for i, gap in enumerate(gaps) if gap <= 2 * noise), len(gaps))


def _full_kl(reference: dict, other: dict) -> float:
    """KL between two whole distributions as the server listed them, each renormalized over its vocabulary."""
    tokens = sorted(reference)
    p = torch.log_softmax(torch.tensor([reference[t] for t in tokens], dtype=torch.float64), -1)
    q = torch.log_softmax(torch.tensor([other[t] for t in tokens], dtype=torch.float64), -1)
    return kl_divergence(p, q)


def _verdicts(rows: Sequence[dict]) -> dict:
    """Per verdict: how many were decidable, and on how many of those (and of all) both sides agree."""
    out = {}
    for verdict, decidable in (("top1_agree", "top1_decidable"), ("unchanged", "greedy_decidable")):
        same = [row[f"torch_{verdict}"] == row[f"endpoint_{verdict}"] for row in rows]
        chosen = [s for s, row in zip(same, rows) if row[decidable]]
        out[verdict] = {"decidable": len(chosen), "agree_where_decidable": sum(chosen), "agree_overall": sum(same), "of": len(rows)}
    out["common_prefix_within_decided_tokens"] = {
        "agree": sum(row["prefix_agrees_where_decided"] for row in rows),
        "of": len(rows),
        "decided_tokens": sum(row["decided_tokens"] for row in rows),
    }
    return out


def run(lm: LoadedModel, names: Sequence[str], args, gguf: Path, model: str) -> list[dict]:
    results = []
    for name in names:
        log = read_log((Path(args.log_dir) / f"{name}.jsonl").read_text(encoding="utf-8"))
        server_log = Path(tempfile.gettempdir()) / f"kvscope-audit_endpoint-{name.replace('/', '-')}.log"
        load_before = os.getloadavg()
        with LlamaServer(Path(args.server), gguf, 4 * 2048, args.threads, server_log, model, slots=4) as server:
            client = EndpointClient(EndpointSettings(server.base_url, model, top_k=TOP_K, concurrency=1, timeout_s=600.0))
            row = {"log": name, **compare_log(lm, client, log, args.sample, args.tokens, args.grain)}
            row["llama_server"] = server.settings()
        row["load_average_before"] = [round(x, 2) for x in load_before]
        row["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        verdicts = row["verdicts"]
        print(
            f"{name}: torch {row['torch_s']} s, endpoint {row['endpoint_s']} s; noise {row['noise']['max_abs_logprob_difference']}; "
            f"top-1 {verdicts['top1_agree']['agree_where_decidable']}/{verdicts['top1_agree']['decidable']} decidable agree, "
            f"greedy {verdicts['unchanged']['agree_where_decidable']}/{verdicts['unchanged']['decidable']}; "
            f"KL within bound {row['kl']['within_bound']}/{row['kl']['of']}",
            flush=True,
        )
        results.append(row)
    return results


def _parser():
    parser = common.parser(__doc__)
    parser.add_argument("--logs", default=DEFAULT_LOGS, help="comma-separated stems of demos/logs/**/*.jsonl")
    parser.add_argument("--log-dir", default=str(LOGS))
    parser.add_argument("--sample", type=int, default=1, help="turns measured per change signature")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per prompt")
    parser.add_argument("--grain", default="date", choices=GRAINS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gguf", default="embedded", help="llama-server's model: 'embedded', 'smollm2' or a .gguf path")
    parser.add_argument("--server", default=str(SERVER_BINARY))
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    lm = common.load(args)
    gguf, model = resolve_gguf(args.gguf)
    logs: list[dict] = []
    for name in [name.strip() for name in args.logs.split(",") if name.strip()]:  # written after each log: a long run keeps its part
        logs += run(lm, [name], args, gguf, model)
        data = {
            "gguf": gguf.name,
            "cpu": cpu_info(),
            "sample": args.sample,
            "generated_tokens": args.tokens,
            "top_k": TOP_K,
            "grain": args.grain,
            "cache_settings": CacheSettings().as_dict(),
            "decidable_rule": "torch's top-2 log-prob gap > 2 x the noise at every position the verdict rests on",
            "logs": logs,
        }
        path = common.write_result("audit_endpoint", lm, data, Path(args.out))
    print("→", path)
    return data


if __name__ == "__main__":
    main()
