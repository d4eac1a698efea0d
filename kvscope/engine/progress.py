"""Progress callbacks, one home for both kinds: messages while a model loads, steps while a computation runs.

A front end passes its own callback (the CLI prints to stderr, the app moves a gr.Progress bar); engine code
never prints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

MessageProgress = Callable[[str], None]  # "assembling embedded GGUF 2/6", …
StepProgress = Callable[[int, int], None] | None  # (done, total), or None for no report
Tick = Callable[[], None]  # one more step done


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


def duration_words(seconds: float) -> str:
    """A duration as a person reads it in a progress line: "40 s", "3 min 05 s", "1 h 12 min"."""
    whole = max(round(seconds), 0)
    if whole < 60:
        return f"{whole} s"
    minutes, rest = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"
