"""Progress callbacks, one home for both kinds: messages while a model loads, steps while a computation runs.

A front end passes its own callback (the CLI prints to stderr, the app moves a gr.Progress bar); engine code
never prints.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

MessageProgress = Callable[[str], None]  # "assembling embedded GGUF 2/6", …
StepProgress = Callable[[int, int], None] | None  # (done, total), or None for no report
Tick = Callable[[], None]  # one more step done
RATE_WINDOW = 10  # reports a rate is measured over (the token pass reports 50 times a phase)


class StepMessage(str):
    """A progress message that also says how far the work is: a plain ``str`` to every message callback, with
    ``done`` of ``total`` steps for a front end that draws a bar (:func:`fraction`)."""

    done: int
    total: int

    def __new__(cls, text: str, done: int, total: int) -> StepMessage:
        message = super().__new__(cls, text)
        message.done, message.total = done, total
        return message


def fraction(message: str) -> float | None:
    """How far the work of a message is, from 0 to 1; None for a message that does not say."""
    return message.done / max(message.total, 1) if isinstance(message, StepMessage) else None


def reporter(progress: MessageProgress | None, logger: logging.Logger) -> MessageProgress:
    """A message callback that also logs each message to ``logger``."""

    def report(message: str) -> None:
        logger.info(message)
        if progress is not None:
            progress(message)

    return report


def ticker(progress: StepProgress, total: int) -> Tick:
    """A callback advancing ``progress`` by one step of ``total`` (a step past it reports ``total`` again)."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(min(done, total), total)

    return tick


class StepRate:
    """A count of ``unit`` (``"token pass: requests"``) said with its rate and the time it has left: "token pass:
    requests: 5,000/100,000 · 1,234 requests/s · about 1 min 17 s left". The rate is measured over the last
    ``window`` reports (so a pass that slows down, as caches fill, is followed) and never before the first report (work
    done before it, such as tokenizing ahead, is not this count's), so the first report says the count alone."""

    def __init__(self, unit: str, clock: Callable[[], float] = time.perf_counter, window: int = RATE_WINDOW) -> None:
        self.unit, self.clock = unit, clock
        self.noun = unit.split()[-1]  # what is counted: "requests", "steps"
        self._said: deque[tuple[int, float]] = deque(maxlen=window + 1)  # (done, when) of the last reports, oldest first

    def rate(self, done: int) -> float | None:
        """Steps a second over the last reports, this one included (None: not measurable yet)."""
        now = self.clock()
        self._said.append((done, now))
        first_done, first_at = self._said[0]
        return (done - first_done) / (now - first_at) if done > first_done and now > first_at else None

    def words(self, done: int, total: int) -> str:
        """The count, with its rate and time left once measurable."""
        said = f"{self.unit}: {done:,}/{total:,}"
        rate = self.rate(done)
        if rate is None:
            return said
        said += f" · {rate:,.1f}" if rate < 10 else f" · {rate:,.0f}"
        seconds = (total - done) / rate
        left = "" if done >= total else " · under 1 s left" if seconds < 0.5 else f" · about {duration_words(seconds)} left"
        return f"{said} {self.noun}/s{left}"


def rated(unit: str, say: Callable[[str, int, int], None], clock: Callable[[], float] = time.perf_counter) -> StepProgress:
    """A step callback that says each count of ``unit`` with its rate and time left (:class:`StepRate`) to ``say``
    (text, done, total): the CLI's stderr line and the app's bar alike."""
    rate = StepRate(unit, clock)
    return lambda done, total: say(rate.words(done, total), done, total)


def duration_words(seconds: float) -> str:
    """A duration as a person reads it in a progress line: "40 s", "3 min 05 s", "1 h 12 min"."""
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole} s"
    minutes, rest = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"
