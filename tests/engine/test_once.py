"""Computed-once values: one computation per key however many threads ask, and a failure reaches every waiter."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvscope.engine.once import SingleFlight

THREADS = 8


def _slow_counter(result, calls: list, error: Exception | None = None):
    def compute():
        calls.append(threading.get_ident())
        time.sleep(0.2)  # long enough for every thread to arrive while the first computes
        if error is not None:
            raise error
        return result

    return compute


def _at_once(call, threads: int = THREADS) -> list:
    barrier = threading.Barrier(threads)

    def wait_then_call():
        barrier.wait()
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - collected for the assertions
            return error

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda _: wait_then_call(), range(threads)))


def test_concurrent_callers_share_one_computation():
    flight, calls, value = SingleFlight(), [], object()
    results = _at_once(lambda: flight.run("k", _slow_counter(value, calls)))
    assert len(calls) == 1 and all(result is value for result in results)


def test_a_failure_reaches_every_waiter_and_is_not_kept():
    flight, calls, error = SingleFlight(), [], ValueError("broken")
    results = _at_once(lambda: flight.run("k", _slow_counter(None, calls, error)))
    assert len(calls) == 1 and all(result is error for result in results)
    assert flight.run("k", lambda: 3) == 3  # the next call computes again


def test_cached_stores_once_and_reads_the_store_afterwards():
    flight, calls, store = SingleFlight(), [], {}
    results = _at_once(lambda: flight.cached(store, "k", _slow_counter([1, 2], calls)))
    assert len(calls) == 1 and store == {"k": [1, 2]} and all(result is store["k"] for result in results)
    assert flight.cached(store, "k", lambda: pytest.fail("computed again")) is store["k"]
    flight.cached(store, "gone", lambda: 5, keep=lambda: False)
    assert "gone" not in store
