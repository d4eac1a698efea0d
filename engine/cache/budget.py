"""Bounded work: a per-request budget (model time, context length) and a fair gate for shared models.

A server wraps each request in :func:`bounded`; every forward (and backward) of the engine runs inside
:func:`compute_slot`, which refuses a context over the budget's token limit before computing anything,
stops the request cleanly between forwards once its model time is spent, and, when a :class:`ComputeGate`
is given, takes turns with the other requests: the request that has used the least model time goes next
(least attained service), so a short edit never waits behind a long request for more than one forward.
Outside :func:`bounded` nothing is limited (the CLI, tests, local scripts) but the new tokens of one forward
(``MAX_FORWARD_TOKENS``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from engine.errors import KVScopeError


class BudgetExceeded(KVScopeError):
    """A request asked for more than this server allows (context length or model time); nothing was kept."""


@dataclass(frozen=True)
class WorkBudget:
    """Limits of one request: model seconds (forwards and backwards), tokens of context, and new tokens per
    forward (longer computations run as several exact chunks, so other requests get turns in between)."""

    seconds: float | None = None
    max_context_tokens: int | None = None
    forward_tokens: int | None = None
    profile: str = "this server"  # named in refusals, e.g. "the public profile"


@dataclass
class _Scope:
    budget: WorkBudget
    gate: ComputeGate | None
    used_s: float = 0.0
    forwards: int = 0
    holding: bool = False
    ticket: object = field(default_factory=object)


# New tokens one forward runs at most, in any request (a budget's limit only lowers it); longer work runs as
# exact chunks. Masks are explicit, so a forward's attention costs its tokens × every key it is given. Tiny
# llama on CPU (1 thread, peak RSS): an 8k-token prefill took 4.0 s and 1.07 GB in one forward, 2.1 s and
# 0.51 GB in 1,024-token chunks; an 8k-token edit (stale, oracle and four strategies read together) 28 s and
# 4.3 GB in one fused forward, 6.3 s and 0.63 GB in chunks.
MAX_FORWARD_TOKENS = 1024

_SCOPE: ContextVar[_Scope | None] = ContextVar("kvscope_budget", default=None)


class ComputeGate:
    """One model computation at a time. Among waiting requests the one with the least model time used goes
    first (least attained service); a request that finishes a computation while still the least served
    keeps the gate for ``hold_s`` to start its next one, so a short request runs its passes back to back
    instead of alternating with a long one."""

    def __init__(self, hold_s: float = 0.6) -> None:
        self.hold_s = hold_s
        self._condition = threading.Condition()
        self._busy = False
        self._waiting: dict[object, tuple[float, int]] = {}  # ticket -> (model seconds used, arrival)
        self._held: tuple[object, float] | None = None  # (ticket, until) after a release
        self._arrivals = 0

    def acquire(self, ticket: object, used_s: float) -> None:
        """Wait for this request's turn."""
        with self._condition:
            self._arrivals += 1
            self._waiting[ticket] = (used_s, self._arrivals)
            while True:
                held = self._held if self._held and self._held[0] is not ticket and time.monotonic() < self._held[1] else None
                if not self._busy and held is None and min(self._waiting, key=self._waiting.__getitem__) is ticket:
                    break
                self._condition.wait(None if held is None else max(held[1] - time.monotonic(), 0.001))
            del self._waiting[ticket]
            self._busy, self._held = True, None

    def release(self, ticket: object, used_s: float) -> None:
        """End this request's computation; hold the gate briefly for it if it is still the least served."""
        with self._condition:
            self._busy = False
            least = min((used for used, _ in self._waiting.values()), default=float("inf"))
            self._held = (ticket, time.monotonic() + self.hold_s) if self._waiting and used_s < least else None
            self._condition.notify_all()

    @property
    def waiting(self) -> int:
        """Requests waiting for their turn now."""
        with self._condition:
            return len(self._waiting)


@contextmanager
def bounded(budget: WorkBudget, gate: ComputeGate | None = None) -> Iterator[None]:
    """Run the enclosed request under ``budget``, taking turns at ``gate`` (None: no sharing)."""
    token = _SCOPE.set(_Scope(budget, gate))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def forward_token_limit() -> int:
    """New tokens one forward may run in the current request (at most ``MAX_FORWARD_TOKENS``)."""
    scope = _SCOPE.get()
    limit = None if scope is None else scope.budget.forward_tokens
    return min(limit, MAX_FORWARD_TOKENS) if limit else MAX_FORWARD_TOKENS


@contextmanager
def compute_slot(tokens: int = 0) -> Iterator[None]:
    """One forward or backward attending to ``tokens`` keys: checked against the request's budget first."""
    scope = _SCOPE.get()
    if scope is None or scope.holding:
        yield
        return
    budget = scope.budget
    if budget.max_context_tokens is not None and tokens > budget.max_context_tokens:
        raise BudgetExceeded(
            f"this request needs {tokens:,} tokens of context; {budget.profile} allows at most {budget.max_context_tokens:,}: "
            "shorten the scenario (context, skills or turns)"
        )
    if budget.seconds is not None and scope.used_s >= budget.seconds:
        raise BudgetExceeded(
            f"stopped after {scope.forwards} model passes and {scope.used_s:.1f} s of model time: {budget.profile} gives one "
            f"request at most {budget.seconds:g} s; use a shorter scenario or fewer strategies, probes or turns"
        )
    if scope.gate:
        scope.gate.acquire(scope.ticket, scope.used_s)
    started = time.perf_counter()
    scope.holding = True
    try:
        yield
    finally:
        scope.holding = False
        scope.used_s += time.perf_counter() - started
        scope.forwards += 1
        if scope.gate:
            scope.gate.release(scope.ticket, scope.used_s)
