"""The model pass's progress and its shared work, on a tiny model: the meter starts at 0, moves a forward at a time,
estimates the time left from the steps finished and ends at 1; a rewrite measured after the audit takes the readings
the audit computed exactly as it would compute them (the same reuse, the same forwards), so its report is the one it
gives alone, bit for bit, for fewer forwards; and a state's cuts are the forwards the engine ran."""

import json

import pytest

from kvscope.engine.audit.logs.reading import read_log
from kvscope.engine.audit.measure import meter as meter_module
from kvscope.engine.audit.measure.kv_store import ComputedStates, forward_chunks
from kvscope.engine.audit.measure.meter import RESOLUTION, ModelPassMeter
from kvscope.engine.audit.measure.settings import measure_settings
from kvscope.engine.audit.measure.traffic import audit_traffic
from kvscope.engine.audit.rewrite.measure import measure_rewrite
from kvscope.engine.cache import budget
from kvscope.engine.models.tiny import tiny_model
from kvscope.engine.progress import fraction

SYSTEM = "You are the help desk of Northwind.\nSession started: {time}\nAccount tier: gold\nBe brief and exact."
HOISTED = "You are the help desk of Northwind.\nAccount tier: gold\nBe brief and exact."
TOKENS = 3


def _chat(system, *turns, session="s"):
    return json.dumps(
        {"user": session, "messages": [{"role": "system", "content": system}, *[{"role": r, "content": c} for r, c in turns]]}
    )


TURNS = [
    ("2026-05-12 09:41", [("user", "Where is my parcel?")]),
    ("2026-05-12 09:42", [("user", "Where is my parcel?"), ("assistant", "On its way."), ("user", "When?")]),
    (
        "2026-05-12 09:42",
        [("user", "Where is my parcel?"), ("assistant", "On its way."), ("user", "When?"), ("assistant", "Today."), ("user", "Thanks")],
    ),
]
LOG = "\n".join(_chat(SYSTEM.format(time=time), *turns) for time, turns in TURNS)
REWRITTEN = "\n".join(_chat(HOISTED, *turns[:-1], (turns[-1][0], turns[-1][1] + f"\n\nSession started: {time}")) for time, turns in TURNS)


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_meter_starts_at_zero_moves_by_forwards_then_by_time_and_ends_at_one():
    clock, said = _Clock(), []
    meter = ModelPassMeter(2, ("recompute", "erratum"), 4, said.append, clock=clock, every_s=0)
    meter.begin()
    assert fraction(said[-1]) == 0 and "turn 1 of 2: the reference (step 1 of 6)" in said[-1]
    assert "once a reference and a repair have ended" in said[-1]
    for _ in range(3):
        clock.now += 1
        meter.forward(1)
    assert 0 < fraction(said[-1]) < 1 / 6  # moving inside the first step, before any estimate
    clock.now += 1
    meter.step_done()  # the reference: 4 s
    for seconds in (1, 1):  # two repairs: 1 s each
        clock.now += seconds
        meter.step_done()
    assert "turn 2 of 2: the reference (step 4 of 6)" in said[-1]
    assert meter.left_s() == pytest.approx(4 + 1 + 1)  # a reference and two repairs, at their kinds' means
    assert fraction(said[-1]) == pytest.approx(6 / 12, abs=1 / RESOLUTION) and "about 6 s left" in said[-1]
    clock.now += 5
    meter.forward(1)
    assert meter.left_s() == pytest.approx(0 + 2)  # the running reference took longer than its mean: its part is 0
    for _ in range(3):
        clock.now += 1
        meter.step_done()
    assert fraction(said[-1]) == 1 and said[-1].startswith("measured 2 turns (6 steps)")


def test_the_meter_says_at_most_one_line_a_second_between_steps():
    clock, said = _Clock(), []
    meter = ModelPassMeter(1, ("recompute",), 8, said.append, clock=clock)
    meter.begin()
    for _ in range(10):
        clock.now += 0.25
        meter.forward(1)
    assert len(said) == 1 + 2  # the start, then one a second
    meter.step_done()
    assert len(said) == 4  # a step's end is always said


