"""A picture's K/V spliced behind text vs a full recompute from pixels: fidelity and time to first token.

    python -m benchmarks.studies.image_splice [--model tiny-qwen2_vl] [--shifts 0,40,161] [--seams 0,2] [--reps 5]

For each shift (tokens of neutral text before the picture: the block moves that far) and seam, one run of
:func:`kvscope.engine.compose.pictures.compare_image` with ``--reps`` timed repetitions of each side, measured side by side:
logit cosine, KL, top-1 and the decision against the recompute, and the TTFT ratio (recompute, which runs the vision
tower, over splice) with min/median/max over the timed repetitions. The paper (Qwen-VL): cosine 0.99 for a picture
moved 161 positions, TTFT 2.4–8.4× shorter. Writes benchmarks/studies/results/image-splice-<model>-<device>.json.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from benchmarks import common
from benchmarks.common import filler_text, results_dir, write_result
from kvscope.engine.compose.pictures import bundled_images, compare_image, load_picture
from kvscope.engine.timing import Stopwatch


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__)
    parser.set_defaults(model="tiny-qwen2_vl")
    parser.add_argument("--image", default="shipping_label", help=f"image file, or a bundled one: {', '.join(bundled_images())}")
    parser.add_argument("--shifts", default="0,40,161", help="tokens of text before the picture")
    parser.add_argument("--seams", default="0,2")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per side (after one warm-up)")
    parser.add_argument("--out", default=str(results_dir(__file__)), help="folder for the JSON")
    args = parser.parse_args(argv)
    lm = common.load(args)
    pixels = load_picture(bundled_images().get(args.image, args.image))
    rows = []
    for shift in tqdm([int(s) for s in args.shifts.split(",")], desc="shifts"):
        before = filler_text(lm, shift) if shift else ""
        for seam in (int(s) for s in args.seams.split(",")):
            ratios, result = [], None
            watch = Stopwatch()
            for _ in range(args.reps + 1):  # the first run warms up
                result = compare_image(lm, pixels, args.image, before=before, seam=seam)
                ratios.append(result.ttft_ms["full"] / result.ttft_ms["splice"])
            data = result.as_dict()
            ratios = ratios[1:]
            rows.append(
                {
                    "shift": data["shift"],
                    "seam": seam,
                    "image_tokens": data["image_tokens"],
                    "rope_span": data["rope_span"],
                    **{k: data[k] for k in ("cosine", "kl", "top1_agree", "decision_agree", "margin_error")},
                    "speedup": common.spread(ratios, digits=2),
                    "wall_s": round(watch.ms / 1000, 1),
                }
            )
            print(rows[-1])
    data = {"image": args.image, "reps": args.reps, "paper": {"cosine_shift_161": 0.99, "ttft_speedup": [2.4, 8.4]}, "rows": rows}
    print(f"wrote {write_result('image-splice', lm, data, Path(args.out))}")
    return data


if __name__ == "__main__":
    main()
