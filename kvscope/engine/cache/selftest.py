"""Per-model numeric self-test: is re-rotation and splicing exact enough on *this* model and dtype?

Checks, each against ground truth computed by the same model:
- RoPE round trip: keys rotated by +Δ then −Δ return to themselves.
- Reposition vs prefill: keys of a text prefilled at 0 and rotated by +Δ equal the keys of the same text
  prefilled at Δ (RoPE attention is relative, so deeper layers agree too up to rounding).
- Splice identity: a block spliced back at its own position gives the same next-token logits as the
  prefill it came from.
- Splice moved: the block of the prefill at +Δ, re-rotated by −Δ and spliced, gives those logits too.
- Full-seam splice: a block compiled alone elsewhere, spliced with the whole block as seam, equals a prefill.
- Chunked prefill equals one prefill.

Each error is judged against the *noise floor of this dtype on this machine*, measured in the same run from
two computations that are equal in exact arithmetic and never touch the code under test: the same text
prefilled at position 0 and at position Δ. Its position-free cache slot (the values; the latents under multi-head
latent attention) gives the floor of the K/V checks; its
next-token logits give the floor of the logit checks. A check passes when its error is within
``NOISE_FACTOR`` × its floor; a floor is never below a few units of the dtype's rounding (``torch.finfo``)
and a floor above ``_FLOOR_CAP`` is itself a failure (something beyond rounding moved). Rotation runs in
float32 whatever the storage dtype (``kvscope.engine.cache.rope``). K/V errors are relative to the largest cached entry,
logit errors to the largest logit.
If RoPE is unsupported (e.g. GPT-2), the rotation checks report the reason and splicing stays switched off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.engine.cache.loaded import LoadedModel
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.cache.rope import RopeUnsupported
from kvscope.engine.jsonable import JsonFields
from kvscope.engine.timing import Stopwatch

NOISE_FACTOR = 8.0
_EPS_UNITS = 1.0  # the smallest floor, in units of the dtype's machine epsilon
_FLOOR_CAP = 0.1  # a relative noise floor above this is not rounding
_PROBE_TEXT = (
    "Order 4417 was placed on Monday. The customer asked whether the refund policy applies, "
    "and the agent checked the status field before answering. Policy: refunds are approved only "
    "when the order is still pending; shipped orders must be returned first. "
)


@dataclass(frozen=True)
class Check(JsonFields):
    """One self-test check: its error, the noise floor it is judged against, and the verdict."""

    name: str
    error: float
    floor: float
    limit: float
    ok: bool


@dataclass
class SelfTestReport(JsonFields):
    """Numbers from :func:`run_selftest`; ``ok`` when every check is within its noise-derived limit."""

    ok: bool
    model: str
    dtype: str
    device: str
    noise_factor: float
    kv_noise_floor: float
    logit_noise_floor: float | None
    rope_supported: bool
    rope_reason: str | None
    rope_roundtrip_max_err: float | None
    reposition_vs_prefill_max_err: float | None
    splice_identity_max_logit_err: float | None
    splice_moved_max_logit_err: float | None
    splice_full_seam_max_logit_err: float | None
    chunked_prefill_max_err: float
    checks: list[Check]
    tokens: int
    shift: int
    ms: float

    @property
    def failed(self) -> list[Check]:
        """The checks outside their limits."""
        return [check for check in self.checks if not check.ok]

    def summary(self) -> str:
        """One line for a model card: verdict, dtype, and each check's error against its limit."""
        verdict = "ok" if self.ok else "FAILED"
        if not self.rope_supported:
            return f"{verdict} in {self.dtype}: {self.rope_reason}"
        parts = ", ".join(
            f"{c.name} {c.error:.2g} ≤ {c.limit:.2g}" if c.ok else f"{c.name} {c.error:.2g} > {c.limit:.2g}" for c in self.checks
        )
        return f"{verdict} in {self.dtype} (error ≤ {self.noise_factor:g}× this dtype's measured noise floor: {parts})"


