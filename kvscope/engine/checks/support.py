"""The support matrix: which cache operations are exact on which model family, proved against ground truth.

For each model (a tiny random-weight stand-in per family from ``kvscope.engine.models.tiny``, or the loaded model) every
operation runs once and is compared with what the model itself computes (each check in words: docs/support-matrix.md).
An operation the engine refuses reports the refusal's own message (which family trait and why). Errors are max absolute
differences in float32 (logits for reads, K/V otherwise). ``python -m kvscope support --json`` prints the matrix; the
table in docs/support-matrix.md is its ``--markdown`` output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from kvscope.engine.cache import display, vision
from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Knockout, Notebook
from kvscope.engine.cache.recurrent import RecurrentContext
from kvscope.engine.cache.selftest import SelfTestReport
from kvscope.engine.errors import KVScopeError
from kvscope.engine.models.tiny import FAMILIES, tiny_family, tiny_model
from kvscope.engine.progress import MessageProgress
from kvscope.engine.timing import Stopwatch

OPERATIONS: tuple[str, ...] = (
    "read",
    "chunked prefill",
    "replace",
    "patch",
    "knockout",
    "move keys",
    "splice",
    "seam repair",
    "self-test",
    "images",
)
TOLERANCE = 2e-5  # float32 on tiny models; the bar for "exact"
_DECODE = [5, 6, 7]
_ANSWERS = {"a": [[8]], "b": [[9, 10, 11]]}


@dataclass(frozen=True)
class Verdict:
    """One operation on one model: measured error against ground truth, or the refusal's reason."""

    operation: str
    supported: bool
    max_error: float | None = None
    reason: str | None = None
    applicable: bool = True  # False: nothing to check on this model (images on a text-only model)


@dataclass(frozen=True)
class SupportRow:
    """A model's verdict for every operation in :data:`OPERATIONS`."""

    model: str
    family: str
    model_type: str
    dtype: str
    verdicts: tuple[Verdict, ...]
    ms: float

    def verdict(self, operation: str) -> Verdict:
        return next(v for v in self.verdicts if v.operation == operation)

    @property
    def refused(self) -> dict[str, str]:
        """Operation → reason, for the refused ones."""
        return {v.operation: v.reason or "" for v in self.verdicts if not v.supported and v.applicable}

    def summary(self) -> str:
        """One line for a model card: the max error of each supported operation, then refusals by reason."""
        measured = ", ".join(
            f"{v.operation} {v.max_error:.1g}" if v.max_error is not None else v.operation
            for v in self.verdicts
            if v.supported and v.applicable
        )
        by_reason: dict[str, list[str]] = {}
        for operation, reason in self.refused.items():
            by_reason.setdefault(reason, []).append(operation)
        refused = "; ".join(f"refused {', '.join(ops)}: {reason}" for reason, ops in by_reason.items())
        exact = f"max |error| vs the model's own forward ({self.dtype}): {measured}" if measured else ""
        return ". ".join(part for part in (exact, refused) if part)

    def _repr_html_(self) -> str:
        """Jupyter's view: every operation's verdict (max |error| against the model's own forward, or the refusal's reason)."""
        rows = [(v.operation, _cell(v), v.reason or ("" if v.applicable else "not applicable to this model")) for v in self.verdicts]
        subtitle = f"{self.family} ({self.model_type}), {self.dtype}: max |error| vs the model's own forward (tolerance {TOLERANCE:g})"
        return display.block(f"Support: {self.model}", display.table(rows, header=("operation", "verdict", "reason")), subtitle=subtitle)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["verdicts"] = {v.operation: {k: val for k, val in asdict(v).items() if k != "operation"} for v in self.verdicts}
        return data


def _ids(lm: LoadedModel, count: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, lm.model.config.get_text_config().vocab_size - 10, (count,), generator=generator).tolist()


def _diff(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def _logits(notebook: Notebook) -> torch.Tensor:
    return notebook.read(_DECODE, _ANSWERS).next_token_logits


def _model_logits(lm: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids], device=lm.device)).logits[0, -1].float().cpu()


