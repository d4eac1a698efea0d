"""A picture's K/V composed into a context: computed once, moved and spliced, against a full recompute from pixels.

The paper's vision result (Qwen2-VL: an image block moved by 161 positions keeps logit cosine 0.99; image time to
first token 2.4–8.4× shorter) as one comparison on the loaded model. The block is the picture's tokens prefilled
once after the chat template's head (:mod:`kvscope.engine.cache.vision`), then spliced after the user's text ``before`` — its keys
re-rotated on all three M-RoPE axes by the text's length — with its first ``seam`` tokens recomputed, followed by
``after`` and the question. The full recompute runs the vision tower and prefills everything, as a server without
image K/V reuse does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from kvscope.engine.cache.decision import Decision, DecisionMatch, logit_agreement
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook, NotebookError
from kvscope.engine.cache.vision import ImageError, encode_image
from kvscope.engine.compose.placing import literal
from kvscope.engine.jsonable import attributes
from kvscope.engine.scenario import DEMOS, Scenario, render
from kvscope.engine.timing import Stopwatch, side_by_side

IMAGE_QUESTION = "Answer yes or no. Has the order in the picture shipped?"
YES_NO: dict[str, tuple[str, ...]] = {"yes": ("yes", "Yes"), "no": ("no", "No")}


def bundled_images() -> dict[str, Path]:
    """The demo pictures shipped in demos/images, by file stem."""
    folder = DEMOS / "images"
    return {path.stem: path for path in sorted(folder.glob("*.png"))}


def load_picture(path: str | Path) -> np.ndarray:
    """An image file as an RGB array (refusing what PIL cannot read, by path)."""
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError) as error:
        raise ImageError(f"cannot read image {str(path)!r}: {error}") from error


@dataclass
class ImageFidelity:
    """Spliced picture vs full recompute: next-token logits, the decision, and time to first token."""

    image: str
    image_tokens: int
    rope_span: int  # rope positions the picture covers (fewer than its tokens: rows and columns share them)
    shift: int  # positions the block moved from where it was compiled
    seam: int
    context_tokens: int
    agreement: dict[str, float]
    match: DecisionMatch
    spliced: Decision
    recomputed: Decision
    ttft_ms: dict[str, float]  # splice: the stored block; full: vision tower + prefill
    compile_ms: float

    def as_dict(self) -> dict:
        return {
            **attributes(self, "image", "image_tokens", "rope_span", "shift", "seam", "context_tokens"),
            **{key: round(value, 6) for key, value in self.agreement.items()},
            **self.match.as_dict(),
            **attributes(self, "spliced", "recomputed"),
            "ttft_ms": {key: round(value, 1) for key, value in self.ttft_ms.items()},
            "speedup": round(self.ttft_ms["full"] / self.ttft_ms["splice"], 2),
            "compile_ms": round(self.compile_ms, 1),
        }


def compare_image(
    lm: LoadedModel,
    pixels: np.ndarray,
    name: str,
    *,
    before: str = "",
    after: str = "",
    question: str = IMAGE_QUESTION,
    answers: Mapping[str, Sequence[str]] = YES_NO,
    seam: int = 0,
    reps: int = 1,
    warmup: int = 0,
) -> ImageFidelity:
    """Splice the picture's stored block after ``before`` vs recompute everything from pixels (module docstring), timed
    side by side: ``warmup`` untimed rounds, then ``reps`` timed rounds alternating both sides."""
    lm.splice_gate.require(lm)  # the self-test runs once, before anything is timed
    watch = Stopwatch()
    image = encode_image(lm, pixels, name)
    if not 0 <= seam <= len(image.token_ids):
        raise NotebookError(f"seam {seam} must be between 0 and the picture's {len(image.token_ids)} tokens")
    segment = f"image:{name}"
    scenario = Scenario(
        name=segment,
        description="",
        system=None,
        context=literal(before),
        question=question,
        fields={},
        answers={label: tuple(surfaces) for label, surfaces in answers.items()},
        expect={},
    )
    after_ids = lm.tokenizer(after, add_special_tokens=False).input_ids if after.strip() else []
    prompt = render(scenario, lm.tokenizer, appended=[(t, segment) for t in image.token_ids] + [(t, "context") for t in after_ids])
    at = prompt.context_segments.index(segment)
    head = next(i for i, label in enumerate(prompt.context_segments) if label != "template")  # the chat template's head
    compiled = Notebook.prefill(
        lm, prompt.context_ids[:head] + image.token_ids, prompt.context_segments[:head] + (segment,) * len(image.token_ids)
    )
    block = compiled.block(segment)
    compile_ms = watch.ms
    rest = list(prompt.context_ids[at + len(image.token_ids) :])

    def recompute_and_read() -> tuple[Notebook, Decision]:
        encode_image(lm, pixels, name)  # the vision tower runs again, as without image K/V reuse
        notebook = Notebook.from_prompt(lm, prompt)
        return notebook, notebook.read_prompt(prompt, answer_texts=answers)

    def splice_and_read() -> tuple[Notebook, Decision]:
        notebook = Notebook.prefill(lm, prompt.context_ids[:at], prompt.context_segments[:at]).splice(block, seam=seam).append(rest)
        return notebook, notebook.read_prompt(prompt, answer_texts=answers)

    results, spreads = side_by_side({"full": recompute_and_read, "splice": splice_and_read}, reps=reps, warmup=warmup)
    (_, recomputed), (_, spliced) = results["full"], results["splice"]
    return ImageFidelity(
        image=name,
        image_tokens=len(image.token_ids),
        rope_span=block.rope_span,
        shift=at - block.start_position,
        seam=seam,
        context_tokens=len(prompt.context_ids),
        agreement=logit_agreement(spliced.next_token_logits, recomputed.next_token_logits),
        match=DecisionMatch.of(spliced, recomputed),
        spliced=spliced,
        recomputed=recomputed,
        ttft_ms={"splice": spreads["splice"].median, "full": spreads["full"].median},
        compile_ms=compile_ms,
    )
