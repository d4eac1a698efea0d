"""Greedy decoding with prompt lookup against a token a forward, side by side on the prompts of the bundled logs.

    python -m benchmarks.studies.greedy_lookup [--logs coding_agent,support_agent,rag] [--tokens 32] [--reps 3]
                                               [--model embedded] [--dtype auto]

Every request of each log is rendered as the audit renders it and prefilled once; then, per repetition, its greedy
tokens are generated twice from that state, one run after the other: a token a forward (``lookup=0``), and with the
guesses prompt lookup takes from the context (``LOOKUP_TOKENS``, kvscope.engine.cache.generation.greedy). Kept per log:
the seconds of each (min / median / max over repetitions, summed over the log's prompts), the forwards, the tokens
each forward ran, ``speedup`` (a token a forward's time over lookup's) and ``same_tokens`` (whether both gave the same
greedy tokens on every prompt). The load average before and after is kept: compare the ratio, not the seconds.
Where the tokens part, ``differing`` says at which token and the margin between the two top logits there. Writes
results/greedy_lookup-<model>-cpu.json.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import common
from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.logs.render import render_request
from kvscope.engine.cache.generation import LOOKUP_TOKENS
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.scenario import DEMOS


def _parser():
    parser = common.parser(__doc__)
    parser.add_argument("--logs", default=common.BUNDLED_LOGS, help="comma-separated stems of demos/logs/*.jsonl")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (the audit's default)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each timed decode")
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    return parser


def _decode(state: Notebook, logits, tokens: int, stops: Sequence[int], lookup: int) -> tuple[float, list[int], list[int]]:
    """One greedy run: its seconds, its tokens and each forward's new tokens."""
    forwards: list[int] = []
    started = time.perf_counter()
    _, generated = state.greedy(logits, tokens, stops, lookup=lookup, on_forward=forwards.append)
    return time.perf_counter() - started, generated, forwards


def _parting(state: Notebook, logits, request: int, plain: list[int], looked: list[int]) -> dict:
    """Where two greedy runs part: the token, and the margin between the top two logits a token a forward read there
    (0: a tie, which the last bits of a forward of another extent decide)."""
    at = next((i for i, (a, b) in enumerate(zip(plain, looked)) if a != b), min(len(plain), len(looked)))
    there = state.step(plain[:at], "generated")[1] if at else logits
    top = there.float().topk(2).values
    return {"request": request, "token": at, "margin": round(float(top[0] - top[1]), 6)}


def measure_log(lm: LoadedModel, name: str, tokens: int, reps: int) -> dict:
    """Both decodings of every request of one bundled log (see the module docstring)."""
    log = read_log((DEMOS / "logs" / f"{name}.jsonl").read_text(encoding="utf-8"))
    plain_s, lookup_s = [0.0] * reps, [0.0] * reps
    plain_forwards, lookup_forwards, lookup_widths, generated, differing = 0, 0, [], 0, []
    for request in log.requests:
        state, logits = Notebook.empty(lm).step(render_request(lm, request).ids, "request")
        for rep in range(reps):
            seconds, plain, forwards = _decode(state, logits, tokens, lm.stop_ids, 0)
            plain_s[rep] += seconds
            looked_s, looked, widths = _decode(state, logits, tokens, lm.stop_ids, LOOKUP_TOKENS)
            lookup_s[rep] += looked_s
        if looked != plain:
            differing.append(_parting(state, logits, request.index, plain, looked))
        plain_forwards, lookup_forwards = plain_forwards + len(forwards), lookup_forwards + len(widths)
        lookup_widths += widths
        generated += len(plain)
    return {
        "log": name,
        "prompts": len(log.requests),
        "generated_tokens": generated,
        "same_tokens": not differing,
        "differing": differing,
        "plain_s": common.spread(plain_s),
        "lookup_s": common.spread(lookup_s),
        "speedup": common.spread([p / q for p, q in zip(plain_s, lookup_s)]),
        "plain_forwards": plain_forwards,
        "lookup_forwards": lookup_forwards,
        "lookup_tokens_per_forward": round(sum(lookup_widths) / max(len(lookup_widths), 1), 2),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    lm = common.load(args)
    before = list(os.getloadavg())
    logs = [measure_log(lm, name, args.tokens, args.reps) for name in args.logs.split(",")]
    for row in logs:
        print(
            f"{row['log']}: {row['plain_forwards']} -> {row['lookup_forwards']} forwards, "
            f"×{row['speedup']['median']} (min {row['speedup']['min']}, max {row['speedup']['max']}), same tokens: {row['same_tokens']}"
        )
    data = {
        "cpu": common.cpu_info(),
        "tokens": args.tokens,
        "reps": args.reps,
        "lookup_tokens": LOOKUP_TOKENS,
        "load_average": {"before": before, "after": list(os.getloadavg())},
        "logs": logs,
    }
    print(common.write_result("greedy_lookup", lm, data, Path(args.out)))
    return data


if __name__ == "__main__":
    main()
