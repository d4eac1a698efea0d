"""The log's time order has one home (``reading.time_order``, over timestamps): by timestamp where every request has
one, stable on ties, else the log's order; the in-process reading and the distributed pass's count both use it."""

import math

import numpy as np

from kvscope.engine.audit.logs.reading import time_order, time_ordered
from kvscope.engine.audit.logs.requests import Request


def test_ties_keep_the_log_s_order_and_numbers_are_given_by_place():
    order = time_order([5.0, 1.0, 5.0, 1.0, 3.0])
    assert (order.order, order.untimed) == ("timestamps", 0)
    assert order.numbers.tolist() == [4, 1, 5, 2, 3]  # the two 1.0s, then 3.0, then the two 5.0s, each pair as logged
    assert [order.number(place) for place in range(5)] == [4, 1, 5, 2, 3]


def test_a_log_already_in_time_order_or_with_a_missing_timestamp_keeps_its_order():
    assert time_order([1.0, 1.0, 2.0]).numbers is None and time_order([1.0, 1.0, 2.0]).order == "timestamps"
    for missing in (None, math.nan):  # a request without its time: the whole log as logged
        order = time_order([3.0, missing, 1.0, None])
        assert (order.order, order.untimed, order.numbers) == ("log", 2, None)
        assert [order.number(place) for place in range(4)] == [1, 2, 3, 4]
    assert (time_order([]).order, time_order(np.zeros(0)).untimed) == ("log", 0)


def test_the_reading_puts_requests_in_that_order():
    requests = [Request(i, i, prompt=str(i), timestamp=t) for i, t in enumerate([5.0, 1.0, 5.0, 1.0], 1)]
    ordered, name, renumbered = time_ordered(requests)
    assert name == "timestamps" and [r.prompt for r in ordered] == ["2", "4", "1", "3"] and [r.index for r in ordered] == [1, 2, 3, 4]
    assert renumbered == {1: 3, 2: 1, 3: 4, 4: 2}
    untimed = [*requests[:3], Request(4, 4, prompt="4")]
    assert [r.prompt for r in time_ordered(untimed)[0]] == ["1", "2", "3", "4"] and time_ordered(untimed)[1] == "log"


def test_the_distributed_count_orders_by_the_same_function():
    from kvscope.engine.audit.distributed.ray_scan import LogCount
    from kvscope.engine.audit.logs.shards import ShardCount

    times = [np.array([5.0, 1.0]), np.array([5.0, 1.0, 3.0])]
    counts = [ShardCount(n, len(t), [], {"openai_chat": len(t)}, {}, t, []) for n, t in enumerate(times)]
    count = LogCount.of(counts)
    assert count.order == "timestamps" and count.indexes.tolist() == time_order([5.0, 1.0, 5.0, 1.0, 3.0]).numbers.tolist()
    counts[1] = ShardCount(1, 3, [], {}, {}, np.array([5.0, np.nan, 3.0]), [])
    assert (LogCount.of(counts).order, LogCount.of(counts).untimed, LogCount.of(counts).indexes) == ("log", 1, None)
