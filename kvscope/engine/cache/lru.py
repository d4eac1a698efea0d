"""A thread-safe mapping kept within a byte budget: every bounded store of the engine and the app uses it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any


class BudgetedLRU(MutableMapping):
    """A thread-safe mapping within a byte budget (least recently used dropped first) and an idle TTL.

    Entries are weighed with ``weigh`` when stored and again whenever they are used, since results grow
    after they are kept (an oracle read on demand, gradients); the most recent entry always stays.
    """

    def __init__(
        self, budget_bytes: int, weigh: Callable[[Any], int], ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.budget_bytes, self.ttl_s, self._weigh, self._clock = budget_bytes, ttl_s, weigh, clock
        self._items: OrderedDict[Hashable, list] = OrderedDict()  # key -> [value, bytes, last used]
        self._lock = threading.RLock()

    def __getitem__(self, key):
        with self._lock:
            self._expire()
            entry = self._items[key]
            entry[1], entry[2] = self._weigh(entry[0]), self._clock()
            self._items.move_to_end(key)
            return entry[0]

    def __setitem__(self, key, value) -> None:
        with self._lock:
            self._items[key] = [value, self._weigh(value), self._clock()]
            self._items.move_to_end(key)
            self._expire()
            while len(self._items) > 1 and self.nbytes > self.budget_bytes:
                self._items.popitem(last=False)

    def __delitem__(self, key) -> None:
        with self._lock:
            del self._items[key]

    def __iter__(self) -> Iterator:
        with self._lock:
            return iter(list(self._items))

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes of the entries as last weighed."""
        with self._lock:
            return sum(entry[1] for entry in self._items.values())

    def drop_where(self, condition: Callable[[Hashable], bool]) -> None:
        """Forget every entry whose key meets ``condition``."""
        with self._lock:
            for key in [key for key in self._items if condition(key)]:
                del self._items[key]

    def sweep(self) -> None:
        """Drop expired entries now."""
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        now = self._clock()
        while self._items and now - next(iter(self._items.values()))[2] > self.ttl_s:
            self._items.popitem(last=False)