def _operations(lm: LoadedModel, tokens: int) -> dict[str, Callable[[], float]]:
    """Each operation as a function returning its max error against the ground truth (module docstring)."""
    ids, new = _ids(lm, tokens, 0), _ids(lm, 3, 2)
    third = tokens // 3
    recurrent = bool(lm.recurrent_layers)  # a hybrid reads through its own append-only cache (kvscope.engine.edit.hybrid)

    def read() -> float:
        context = RecurrentContext.prefill(lm, ids) if recurrent else Notebook.prefill(lm, ids)
        return float((context.read(_DECODE, _ANSWERS).next_token_logits.cpu() - _model_logits(lm, ids + _DECODE)).abs().max())

    def chunked() -> float:
        if recurrent:  # running states are compared through what they lead to: the next-token logits
            whole, chunks = (RecurrentContext.prefill(lm, ids, chunk_size=size).read(_DECODE, _ANSWERS) for size in (None, 7))
            return float((whole.next_token_logits - chunks.next_token_logits).abs().max())
        whole, chunks = Notebook.prefill(lm, ids), Notebook.prefill(lm, ids, chunk_size=7)
        return _diff(whole.keys + whole.values, chunks.keys + chunks.values)

    def replaced() -> float:
        edited = Notebook.prefill(lm, ids).replace(range(8, 11), new)
        repaired = edited.recompute([p for p in edited.visible_positions() if p >= 11])
        return float((_logits(repaired) - _logits(Notebook.prefill(lm, ids[:8] + new + ids[11:]))).abs().max())

    def patched() -> float:
        stale, donor = Notebook.prefill(lm, ids), Notebook.prefill(lm, ids[:8] + new + ids[11:])
        return float((_logits(stale.patch(donor, range(tokens))) - _logits(donor)).abs().max())

    def knocked() -> float:
        notebook = Notebook.prefill(lm, ids)
        hidden = notebook.visible.clone()
        hidden[[4, 5, tokens - 5]] = False
        reference = replace(notebook, visible=hidden).read(_DECODE, _ANSWERS).next_token_logits
        return float((notebook.read(_DECODE, _ANSWERS, knockout=Knockout((4, 5, tokens - 5))).next_token_logits - reference).abs().max())

    def moved() -> float:
        block = Notebook.prefill(lm, ids[:third], "skill").block("skill")
        relocated = Notebook.prefill(lm, _ids(lm, 2 * third, 9), "prefix").splice(block).block("skill")
        target = Notebook.prefill(lm, ids[:third], "skill", start_position=2 * third)
        return _diff(relocated.keys + relocated.values, target.keys + target.values)

    def spliced() -> float:
        source = Notebook.prefill(lm, ids, ["prefix"] * third + ["skill"] * third + ["after"] * (tokens - 2 * third))
        composed = Notebook.prefill(lm, ids[:third], "prefix").splice(source.block("skill")).append(ids[2 * third :], "after").compact()
        return _diff(composed.keys + composed.values, source.keys + source.values)

    def seam() -> float:
        skill = Notebook.prefill(lm, ids[third:], "skill", start_position=3).block("skill")
        composed = Notebook.prefill(lm, ids[:third], "prefix").splice(skill, seam=len(skill))
        return float((_logits(composed) - _logits(Notebook.prefill(lm, ids))).abs().max())

    return {
        "read": read,
        "chunked prefill": chunked,
        "replace": replaced,
        "patch": patched,
        "knockout": knocked,
        "move keys": moved,
        "splice": spliced,
        "seam repair": seam,
    }


