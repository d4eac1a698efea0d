"""The model pass's progress a forward at a time, with the time it has left.

The sampled turns' steps are known before the first forward: per turn its reference (the newer request as a prefix
cache serves it, with the older request's state computed first where no earlier turn computed it), then each repair.
A step is a reading: its prompt's forwards, then one forward per greedy token, and every forward moves the bar (a
step of the coding agent's log runs about 33 forwards), not every step.

The time left is estimated from the steps finished, each kind apart (a reference prefills most of the newer request;
a repair computes a few tokens after the cached ones, recompute reads the reference's state, a repair that does not
apply costs nothing): the mean time of each kind (the reference, or one repair), times the steps of that kind still to
run, plus what the running step has left of its kind's mean. A repair not timed yet takes the mean of the repairs
timed; until a reference and a repair have ended, nothing is estimated and the bar moves by steps and by forwards
within the step. Once an estimate stands, the bar is the time spent over the time spent and left, so it moves at the
speed the work goes; it never moves back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvscope.engine.progress import MessageProgress, StepMessage, duration_words

REPORT_EVERY_S = 1.0  # at most one message a second between steps (every step's start and end are said)
RESOLUTION = 1000  # a message's done / total: the model pass's fraction in thousandths
REFERENCE = "the reference"


class ModelPassMeter:
    """The model pass of ``turns`` measured turns, each its reference and then ``repairs`` (names), each reading
    ``tokens`` greedy tokens, said to ``report`` as :class:`~kvscope.engine.progress.StepMessage` lines ("measuring turn 2
    of 3: erratum (step 10 of 21); 45% of the model pass, 1 min 05 s so far, about 1 min 20 s left")."""

    def __init__(
        self,
        turns: int,
        repairs: tuple[str, ...],
        tokens: int,
        report: MessageProgress | None,
        clock: Callable[[], float] = time.perf_counter,
        every_s: float | None = None,
    ) -> None:
        self.turns, self.repairs, self.tokens, self.report, self.clock = turns, repairs, tokens, report, clock
        self.every_s = REPORT_EVERY_S if every_s is None else every_s
        self.total = turns * (len(repairs) + 1)
        self.done = 0  # steps finished
        self.forwards = 0  # forwards of the running step
        self._times: dict[str, list[float]] = {}  # kind (the reference, a repair) -> seconds of each finished step
        self._shown = 0.0  # the fraction said last: the bar never moves back
        self._started = self._step_started = self._said = clock()

    # ------------------------------------------------------------------------------------------------ the hooks
    def begin(self) -> None:
        """The model pass starts: said at 0."""
        self._started = self._step_started = self.clock()
        self._say(force=True)

    def forward(self, new_tokens: int) -> None:
        """One forward of the running step ran (``new_tokens``: its new tokens; every forward counts the same)."""
        self.forwards += 1
        self._say()

    def step_done(self) -> None:
        """The running step (a reference or a repair) ended."""
        now = self.clock()
        if self.done < self.total:
            self._times.setdefault(self._kind(self.done), []).append(now - self._step_started)
            self.done += 1
        self._step_started, self.forwards = now, 0
        self._say(force=True)

    # ------------------------------------------------------------------------------------------------ the estimate
    def left_s(self) -> float | None:
        """Seconds the model pass has left (None before any step has ended)."""
        if self.done >= self.total:
            return 0.0
        if REFERENCE not in self._times or (self.repairs and len(self._times) == 1):
            return None  # a reference prefills most of a request, a repair a few tokens: one of each is timed first
        running = max(self._mean(self._kind(self.done)) - (self.clock() - self._step_started), 0.0)
        return running + sum(self._mean(self._kind(step)) for step in range(self.done + 1, self.total))

    def fraction(self) -> float:
        """How far the model pass is, from 0 to 1: by time where an estimate stands, else by steps and forwards."""
        if self.done >= self.total:
            return 1.0
        left = self.left_s()
        if left is not None:
            spent = self.clock() - self._started
            at = spent / (spent + left) if spent + left > 0 else 0.0
        else:
            within = min(self.forwards / (self.forwards + self.tokens), 0.99)  # forwards beyond ``tokens``: prefills
            at = (self.done + within) / max(self.total, 1)
        return max(at, self._shown)

    def words(self) -> str:
        """Where the pass stands, in one line."""
        if self.done >= self.total:
            spent = duration_words(self.clock() - self._started)
            return f"measured {self.turns} turn{'s' * (self.turns != 1)} ({self.total} steps) in {spent}"
        turn, name, left = self.done // (len(self.repairs) + 1), self._kind(self.done), self.left_s()
        estimate = "time left estimated once a reference and a repair have ended" if left is None else f"about {duration_words(left)} left"
        return (
            f"measuring turn {turn + 1} of {self.turns}: {name} (step {self.done + 1} of {self.total}); "
            f"{self.fraction():.0%} of the model pass, {duration_words(self.clock() - self._started)} so far, {estimate}"
        )

    def _kind(self, step: int) -> str:
        """The reference, or the repair's name, of step ``step`` (from 0)."""
        index = step % (len(self.repairs) + 1)
        return REFERENCE if index == 0 else self.repairs[index - 1]

    def _mean(self, kind: str) -> float:
        """The mean time of a kind's finished steps (see the module docstring for a kind not timed yet)."""
        timed = self._times.get(kind) or [seconds for other, times in self._times.items() if other != REFERENCE for seconds in times]
        return sum(timed) / len(timed)

    def _say(self, force: bool = False) -> None:
        now = self.clock()
        if self.report is None or (not force and now - self._said < self.every_s):
            return
        self._said, words = now, self.words()
        self._shown = self.fraction()
        self.report(StepMessage(words, round(self._shown * RESOLUTION), RESOLUTION))
