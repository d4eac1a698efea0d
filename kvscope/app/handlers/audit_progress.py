"""The audit's progress as one bar through the whole run, each message naming its phase, and its Cancel.

The phases, in order, with their share of the bar: reading the log, loading the model (or its tokenizer alone), the
token pass, the model pass (most of the bar, said a forward at a time with its time left by the audit's own meter:
"measuring turn k of n: ..."), the Notes scenarios (two prefills of the model's own answers per changed field, said a
prefill at a time with its time left), and the figures. A Cancel stops the run before its next forward
(:class:`kvscope.engine.CancelToken`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvscope.engine import CancelToken, MessageProgress, StepMessage, StepProgress, duration_words, rated

PHASES = {  # phase -> (start, end) of the bar
    "reading": (0.0, 0.01),
    "loading": (0.01, 0.03),
    "token pass": (0.03, 0.05),  # the bar stands at 5% when the model's work begins
    "measuring": (0.05, 0.9),
    "notes": (0.9, 0.97),
    "figures": (0.97, 1.0),
}
_STEPS = 1000  # the bar's resolution
NOTES_LEAD = "Open in Notes"  # the notes phase's lines start with the button they prepare


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

    def steps(self, phase: str, unit: str, clock: Callable[[], float] = time.perf_counter) -> StepProgress:
        """``unit: done/total`` through ``phase``, with its rate and time left (the CLI's words: ``rated``)."""
        return rated(unit, lambda text, done, total: self.report(phase, text, done, total), clock)

    def model_pass(self) -> MessageProgress:
        """The model pass's own lines (``audit_traffic``'s ``messages``: a forward at a time, with the time left), each
        placed through the measuring phase by how far it says the pass is."""

        def said(message: str) -> None:
            done, total = (message.done, message.total) if isinstance(message, StepMessage) else (0, 1)
            self.report("measuring", str(message), done, total)

        return said

    def notes(self) -> None:
        """The Notes phase begins: the pre-checks of the changed fields."""
        self.report("notes", f"{NOTES_LEAD}: reading the model's own answers (two prefills per changed field)")

    def notes_steps(self, clock: Callable[[], float] = time.perf_counter) -> MessageProgress:
        """The Notes pre-checks' lines (``notes_choices``'s ``progress``: each prefill's start, a ``StepMessage``), each
        placed through the notes phase, with the prefills' mean time times those left once one has ended."""
        started = clock()

        def said(message: str) -> None:
            done, total = (message.done, message.total) if isinstance(message, StepMessage) else (0, 1)
            left = "timing the first" if done == 0 else f"about {duration_words((clock() - started) / done * (total - done))} left"
            self.report("notes", f"{NOTES_LEAD}: {message} (prefill {done + 1} of {total}; {left})", done, total)

        return said


class AuditRuns:
    """The running audit of each session, so that its Cancel stops it (one at a time per session)."""

    def __init__(self) -> None:
        self._tokens: dict[str, CancelToken] = {}
        self._lock = threading.Lock()

    @contextmanager
    def running(self, session: str) -> Iterator[CancelToken]:
        """Within: the session's audit, whose token :meth:`cancel` cancels; each step of the audit runs within
        ``cancellable(token)`` (a context that spans no yield of the tab's handler), so it stops before its next forward."""
        token = CancelToken()
        with self._lock:
            self._tokens[session] = token
        try:
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