def test_the_audit_says_the_model_pass_a_forward_at_a_time_and_its_report_is_unchanged(lm, monkeypatch):
    monkeypatch.setattr(meter_module, "REPORT_EVERY_S", 0.0)
    said, steps = [], []
    plain = audit_traffic(lm, read_log(LOG), sample=2, measure=measure_settings(tokens=TOKENS)).as_dict()
    told = audit_traffic(
        lm,
        read_log(LOG),
        sample=2,
        measure=measure_settings(tokens=TOKENS),
        messages=said.append,
        progress=lambda d, t: steps.append((d, t)),
    )
    assert told.as_dict() == _untimed(plain, told.as_dict())
    fractions = [fraction(message) for message in said]
    assert fractions[0] == 0 and fractions[-1] == 1 and len(said) > len(steps) + 1  # forwards, not only steps
    assert steps[0] == (0, steps[-1][1]) and steps[-1][0] == steps[-1][1]  # the steps' callback as before


def _untimed(report: dict, like: dict) -> dict:
    """``report`` with every time taken from ``like`` (times differ run to run; nothing else may)."""
    report = json.loads(json.dumps(report))
    for turn, other in zip(report["turns"], like["turns"]):
        turn["full_ttft_ms"] = other["full_ttft_ms"]
        for name, result in turn["repairs"].items():
            for key in ("ttft_ms", "ttft_ratio"):
                result[key] = other["repairs"][name][key]
        if turn["recommendation"] is not None:
            turn["recommendation"] = other["recommendation"]  # its words quote the times
    return report


def test_a_rewrite_after_the_audit_takes_its_readings_and_reports_the_same(lm, monkeypatch):
    log, rewritten = read_log(LOG), read_log(REWRITTEN)
    alone = measure_rewrite(lm, log, rewritten, tokens=TOKENS)
    states = ComputedStates(lm, TOKENS)
    traffic = audit_traffic(lm, log, sample=2, measure=measure_settings(tokens=TOKENS), states=states)
    assert sorted(traffic.turns) == [2, 3]  # the audit read requests 2 and 3 as a prefix cache serves them
    ran = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: ran.append(k["input_ids"].shape[1]) or forward(*a, **k))
    shared = measure_rewrite(lm, log, rewritten, tokens=TOKENS, before=traffic.scan, reuse=states)
    assert shared == alone  # every KL, token and text the same, to the bit
    monkeypatch.setattr(lm.model, "forward", forward)
    counted = []
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: counted.append(k["input_ids"].shape[1]) or forward(*a, **k))
    measure_rewrite(lm, log, rewritten, tokens=TOKENS)
    assert sum(ran) < sum(counted)  # requests 2 and 3 were not computed again


def test_a_reading_computed_another_way_is_not_taken(lm):
    log = read_log(LOG)
    ids = [rendered.ids for rendered in audit_traffic(lm, log, sample=0).scan.rendered.values()]
    first = ComputedStates(lm, TOKENS)
    first.read_prompt(ids[1])  # request 2 from scratch: another reuse than after request 1
    second = ComputedStates(lm, TOKENS, reuse=first)
    second.read_prompt(ids[0])
    assert second.read_prompt(ids[1]) is not first.read_prompt(ids[1])  # read from request 1's state, computed here
    assert second.read_prompt(ids[1]).reused_tokens > 0


def test_a_state_s_chunks_are_the_forwards_the_engine_ran(lm, monkeypatch):
    monkeypatch.setattr(budget, "MAX_FORWARD_TOKENS", 8)
    ids = tuple(lm.tokenizer(" ".join(["word"] * 30), add_special_tokens=False).input_ids)
    ran = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: ran.append(k["input_ids"].shape[1]) or forward(*a, **k))
    store = ComputedStates(lm, 1)
    state = store.state(ids[:20])
    assert store.chunks_of(state) == forward_chunks(0, 20, 8) == ((0, 8), (8, 16), (16, 20)) and ran == [8, 8, 4]
    assert store.chunks_of(store.prefix(state, 10)) == ((0, 8), (8, 16))  # the forward behind entry 9 ran to 16
    ran.clear()
    reading = store.read_prompt(ids[:30])
    assert ran == [8, 2]  # 20 reused, 9 pending: 8 of them, then the last and the read token
    assert store.chunks_of(reading.notebook) == ((0, 8), (8, 16), (16, 20), (20, 28), (28, 30))
