"""Computed-once values under concurrency: one computation per key, every concurrent caller waits for it.

Like Go's ``singleflight``: the first caller of a key computes; callers arriving meanwhile block until it is
done and get the same value, or the same exception. A failure is not kept, so a later call tries again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, MutableMapping
from typing import Generic, TypeVar

V = TypeVar("V")


class _Flight(Generic[V]):
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: V | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[V]):
    """Deduplicates concurrent computations of the same key (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, _Flight[V]] = {}

    def run(self, key: Hashable, compute: Callable[[], V]) -> V:
        """``compute()``, run once however many threads ask for ``key`` at the same time."""
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        if leader:
            try:
                flight.value = compute()
            except BaseException as error:  # noqa: BLE001 - handed to every waiter, then re-raised
                flight.error = error
            finally:
                with self._lock:
                    del self._flights[key]
                flight.done.set()
        else:
            flight.done.wait()
        if flight.error is not None:
            raise flight.error
        return flight.value  # type: ignore[return-value]

    def cached(self, store: MutableMapping, key: Hashable, compute: Callable[[], V], keep: Callable[[], bool] = lambda: True) -> V:
        """``store[key]``, computed once on a miss and stored whole (never half built) when ``keep()`` still holds."""

        def compute_and_store() -> V:
            try:
                return store[key]  # another flight finished between our miss and our turn
            except KeyError:
                pass
            value = compute()
            if keep():
                store[key] = value
            return value

        try:
            return store[key]
        except KeyError:
            return self.run((id(store), key), compute_and_store)
