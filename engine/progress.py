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


def reporter(progress: MessageProgress | None, logger: logging.Logger) -> MessageProgress:
    """A message callback that also logs each message to ``logger``."""

    def report(message: str) -> None:
        logger.info(message)
        if progress is not None:
            progress(message)

    return report


def ticker(progress: StepProgress, total: int) -> Tick:
    """A callback advancing ``progress`` by one step of ``total``."""
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    return tick
