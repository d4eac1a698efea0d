"""Bounded work: a per-request budget (model time, context length) and a fair gate for shared models.

A server wraps each request in :func:`bounded`; every forward (and backward) of the engine runs inside
:func:`compute_slot`, which refuses a context over the budget's token limit before computing anything,
stops the request cleanly between forwards once its model time is spent, and, when a :class:`ComputeGate`
is given, takes turns with the other requests: the request that has used the least model time goes next
(least attained service), so a short edit never waits behind a long request for more than one forward.
Outside :func:`bounded` nothing is limited (the CLI, tests, local scripts) but the new tokens of one forward
(``MAX_FORWARD_TOKENS``).

Long work names itself (:func:`labelled`, e.g. "calibrating remedy auto: prompt 3/8"), so a request waiting at the
gate is told what it waits for (:func:`waits_reported`); work run under :func:`cancellable` stops before its next
forward once its :class:`CancelToken` is cancelled, raising :class:`Cancelled`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from kvscope.engine.errors import KVScopeError
from kvscope.engine.progress import MessageProgress


class BudgetExceeded(KVScopeError):
    """A request asked for more than this server allows (context length or model time); nothing was kept."""


class Cancelled(KVScopeError):
    """Work stopped between two forwards because it was cancelled; the message says what stopped and what was kept."""


class CancelToken:
    """A cooperative stop: :meth:`cancel` from any thread; the work checks it before each forward (:func:`cancellable`)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = "cancelled"

    def cancel(self, reason: str) -> None:
        """Stop the work before its next forward; ``reason`` becomes the :class:`Cancelled` message."""
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise :class:`Cancelled` once cancelled."""
        if self._event.is_set():
            raise Cancelled(self.reason)


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
    label: str = "another request"  # what requests waiting behind this one's forwards are told (see labelled)
    on_wait: MessageProgress | None = None  # told what this request waits for at the gate (see waits_reported)


# New tokens one forward runs at most, in any request (a budget's limit only lowers it); longer work runs as
# exact chunks. Masks are explicit, so a forward's attention costs its tokens × every key it is given. Tiny
# llama on CPU (1 thread, peak RSS): an 8k-token prefill took 4.0 s and 1.07 GB in one forward, 2.1 s and
# 0.51 GB in 1,024-token chunks; an 8k-token edit (stale, oracle and four strategies read together) 28 s and
# 4.3 GB in one fused forward, 6.3 s and 0.63 GB in chunks.
MAX_FORWARD_TOKENS = 1024

_SCOPE: ContextVar[_Scope | None] = ContextVar("kvscope_budget", default=None)
_CANCEL: ContextVar[CancelToken | None] = ContextVar("kvscope_cancel", default=None)
CANCEL_POLL_S = 0.05  # how often a request waiting at the gate checks its cancel token


class ComputeGate:
    """One model computation at a time. Among waiting requests the one with the least model time used goes
    first (least attained service); a request that finishes a computation while still the least served
    keeps the gate for ``hold_s`` to start its next one, so a short request runs its passes back to back
    instead of alternating with a long one. The gate keeps each request's label, so a waiting one can be told
    what it waits for."""

    def __init__(self, hold_s: float = 0.6) -> None:
        self.hold_s = hold_s
        self._condition = threading.Condition()
        self._busy: object | None = None  # the ticket computing now
        self._waiting: dict[object, tuple[float, int]] = {}  # ticket -> (model seconds used, arrival)
        self._labels: dict[object, str] = {}  # ticket -> label, for the computing, held and waiting tickets
        self._held: tuple[object, float] | None = None  # (ticket, until) after a release
        self._arrivals = 0

    def acquire(
        self,
        ticket: object,
        used_s: float,
        label: str = "another request",
        on_wait: MessageProgress | None = None,
        cancel: CancelToken | None = None,
    ) -> None:
        """Wait for this request's turn, telling ``on_wait`` what it waits for whenever that changes; a cancelled
        ``cancel`` token stops the wait with :class:`Cancelled`."""
        told = None
        with self._condition:
            self._arrivals += 1
            self._waiting[ticket] = (used_s, self._arrivals)
            self._labels[ticket] = label
            try:
                while True:
                    if cancel is not None:
                        cancel.check()
                    held = self._held if self._held and self._held[0] is not ticket and time.monotonic() < self._held[1] else None
                    if self._busy is None and held is None and min(self._waiting, key=self._waiting.__getitem__) is ticket:
                        break
                    ahead = self._ahead(ticket)
                    if on_wait is not None and ahead != told:
                        on_wait(f"waiting for the model: {ahead}")
                        told = ahead
                    timeout = None if held is None else max(held[1] - time.monotonic(), 0.001)
                    if cancel is not None:
                        timeout = CANCEL_POLL_S if timeout is None else min(timeout, CANCEL_POLL_S)
                    self._condition.wait(timeout)
            except BaseException:
                del self._waiting[ticket]
                self._prune()
                self._condition.notify_all()
                raise
            del self._waiting[ticket]
            self._busy, self._held = ticket, None

    def release(self, ticket: object, used_s: float) -> None:
        """End this request's computation; hold the gate briefly for it if it is still the least served."""
        with self._condition:
            self._busy = None
            least = min((used for used, _ in self._waiting.values()), default=float("inf"))
            self._held = (ticket, time.monotonic() + self.hold_s) if self._waiting and used_s < least else None
            self._prune()
            self._condition.notify_all()

    def _prune(self) -> None:
        """Keep only the labels of the computing, holding and waiting tickets (call with the lock held)."""
        active = {*self._waiting, self._busy, self._held[0] if self._held else None}
        self._labels = {ticket: label for ticket, label in self._labels.items() if ticket in active}

    def _ahead(self, ticket: object) -> str:
        """The label of the work ``ticket`` waits for: the computing request, else the holding one, else the waiting
        request that goes first (call with the lock held)."""
        held = self._held[0] if self._held and time.monotonic() < self._held[1] else None
        others = [other for other in self._waiting if other is not ticket]
        first = self._busy or held or (min(others, key=self._waiting.__getitem__) if others else None)
        return self._labels.get(first, "another request")

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


