"""The audit's progress as one bar through the whole run, each message naming its phase, and its Cancel.

The phases, in order, with their share of the bar: reading the log, loading the model (or its tokenizer alone), the
token pass, measuring turn k of n (the model's work, most of the bar), the Notes scenario (two prefills of the model's
own answers), and the figures. A Cancel stops the run before its next forward (:class:`engine.CancelToken`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine import CancelToken, MessageProgress, StepMessage, StepProgress, cancellable

PHASES = {  # phase -> (start, end) of the bar
    "reading": (0.0, 0.02),
    "loading": (0.02, 0.05),
    "token pass": (0.05, 0.12),
    "measuring": (0.12, 0.9),
    "notes": (0.9, 0.97),
    "figures": (0.97, 1.0),
}
_STEPS = 1000  # the bar's resolution


class AuditPhases:
    """Messages for a progress callback, each a :class:`StepMessage` placed on the whole run's bar by its phase."""

    def __init__(self, progress: MessageProgress | None) -> None:
        self.progress = progress

    def report(self, phase: str, text: str, done: int = 0, total: int = 1) -> None:
        """``text``, with the bar at ``done`` of ``total`` through ``phase``."""
        if self.progress is None:
            return
        start, end = PHASES[phase]
        at = start + (end - start) * min(done / max(total, 1), 1.0)
        self.progress(StepMessage(text, round(at * _STEPS), _STEPS))

    def messages(self, phase: str) -> MessageProgress:
        """Plain messages (a model's loading steps) shown at the start of ``phase``."""
        return lambda text: self.report(phase, str(text))

    def steps(self, phase: str, unit: str) -> StepProgress:
        """``unit: done/total`` through ``phase``."""
        return lambda done, total: self.report(phase, f"{unit}: {done:,}/{total:,}", done, total)

    def turns(self, per_turn: int) -> StepProgress:
        """The measured steps (``per_turn`` a turn: the reference and each repair) as "measuring turn k of n"."""

        def measured(done: int, total: int) -> None:
            count = max(total // per_turn, 1)
            turn = min(done // per_turn + 1, count)
            self.report("measuring", f"measuring turn {turn} of {count} (step {done:,} of {total:,})", done, total)

        return measured


class AuditRuns:
    """The running audit of each session, so that its Cancel stops it (one at a time per session)."""

    def __init__(self) -> None:
        self._tokens: dict[str, CancelToken] = {}
        self._lock = threading.Lock()

    @contextmanager
    def running(self, session: str) -> Iterator[CancelToken]:
        """Within: the session's audit, stopped before its next forward once :meth:`cancel` is called."""
        token = CancelToken()
        with self._lock:
            self._tokens[session] = token
        try:
            with cancellable(token):
                yield token
        finally:
            with self._lock:
                if self._tokens.get(session) is token:
                    del self._tokens[session]

    def cancel(self, session: str) -> str:
        """Stop the session's audit; what was cancelled, in words (information, not an error)."""
        with self._lock:
            token = self._tokens.get(session)
        if token is None:
            return "No audit is running: nothing to cancel."
        token.cancel("the audit was cancelled before its token pass ended: nothing of it was kept")
        return (
            "Audit cancelled: it stops before its next forward; a finished token pass is shown (every request, the engines, "
            "observed against simulated), without measured turns. The tab is ready for another run."
        )
