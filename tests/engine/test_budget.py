"""The request budget: context refused before any forward, model time stopped between forwards, fair turns."""
from __future__ import annotations

import threading
import time

import pytest

from engine.budget import BudgetExceeded, ComputeGate, WorkBudget, bounded, compute_slot
from engine.notebook import Notebook
from engine.tiny import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def test_over_long_context_is_refused_before_computing(lm):
    notebook = Notebook.prefill(lm, list(range(5, 105)))
    with bounded(WorkBudget(max_context_tokens=64, profile="the public profile")):
        started = time.perf_counter()
        with pytest.raises(BudgetExceeded, match=r"100 tokens of context; the public profile allows at most 64"):
            notebook.materialized()
        assert time.perf_counter() - started < 1.0
    assert notebook.pending_tokens == 100, "the refused notebook is unchanged and still usable"
    assert len(notebook.materialized().keys[0][0, 0]) == 100  # outside the budget it computes


def test_model_time_stops_the_request_between_forwards(lm):
    notebook = Notebook.prefill(lm, list(range(5, 40)))
    computed = 0
    with bounded(WorkBudget(seconds=0.0)):
        with pytest.raises(BudgetExceeded, match=r"stopped after 0 model passes .* at most 0 s"):
            notebook.append([7, 8]).materialized()
            computed += 1
    assert computed == 0
    with bounded(WorkBudget(seconds=60.0)):  # a generous budget changes nothing
        assert notebook.append([7, 8]).materialized().keys[0].shape[2] == 37


def test_budget_applies_only_inside_its_scope(lm):
    with bounded(WorkBudget(max_context_tokens=4)):
        pass
    assert Notebook.prefill(lm, list(range(5, 25))).materialized().keys[0].shape[2] == 20


def test_gate_serves_the_request_with_least_model_time_first():
    gate, order = ComputeGate(), []
    ready = threading.Event()

    def hold() -> None:
        with bounded(WorkBudget(), gate), compute_slot():
            ready.set()
            time.sleep(0.3)

    def request(name: str, used: float) -> None:
        with gate.turn(name, used):
            order.append(name)

    holder = threading.Thread(target=hold)
    holder.start()
    ready.wait()
    waiters = [threading.Thread(target=request, args=("long", 50.0)), threading.Thread(target=request, args=("short", 0.5))]
    for thread in waiters:
        thread.start()
        time.sleep(0.05)
    assert gate.waiting == 2
    for thread in (holder, *waiters):
        thread.join(5)
    assert order == ["short", "long"], "the request that used less model time goes first"
