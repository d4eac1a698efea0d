"""Wall time, one way: the stopwatch every engine result's ``ms`` and every benchmark's repetitions use.

Times include a device synchronisation where an accelerator runs asynchronously, so they measure the work.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


def _synchronise() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Stopwatch:
    """Started on creation; :attr:`ms` is the wall time since then (device work included)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    @property
    def ms(self) -> float:
        _synchronise()
        return (time.perf_counter() - self.started) * 1000


@dataclass(frozen=True)
class Spread:
    """Wall times of repeated runs in ms: median, min, max (benchmarks report all three)."""

    median: float
    min: float
    max: float
    reps: int

    @classmethod
    def of(cls, times: list[float]) -> "Spread":
        return cls(statistics.median(times), min(times), max(times), len(times))

    def as_dict(self) -> dict:
        return {"median": round(self.median, 1), "min": round(self.min, 1), "max": round(self.max, 1), "reps": self.reps}


def timed(function: Callable[[], T]) -> tuple[T, float]:
    """``function()`` and its wall time in ms."""
    watch = Stopwatch()
    result = function()
    return result, watch.ms


def repeated(function: Callable[[int], T], reps: int, warmup: int = 0) -> tuple[T, Spread]:
    """The last result of ``function(rep)`` over ``reps`` timed calls after ``warmup`` untimed ones, and their spread."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    for rep in range(warmup):
        function(rep)
    times, result = [], None
    for rep in range(reps):
        result, ms = timed(lambda: function(rep))
        times.append(ms)
    return result, Spread.of(times)


def side_by_side(functions: Mapping[str, Callable[[], T]], reps: int, warmup: int = 1) -> tuple[dict[str, T], dict[str, Spread]]:
    """Each function's last result and the spread of its wall times, measured in alternation in one call: ``warmup``
    untimed rounds of every function (one-time work), then ``reps`` timed rounds, each running every function once,
    so that load which comes and goes falls on every side alike."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    results: dict[str, T] = {}
    for _ in range(warmup):
        for name, function in functions.items():
            results[name] = function()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(reps):
        for name, function in functions.items():
            results[name], ms = timed(function)
            times[name].append(ms)
    return results, {name: Spread.of(values) for name, values in times.items()}