@contextmanager
def labelled(label: str) -> Iterator[Callable[[str], None]]:
    """Within: requests waiting at the gate behind this one's forwards are told ``label``; yields a function that
    changes it as the work goes on (outside :func:`bounded` labels go nowhere)."""
    scope = _SCOPE.get()
    previous = scope.label if scope else None

    def relabel(text: str) -> None:
        if scope is not None:
            scope.label = text

    relabel(label)
    try:
        yield relabel
    finally:
        if scope is not None:
            scope.label = previous


@contextmanager
def waits_reported(report: MessageProgress | None) -> Iterator[None]:
    """Within: each wait of this request at the gate tells ``report`` what it waits for ("waiting for the model: …")."""
    scope = _SCOPE.get()
    previous = scope.on_wait if scope else None
    if scope is not None:
        scope.on_wait = report
    try:
        yield
    finally:
        if scope is not None:
            scope.on_wait = previous


@contextmanager
def cancellable(token: CancelToken) -> Iterator[None]:
    """Within: every forward first checks ``token`` (and a wait at the gate stops), raising :class:`Cancelled`."""
    reset = _CANCEL.set(token)
    try:
        yield
    finally:
        _CANCEL.reset(reset)


def forward_token_limit() -> int:
    """New tokens one forward may run in the current request (at most ``MAX_FORWARD_TOKENS``)."""
    scope = _SCOPE.get()
    limit = None if scope is None else scope.budget.forward_tokens
    return min(limit, MAX_FORWARD_TOKENS) if limit else MAX_FORWARD_TOKENS


@contextmanager
def compute_slot(tokens: int = 0) -> Iterator[None]:
    """One forward or backward attending to ``tokens`` keys: checked against the cancel token and the request's
    budget first."""
    scope = _SCOPE.get()
    cancel = _CANCEL.get()
    if scope is not None and scope.holding:
        yield
        return
    if cancel is not None:
        cancel.check()
    if scope is None:
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
        scope.gate.acquire(scope.ticket, scope.used_s, scope.label, scope.on_wait, cancel)
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