def _picture() -> np.ndarray:
    """A 56×112 RGB test picture (gradients and a checkerboard): 2 × 4 merged patches on Qwen2-VL's processor."""
    rows, cols = np.mgrid[0:56, 0:112]
    return np.stack([rows * 4, cols * 2, ((rows // 8 + cols // 8) % 2) * 255], axis=-1).astype(np.uint8)


def _pixel_logits(lm: LoadedModel, ids: list[int], image: vision.EncodedImage, pixels: np.ndarray) -> torch.Tensor:
    """The model's own next-token logits over text with the picture fed as pixels (its processor and rope index)."""
    processed = lm.image_processor(images=[pixels], return_tensors="pt")
    patches = set(image.token_ids[1:-1])
    placeholder = [lm.model.config.image_token_id if token in patches else token for token in ids]
    types = [int(token in patches) for token in ids]
    with torch.no_grad():
        output = lm.model(
            input_ids=torch.tensor([placeholder], device=lm.device),
            pixel_values=processed["pixel_values"].to(lm.device, lm.dtype),
            image_grid_thw=processed["image_grid_thw"].to(lm.device),
            mm_token_type_ids=torch.tensor([types], device=lm.device),
        )
    return output.logits[0, -1].float().cpu()


def _image_error(lm: LoadedModel) -> float:
    """The worst error of the image checks (module docstring) on a context: text, picture, text."""
    pixels = _picture()
    image = vision.encode_image(lm, pixels, "picture")
    pre, post, picture = _ids(lm, 5, 3), _ids(lm, 6, 4), list(image.token_ids)
    ids = pre + picture + post
    source = Notebook.prefill(lm, ids, ["pre"] * len(pre) + ["picture"] * len(picture) + ["post"] * len(post))
    alone = Notebook.prefill(lm, picture, "picture").block("picture")
    relocated = Notebook.prefill(lm, _ids(lm, 161, 5), "prefix").splice(alone).block("picture")
    at_target = Notebook.prefill(lm, picture, "picture", start_position=161)
    composed = Notebook.prefill(lm, pre, "pre").splice(source.block("picture")).append(post, "post").compact()
    chunked = Notebook.prefill(lm, ids, chunk_size=4)
    repaired = Notebook.prefill(lm, pre, "pre").splice(alone, seam=len(alone)).append(post, "post")
    return max(
        float((_logits(source).cpu() - _pixel_logits(lm, ids + _DECODE, image, pixels)).abs().max()),
        _diff(chunked.keys + chunked.values, source.keys + source.values),
        _diff(composed.keys + composed.values, source.keys + source.values),
        _diff(relocated.keys + relocated.values, at_target.keys + at_target.values),
        float((_logits(repaired) - _logits(source)).abs().max()),
    )


def _image_verdict(lm: LoadedModel) -> Verdict:
    if not hasattr(lm.model, "get_image_features"):
        return Verdict("images", False, applicable=False)
    try:
        return Verdict("images", True, _image_error(lm))
    except KVScopeError as error:
        return Verdict("images", False, reason=str(error))


def _selftest_verdict(lm: LoadedModel, report: SelfTestReport | None) -> Verdict:
    report = report or lm.splice_gate.report(lm)
    if not report.rope_supported:
        return Verdict("self-test", report.ok, report.chunked_prefill_max_err, reason=None if report.ok else report.summary())
    worst = max((c.error for c in report.checks if not c.name.startswith("noise")), default=None)
    return Verdict("self-test", report.ok, worst, reason=None if report.ok else report.summary())


def check_model(lm: LoadedModel, family: str | None = None, tokens: int = 30, selftest: SelfTestReport | None = None) -> SupportRow:
    """Run every operation on this model against its ground truth; refusals keep their messages
    (``selftest``: a report already computed for this model, reused)."""
    watch = Stopwatch()
    verdicts = []
    for operation, run in _operations(lm, tokens).items():
        try:
            verdicts.append(Verdict(operation, True, run()))
        except KVScopeError as error:
            verdicts.append(Verdict(operation, False, reason=str(error)))
    try:
        verdicts.append(_selftest_verdict(lm, selftest))
    except KVScopeError as error:
        verdicts.append(Verdict("self-test", False, reason=str(error)))
    verdicts.append(_image_verdict(lm))
    config = lm.model.config.get_text_config()
    return SupportRow(
        model=lm.fingerprint.name,
        family=family or tiny_family(config.model_type) or f"{config.model_type} (no tiny stand-in)",
        model_type=config.model_type,
        dtype=lm.fingerprint.dtype,
        verdicts=tuple(verdicts),
        ms=round(watch.ms, 1),
    )


def support_matrix(archs: tuple[str, ...] = tuple(FAMILIES), progress: MessageProgress | None = None) -> list[SupportRow]:
    """One row per tiny family (float32, random weights): the matrix docs/support-matrix.md shows."""
    rows = []
    for index, arch in enumerate(archs):
        if progress:
            progress(f"{arch} ({index + 1}/{len(archs)})")
        rows.append(check_model(tiny_model(arch), FAMILIES[arch]))
    return rows


def _cell(verdict: Verdict) -> str:
    if not verdict.applicable:
        return "–"
    if not verdict.supported:
        return "refused"
    if verdict.max_error is None:
        return "✓"
    return f"✓ {verdict.max_error:.0e}" if verdict.max_error else "✓ 0"


def markdown_table(rows: list[SupportRow]) -> str:
    """The matrix as a Markdown table (max errors; refusal reasons as numbered notes below it)."""
    lines = ["| family (tiny model) | " + " | ".join(OPERATIONS) + " |", "|---" * (len(OPERATIONS) + 1) + "|"]
    reasons: list[str] = []
    for row in rows:
        cells = []
        for verdict in row.verdicts:
            cell = _cell(verdict)
            if not verdict.supported and verdict.applicable:
                reason = verdict.reason or ""
                if reason not in reasons:
                    reasons.append(reason)
                cell += f" [{reasons.index(reason) + 1}]"
            cells.append(cell)
        lines.append(f"| {row.family} (`tiny-{row.model.removeprefix('tiny-')}`) | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{number}. {reason}" for number, reason in enumerate(reasons, 1)]
    return "\n".join(lines)
