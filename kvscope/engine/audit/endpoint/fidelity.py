"""Two answers compared (the original request's and a repair's): the fields the in-process audit gives (top-1,
top-5 overlap, greedy agreement, the same text) and the KL divergence estimated from the two top-k lists.

The estimate (docs/audit.md, "The KL from top-k lists, and its bound", has the derivation): with ``S`` the tokens in
both lists and the rest one tail bucket of masses ``P_T``, ``Q_T``::

    KL̂ = Σ_S p log(p/q) + P_T log(P_T/Q_T)        KL̂ ≤ KL ≤ KL̂ + kl_bound,   kl_bound = P_T · max(0, M + log(Q_T/P_T))

The lower side always holds (chain rule of KL over the partition); the upper one assumes no tail token's ``log p/q``
exceeds ``M``, the largest log-ratio the lists show or imply. With a full distribution ``P_T`` is 0: exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

from kvscope.engine.audit.endpoint.answers import Answer, Token
from kvscope.engine.audit.prompts.repair_requests import OutputFidelity, greedy_agreement
from kvscope.engine.audit.report.records import Record, rounded

TAIL_FLOOR = 1e-6  # a tail mass at or below it is the float32 rounding of the listed log-probs, not a tail


@dataclass(frozen=True)
class KlEstimate:
    """KL̂ from two top-k lists (a lower bound of the KL), the width above it (``bound``, under the module's stated
    assumption), and the reference's tail mass."""

    kl: float
    bound: float
    tail_mass: float


def estimate_kl(reference: Mapping[Token, float], other: Mapping[Token, float]) -> KlEstimate:
    """KL(reference ‖ other) from two top-k log-prob lists, the tail as one bucket (the module's docstring derives it)."""
    shared = [token for token in reference if token in other]
    p = [math.exp(reference[token]) for token in shared]
    q = [math.exp(other[token]) for token in shared]
    p_tail, q_tail = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 0.0)
    buckets_p, buckets_q = [reference[t] for t in shared], [other[t] for t in shared]
    if p_tail > TAIL_FLOOR:
        buckets_p.append(math.log(p_tail))
        buckets_q.append(math.log(max(q_tail, TAIL_FLOOR)))
    kl = _kl_divergence(buckets_p, buckets_q) if shared else 0.0
    if p_tail <= TAIL_FLOOR:
        return KlEstimate(kl, 0.0, p_tail)
    ratios = [reference[t] - other[t] for t in shared]
    ratios += [-r for r in ratios]
    ratios += [reference[t] - min(other.values()) for t in reference if t not in other]  # q ≤ the other's k-th
    ratios += [min(reference.values()) - other[t] for t in other if t not in reference]  # p ≤ the reference's k-th
    most = max([0.0, *ratios])
    bound = p_tail * max(0.0, most + math.log(max(q_tail, TAIL_FLOOR) / p_tail))
    return KlEstimate(kl, bound, p_tail)


def _kl_divergence(log_p: Sequence[float], log_q: Sequence[float]) -> float:
    """KL(p‖q) of two short log-probability lists, in nats, clamped at 0: ``kvscope.engine.cache.decision.kl_divergence``'s
    sum in float64 without torch (an endpoint's audit loads no model)."""
    return max(0.0, math.fsum(math.exp(a) * (a - b) for a, b in zip(log_p, log_q)))


@dataclass(frozen=True)
class EndpointFidelity(Record):
    """One prompt's answer on an endpoint against the reference's: the in-process audit's fields, the KL's bound and
    the server's cached tokens for it; as a repair, whether it holds the audit's bars (``within_bars``, set by the
    sampled turns' measurement)."""

    applicable: Literal[True] = field(default=True, init=False)  # a repair that applied (else ``NotApplicable``)
    kl: Annotated[float, rounded(8)]
    kl_bound: Annotated[float, rounded(8)]
    tail_mass: Annotated[float, rounded(8)]
    top_k: int  # the shorter of the two lists
    top1_agree: bool
    top5_overlap: Annotated[float, rounded(4)]
    generation_agreement: Annotated[float, rounded(4)]
    generated_common_prefix: int
    same_text: bool
    within_bars: bool | None = field(default=None, kw_only=True)
    server_cached_tokens: int | None  # the server's reported cached tokens for the answer

    @property
    def fidelity(self) -> OutputFidelity:
        """The fields the in-process audit measures."""
        return OutputFidelity(self.kl, self.top1_agree, self.top5_overlap, self.generation_agreement, self.generated_common_prefix)


@dataclass(frozen=True)
class NotApplicable(Record):
    """A repair that does not apply (or that an endpoint cannot measure), and why."""

    applicable: Literal[False] = field(default=False, init=False)
    reason: str


def compare(reference: Answer, other: Answer) -> EndpointFidelity:
    """``other`` measured against ``reference`` as :func:`kvscope.engine.audit.measure.repairs.fidelity` measures two states."""
    estimate = estimate_kl(reference.top, other.top)
    top5 = len(set(reference.ranked(5)) & set(other.ranked(5))) / 5
    agreement, prefix = greedy_agreement(reference.generated, other.generated)
    return EndpointFidelity(
        kl=estimate.kl,
        kl_bound=estimate.bound,
        tail_mass=estimate.tail_mass,
        top_k=min(len(reference.top), len(other.top)),
        top1_agree=reference.top1 == other.top1,
        top5_overlap=top5,
        generation_agreement=agreement,
        generated_common_prefix=prefix,
        same_text=reference.text == other.text,
        server_cached_tokens=other.cached_tokens,
    )
