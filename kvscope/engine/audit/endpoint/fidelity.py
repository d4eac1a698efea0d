"""Two answers compared (the original request's and a repair's): the fields the in-process audit gives (top-1,
top-5 overlap, greedy agreement, the same text) and the KL divergence estimated from the two top-k lists.

The KL estimate and its bound: Let ``S`` be the tokens in both top-k lists and ``T`` every other token (the tail),
with masses ``P_T = 1 - Σ_S p`` and ``Q_T = 1 - Σ_S q``. The estimate is the KL of the two distributions coarsened to
``S`` plus one tail bucket::

    KL̂ = Σ_S p log(p/q) + P_T log(P_T/Q_T)

By the chain rule of KL over that partition, ``KL(P‖Q) = KL̂ + P_T · KL(P_T‖Q_T)``, where ``P_T``, ``Q_T`` are the two
distributions conditioned on the tail. So **KL̂ ≤ KL always** (the estimate never overstates a repair's drift), and
the shortfall is the tail's mass times the tail's own KL. Nothing bounds that from above without knowing the tail
(one tail token the repair makes arbitrarily unlikely makes the KL infinite), so the upper side rests on one stated
assumption: no tail token's log-ratio ``log p/q`` exceeds ``M``, the largest log-ratio the lists show or imply (the
shared tokens' ``|log p/q|``; a reference token missing from the repair's list has ``q`` at most the repair's k-th,
and the converse). Then ``KL(P_T‖Q_T) = E_{P_T}[log p/q] + log(Q_T/P_T) ≤ M + log(Q_T/P_T)`` and::

    KL̂ ≤ KL ≤ KL̂ + kl_bound,   kl_bound = P_T · max(0, M + log(Q_T/P_T))

Both ``kl_bound`` and ``tail_mass`` (``P_T``) are reported per comparison; with a full distribution (llama-server
answers ``logprobs`` up to its vocabulary) ``P_T`` is 0 and the estimate is exact."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvscope.engine.audit.endpoint.answers import Answer, Token
from kvscope.engine.audit.prompts.repair_requests import OutputFidelity, greedy_agreement

if TYPE_CHECKING:
    from kvscope.engine.audit.report.types import EndpointFidelityDict

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
class EndpointFidelity:
    """One prompt's answer against the reference's: the in-process audit's fields, and the KL's bound."""

    fidelity: OutputFidelity
    kl_bound: float
    tail_mass: float
    top_k: int  # the shorter of the two lists
    same_text: bool

    def as_dict(self) -> EndpointFidelityDict:
        f = self.fidelity
        return {
            "kl": round(f.kl, 8),
            "kl_bound": round(self.kl_bound, 8),
            "tail_mass": round(self.tail_mass, 8),
            "top_k": self.top_k,
            "top1_agree": f.top1_agree,
            "top5_overlap": round(f.top5_overlap, 4),
            "generation_agreement": round(f.generation_agreement, 4),
            "generated_common_prefix": f.generated_common_prefix,
            "same_text": self.same_text,
        }


def compare(reference: Answer, other: Answer) -> EndpointFidelity:
    """``other`` measured against ``reference`` as :func:`kvscope.engine.audit.measure.repairs.fidelity` measures two states."""
    estimate = estimate_kl(reference.top, other.top)
    top5 = len(set(reference.ranked(5)) & set(other.ranked(5))) / 5
    agreement, prefix = greedy_agreement(reference.generated, other.generated)
    fidelity = OutputFidelity(estimate.kl, reference.top1 == other.top1, top5, agreement, prefix)
    return EndpointFidelity(
        fidelity, estimate.bound, estimate.tail_mass, min(len(reference.top), len(other.top)), reference.text == other.text
    )