def _probe_ids(lm: LoadedModel, count: int) -> list[int]:
    ids = lm.tokenizer(_PROBE_TEXT * (1 + count // 16), add_special_tokens=False).input_ids
    return ids[:count]


def _max_relative(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> float:
    """max |a − b| / max |b| over all layers, in float32."""
    scale = max(float(t.float().abs().max()) for t in b) or 1.0
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)) / scale


def _relative_logit_err(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """max |logits − reference| / max |reference|."""
    return float((logits.float() - reference.float()).abs().max()) / (float(reference.float().abs().max()) or 1.0)


def _next_logits(notebook: Notebook, decode: list[int]) -> torch.Tensor:
    return notebook.read(decode, {"probe": [[decode[0]]], "other": [[decode[-1]]]}).next_token_logits


def _check(name: str, error: float, floor: float) -> Check:
    """An error judged against ``NOISE_FACTOR`` × its floor."""
    limit = NOISE_FACTOR * floor
    return Check(name, error, floor, limit, error <= limit)


def _floor_check(name: str, floor: float) -> Check:
    """A measured noise floor judged against the cap of plain rounding."""
    return Check(name, floor, floor, _FLOOR_CAP, floor <= _FLOOR_CAP)


def run_selftest(lm: LoadedModel, tokens: int = 48, shift: int = 37) -> SelfTestReport:
    """Measure the cache-math errors of this model against this dtype's noise floor (module docstring)."""
    with lm.splice_gate.measuring():
        return _measure(lm, tokens, shift)


def _measure(lm: LoadedModel, tokens: int, shift: int) -> SelfTestReport:
    watch = Stopwatch()
    smallest = _EPS_UNITS * torch.finfo(lm.dtype).eps
    ids = _probe_ids(lm, tokens + 4)
    context, decode = ids[:tokens], ids[tokens:]
    split = tokens // 3
    segments = ["prefix"] * split + ["block"] * (tokens - split)
    full = Notebook.prefill(lm, context, segments)
    chunked = Notebook.prefill(lm, context, segments, chunk_size=max(tokens // 5, 1))
    chunk_err = _max_relative(chunked.keys + chunked.values, full.keys + full.values)

    roundtrip = reposition = splice_err = moved_err = seam_err = logit_floor = None
    kv_floor, reason, checks = smallest, None, []
    try:
        rotary = full.rotary
    except RopeUnsupported as error:
        reason = str(error)
    else:
        shifted = Notebook.prefill(lm, context, segments, start_position=shift)
        kv_floor = max(
            _max_relative(rotary.position_free(shifted.keys, shifted.values), rotary.position_free(full.keys, full.values)), smallest
        )
        reference = _next_logits(full, decode)
        logit_floor = max(_relative_logit_err(_next_logits(shifted, decode), reference), smallest)
        n = len(full.positions)
        forward, back = torch.full((n,), shift), torch.full((n,), -shift)
        there = rotary.move(full.keys, full.values, forward)
        returned = rotary.move(*there, back)
        roundtrip = _max_relative(returned[0] + returned[1], full.keys + full.values)
        reposition = _max_relative(there[0] + there[1], shifted.keys + shifted.values)
        prefix = Notebook.prefill(lm, context[:split], "prefix")
        splice_err = _relative_logit_err(_next_logits(prefix.splice(full.block("block")), decode), reference)
        moved_err = _relative_logit_err(_next_logits(prefix.splice(shifted.block("block")), decode), reference)
        alone = Notebook.prefill(lm, context[split:], "block", start_position=shift)
        repaired = prefix.splice(alone.block("block"), seam=tokens - split)
        seam_err = _relative_logit_err(_next_logits(repaired, decode), reference)
        checks += [
            _floor_check("noise floor (K/V)", kv_floor),
            _floor_check("noise floor (logits)", logit_floor),
            _check("round trip", roundtrip, smallest),
            _check("reposition", reposition, kv_floor),
            _check("splice", splice_err, logit_floor),
            _check("splice moved", moved_err, logit_floor),
            _check("full seam", seam_err, logit_floor),
        ]
    checks.append(_check("chunked prefill", chunk_err, kv_floor))
    return SelfTestReport(
        ok=all(check.ok for check in checks),
        model=lm.fingerprint.name,
        dtype=lm.fingerprint.dtype,
        device=str(lm.device),
        noise_factor=NOISE_FACTOR,
        kv_noise_floor=kv_floor,
        logit_noise_floor=logit_floor,
        rope_supported=reason is None,
        rope_reason=reason,
        rope_roundtrip_max_err=roundtrip,
        reposition_vs_prefill_max_err=reposition,
        splice_identity_max_logit_err=splice_err,
        splice_moved_max_logit_err=moved_err,
        splice_full_seam_max_logit_err=seam_err,
        chunked_prefill_max_err=chunk_err,
        checks=checks,
        tokens=tokens,
        shift=shift,
        ms=round(watch.ms, 1),
    )
