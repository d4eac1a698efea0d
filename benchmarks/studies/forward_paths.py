"""Two fast paths of a forward, each side by side with the path it replaces, per dtype, on one model.

    python -m benchmarks.studies.forward_paths [--dtypes bfloat16,float32] [--chunk 1024] [--stored 42] [--reps 5]
                                               [--model embedded]

- ``output_rows``: the output projection on the last row of a ``chunk``-token forward's hidden states, as a forward
  that keeps its last logits (``logits_to_keep``) hands it: the slice as is, against the same row viewed afresh (what
  ``keep_output_rows_dense`` gives the projection of every loaded model).
- ``causal_prefill``: one engine forward of ``chunk`` new tokens over ``stored`` cached ones (the audit's first chunk
  of a request after its shared head), masked (an empty knockout keeps the mask) against the padded causal SDPA the
  engine takes for a plain prefill.

Each pair is timed in alternation (min / median / max in ms) and compared bit for bit (``same``). ``speedup`` is the
replaced path's median over the fast one's. The load average before and after is kept: compare the ratio, not the ms.
Writes results/forward_paths-<model>-<device>.json.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import common
from kvscope.engine.cache import adapter
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.models import load_model
from kvscope.engine.timing import side_by_side


def _output_rows(lm: LoadedModel, chunk: int, reps: int) -> dict:
    projection = lm.model.get_output_embeddings()
    hidden = torch.randn(1, chunk, projection.in_features, dtype=lm.dtype, generator=torch.Generator().manual_seed(0))
    last = hidden[:, -1:, :]  # what ``logits_to_keep=1`` hands the projection
    with torch.inference_mode():
        results, spreads = side_by_side(
            {"slice": lambda: F.linear(last, projection.weight, projection.bias), "fresh_view": lambda: projection(last)}, reps
        )
    return _pair(results, spreads, "slice", "fresh_view")


def _causal_prefill(lm: LoadedModel, chunk: int, stored: int, reps: int) -> dict:
    text = lm.model.config.get_text_config()
    ids = torch.randint(10, text.vocab_size - 10, (stored + chunk,), generator=torch.Generator().manual_seed(0))
    layers = text.num_hidden_layers
    with torch.inference_mode():
        head = adapter.forward(
            lm.model, [], [], torch.arange(0), ids[:stored], torch.arange(stored), torch.ones(stored, stored, dtype=torch.bool).tril()
        )
        allowed = torch.ones(chunk, stored + chunk, dtype=torch.bool).tril(stored)
        nothing = {layer: torch.zeros(1, chunk, stored + chunk, dtype=torch.bool) for layer in range(layers)}

        def run(blocked):
            result = adapter.forward(
                lm.model, head.new_keys, head.new_values, torch.arange(stored), ids[stored:],
                torch.arange(stored, stored + chunk), allowed, blocked=blocked, logit_rows=torch.tensor([chunk - 1]),
            )  # fmt: skip
            return torch.cat([result.logits.flatten(), *(keys.flatten().float() for keys in result.new_keys)])

        results, spreads = side_by_side({"masked": lambda: run(nothing), "padded_causal": lambda: run(None)}, reps)
    return _pair(results, spreads, "masked", "padded_causal")


def _pair(results: dict, spreads: dict, replaced: str, fast: str) -> dict:
    return {
        **{name: spread.as_dict() for name, spread in spreads.items()},
        "speedup": round(spreads[replaced].median / spreads[fast].median, 2),
        "same": bool(torch.equal(results[replaced], results[fast])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated dtypes, each measured on its own load")
    parser.add_argument("--chunk", type=int, default=1024, help="new tokens of the forward (the engine's chunk)")
    parser.add_argument("--stored", type=int, default=42, help="cached tokens it follows (fewer than --chunk)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(common.results_dir(__file__)), help="folder for the JSON")
    args = parser.parse_args(argv)
    load_before, rows, lm = os.getloadavg()[0], {}, None
    for dtype in args.dtypes.split(","):
        lm = load_model(args.model, device=args.device, dtype=dtype, progress=print)
        rows[dtype] = {
            "output_rows": _output_rows(lm, args.chunk, args.reps),
            "causal_prefill": _causal_prefill(lm, args.chunk, args.stored, args.reps),
        }
        for name, row in rows[dtype].items():
            print(f"{dtype:>9} {name:>15}: ×{row['speedup']} (same numbers: {row['same']})")
    data = {"chunk": args.chunk, "stored": args.stored, "load_before": load_before, "load_after": os.getloadavg()[0], "dtypes": rows}
    print(f"wrote {common.write_result('forward_paths', lm, data, Path(args.out))}")


if __name__ == "__main__":
    main()
