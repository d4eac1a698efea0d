"""Per-model numeric self-test: is re-rotation and splicing exact enough on *this* model and dtype?

Checks, each against ground truth computed by the same model:
- RoPE round trip: keys rotated by +Δ then −Δ return to themselves.
- Reposition vs prefill: keys of a text prefilled at 0 and rotated by +Δ equal the keys of the same text
  prefilled at Δ (RoPE attention is relative, so deeper layers agree too up to rounding).
- Splice identity: a block spliced back at its own position gives the same next-token logits as the
  prefill it came from; a block compiled alone and spliced elsewhere with the whole block as seam too.
- Chunked prefill equals one prefill.
Key errors are relative to the largest key magnitude; logit errors are absolute. If RoPE is unsupported
(e.g. GPT-2), the rotation checks report the reason and splicing stays switched off.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from engine.models import LoadedModel
from engine.notebook import Notebook
from engine.rope import RopeUnsupported

TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}
_PROBE_TEXT = (
    "Order 4417 was placed on Monday. The customer asked whether the refund policy applies, "
    "and the agent checked the status field before answering. Policy: refunds are approved only "
    "when the order is still pending; shipped orders must be returned first. "
)


@dataclass
class SelfTestReport:
    """Numbers from :func:`run_selftest`; ``ok`` when every applicable error is within ``tolerance``."""

    ok: bool
    model: str
    dtype: str
    device: str
    tolerance: float
    rope_supported: bool
    rope_reason: str | None
    rope_roundtrip_max_err: float | None
    reposition_vs_prefill_max_err: float | None
    splice_identity_max_logit_err: float | None
    splice_full_seam_max_logit_err: float | None
    chunked_prefill_max_err: float
    tokens: int
    shift: int
    ms: float

    def as_dict(self) -> dict:
        return asdict(self)


def _probe_ids(lm: LoadedModel, count: int) -> list[int]:
    ids = lm.tokenizer(_PROBE_TEXT * (1 + count // 16), add_special_tokens=False).input_ids
    return ids[:count]


def _max_relative(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """max |a − b| / max |b| over all layers."""
    scale = max(float(t.float().abs().max()) for t in b) or 1.0
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)) / scale


def _next_logits(notebook: Notebook, decode: list[int]) -> torch.Tensor:
    return notebook.read(decode, {"probe": [[decode[0]]], "other": [[decode[-1]]]}).next_token_logits


def run_selftest(lm: LoadedModel, tokens: int = 48, shift: int = 37) -> SelfTestReport:
    """Measure the cache-math errors of this model (see module docstring)."""
    started = time.perf_counter()
    ids = _probe_ids(lm, tokens + 4)
    context, decode = ids[:tokens], ids[tokens:]
    split = tokens // 3
    segments = ["prefix"] * split + ["block"] * (tokens - split)
    full = Notebook.prefill(lm, context, segments)
    chunked = Notebook.prefill(lm, context, segments, chunk_size=max(tokens // 5, 1))
    chunk_err = _max_relative(chunked.keys + chunked.values, full.keys + full.values)

    roundtrip = reposition = splice_err = seam_err = None
    reason = None
    try:
        rotary = full.rotary
    except RopeUnsupported as error:
        reason = str(error)
    else:
        n = len(full.positions)
        forward, back = torch.full((n,), shift), torch.full((n,), -shift)
        roundtrip = _max_relative(tuple(rotary.rotate(rotary.rotate(k, forward), back) for k in full.keys), full.keys)
        shifted = Notebook.prefill(lm, context, segments, start_position=shift)
        reposition = _max_relative(tuple(rotary.rotate(k, forward) for k in full.keys), shifted.keys)
        reference = _next_logits(full, decode)
        prefix = Notebook.prefill(lm, context[:split], "prefix")
        spliced = prefix.splice(full.block("block"))
        splice_err = float((_next_logits(spliced, decode) - reference).abs().max())
        alone = Notebook.prefill(lm, context[split:], "block", start_position=shift)
        repaired = prefix.splice(alone.block("block"), seam=tokens - split)
        seam_err = float((_next_logits(repaired, decode) - reference).abs().max())

    tolerance = TOLERANCE.get(lm.dtype, 5e-2)
    checks = [chunk_err <= tolerance]
    if reason is None:
        checks += [roundtrip <= tolerance, reposition <= tolerance, splice_err <= tolerance, seam_err <= tolerance]
    return SelfTestReport(
        ok=all(checks),
        model=lm.fingerprint.name,
        dtype=lm.fingerprint.dtype,
        device=str(lm.device),
        tolerance=tolerance,
        rope_supported=reason is None,
        rope_reason=reason,
        rope_roundtrip_max_err=roundtrip,
        reposition_vs_prefill_max_err=reposition,
        splice_identity_max_logit_err=splice_err,
        splice_full_seam_max_logit_err=seam_err,
        chunked_prefill_max_err=chunk_err,
        tokens=tokens,
        shift=shift,
        ms=round((time.perf_counter() - started) * 1000, 1),
    )
