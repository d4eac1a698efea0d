"""The request budget: context refused before any forward, model time stopped between forwards, fair turns."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvscope.engine.cache.budget import (
    BudgetExceeded,
    Cancelled,
    CancelToken,
    ComputeGate,
    WorkBudget,
    bounded,
    cancellable,
    compute_slot,
    labelled,
    waits_reported,
)
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.models.tiny import tiny_model


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def test_over_long_context_is_refused_before_computing(lm):
    notebook = Notebook.prefill(lm, list(range(5, 105)))
    with bounded(WorkBudget(max_context_tokens=64, profile="the public profile")):
        with pytest.raises(BudgetExceeded, match=r"100 tokens of context; the public profile allows at most 64"):
            notebook.materialized()
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
        gate.acquire(name, used)
        order.append(name)
        gate.release(name, used + 100.0)  # more served than anyone: no hold

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


def test_a_forward_token_limit_changes_no_number(lm):
    """Under a new-token limit, pending work runs in chunks and fused reads in batches: the same K/V and decisions."""
    from kvscope.engine.edit.experiment import EditExperiment
    from kvscope.engine.scenario import Scenario
    from tests.shared import SAME_LENGTH_SCENARIO

    names = ["field_only", "erratum", "field_erratum", "full_downstream"]
    free = EditExperiment(lm, Scenario.from_toml(SAME_LENGTH_SCENARIO)).report(names, fused=True)
    with bounded(WorkBudget(forward_tokens=7)):
        experiment = EditExperiment(lm, Scenario.from_toml(SAME_LENGTH_SCENARIO))
        limited = experiment.report(names, fused=True)
        notebook = Notebook.prefill(lm, list(range(5, 45)))
        keys = notebook.keys
    assert torch.allclose(keys[1], Notebook.prefill(lm, list(range(5, 45))).keys[1], atol=1e-5)
    for name in ["stale", "oracle", *names]:
        a, b = getattr(free, name, None) or free.strategies[name], getattr(limited, name, None) or limited.strategies[name]
        assert a.decision.margin == pytest.approx(b.decision.margin, abs=1e-4), name
        assert torch.allclose(a.decision.next_token_logits, b.decision.next_token_logits, atol=1e-4), name


def test_forward_token_limit_bounds_every_forward(lm, monkeypatch):
    from kvscope.engine.cache import adapter

    sizes = []
    original = adapter.forward

    def counting(model, keys, values, key_positions, input_ids, *args, **kwargs):
        sizes.append(len(input_ids))
        return original(model, keys, values, key_positions, input_ids, *args, **kwargs)

    monkeypatch.setattr(adapter, "forward", counting)
    with bounded(WorkBudget(forward_tokens=16)):
        notebook = Notebook.prefill(lm, list(range(5, 105)))
        forks = [notebook.append([7, 8, 9]), notebook.append([10] * 12), notebook.recompute(list(range(50, 100)))]
        Notebook.read_many(forks, [3, 4], {"a": [[5]], "b": [[6]]})
    assert max(sizes) <= 16 + 2 and len(sizes) >= 100 // 16


def test_a_short_request_keeps_the_gate_between_its_passes():
    gate, order = ComputeGate(hold_s=0.5), []
    gate.acquire("short", 0.1)
    waiter = threading.Thread(target=lambda: (gate.acquire("long", 40.0), order.append("long"), gate.release("long", 41.0)))
    waiter.start()
    time.sleep(0.05)
    gate.release("short", 0.2)  # still the least served: the gate waits for its next pass
    time.sleep(0.02)
    gate.acquire("short", 0.2)
    order.append("short")
    gate.release("short", 50.0)  # now more served than the waiter: no hold
    waiter.join(5)
    assert order == ["short", "long"]


def _holding(gate: ComputeGate, label: str, seconds: float) -> threading.Thread:
    """A thread computing one ``seconds``-long forward at ``gate`` under ``label``, started once it holds the gate."""
    ready = threading.Event()

    def hold() -> None:
        with bounded(WorkBudget(), gate), labelled(label), compute_slot():
            ready.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    ready.wait(5)
    return thread


def test_a_waiting_request_is_told_what_it_waits_for():
    gate, waits = ComputeGate(), []
    holder = _holding(gate, "calibrating remedy auto for m: prompt 3/8, remedy blend:0.15", 0.3)
    with bounded(WorkBudget(), gate), waits_reported(waits.append), compute_slot():
        pass
    holder.join(5)
    assert waits == ["waiting for the model: calibrating remedy auto for m: prompt 3/8, remedy blend:0.15"]
    with bounded(WorkBudget(), gate), waits_reported(waits.append), compute_slot():
        pass  # nobody computes: no wait, nothing said
    assert len(waits) == 1


def test_a_label_is_restored_when_its_work_ends():
    gate, waits = ComputeGate(), []
    ready, release = threading.Event(), threading.Event()

    def holder() -> None:
        with bounded(WorkBudget(), gate):
            with labelled("compiling a skill") as relabel:
                relabel("compiling a skill: 2 of 3")
            with compute_slot():  # outside the labelled work: the request's own default label
                ready.set()
                release.wait(5)

    thread = threading.Thread(target=holder)
    thread.start()
    ready.wait(5)
    waiter = threading.Thread(target=lambda: _wait_once(gate, waits))
    waiter.start()
    time.sleep(0.1)
    release.set()
    for each in (thread, waiter):
        each.join(5)
    assert waits == ["waiting for the model: another request"]


def _wait_once(gate: ComputeGate, waits: list[str]) -> None:
    with bounded(WorkBudget(), gate), waits_reported(waits.append), compute_slot():
        pass


def test_cancelled_work_stops_before_its_next_forward_and_while_it_waits(lm):
    token = CancelToken()
    with cancellable(token):
        notebook = Notebook.prefill(lm, list(range(5, 25))).materialized()
        token.cancel("stopped by the test; nothing was kept")
        with pytest.raises(Cancelled, match="stopped by the test; nothing was kept"):
            notebook.append([7, 8]).materialized()
    assert notebook.append([7, 8]).materialized().keys[0].shape[2] == 22, "outside its scope the token stops nothing"
    gate, waiting, release = ComputeGate(), CancelToken(), threading.Event()
    held = threading.Event()

    def forward() -> None:  # a forward that ends only when the test releases it: no clock decides the order
        with bounded(WorkBudget(), gate), labelled("a long forward"), compute_slot():
            held.set()
            release.wait(30)

    holder = threading.Thread(target=forward)
    holder.start()
    held.wait(5)
    threading.Timer(0.1, waiting.cancel, args=("cancelled while waiting",)).start()
    with bounded(WorkBudget(), gate), cancellable(waiting), pytest.raises(Cancelled, match="cancelled while waiting"):
        with compute_slot():
            pass
    assert holder.is_alive(), "the wait stopped before the holder's forward ended"
    assert gate.waiting == 0
    release.set()
    holder.join(5)
    with bounded(WorkBudget(), gate), compute_slot():  # the gate is free for the next request
        pass
