"""The self-test judges each error against the dtype's measured noise floor, and still catches wrong rotations."""

import dataclasses

import pytest
import torch

from kvscope.engine.cache import rope
from kvscope.engine.cache.notebook import Notebook
from kvscope.engine.cache.rope import RotaryTable
from kvscope.engine.cache.selftest import NOISE_FACTOR, run_selftest
from kvscope.engine.models.tiny import tiny_model

DTYPES = (torch.float32, torch.bfloat16)
# half-split, qk-norm, soft-capping with a window, partial rotary, YaRN (fp32 on every arch: test_rope.py)
VARIANTS = ("llama", "qwen3", "gemma2", "phi", "yarn")


def _wrong_base_tables(module: torch.nn.Module, positions: torch.Tensor, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of a rotary base of 500 (the tiny models use 10,000 or more), half-split like llama's and phi's."""
    dim = 2 * module.inv_freq.numel()
    inverse = 1.0 / 500.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inverse
    return torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), dim=-1).sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", VARIANTS)
def test_selftest_passes_in_both_dtypes_with_limits_from_measured_noise(arch, dtype):
    report = run_selftest(tiny_model(arch, dtype=dtype))
    assert report.ok, report.summary()
    eps = torch.finfo(dtype).eps
    assert eps <= report.kv_noise_floor <= 0.1 and eps <= report.logit_noise_floor <= 0.1
    limits = {check.name: check.limit for check in report.checks}
    assert limits["reposition"] == pytest.approx(NOISE_FACTOR * report.kv_noise_floor)
    assert limits["splice moved"] == pytest.approx(NOISE_FACTOR * report.logit_noise_floor)
    if dtype is torch.float32:
        assert report.kv_noise_floor < 1e-5 and report.reposition_vs_prefill_max_err < 1e-5
    else:  # bfloat16 rounding: the floor sits near its machine epsilon (2^-7)
        assert report.kv_noise_floor < 0.05 and report.reposition_vs_prefill_max_err < 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ("llama", "phi"))
def test_selftest_fails_for_an_off_by_one_position_delta(arch, dtype, monkeypatch):
    lm = tiny_model(arch, dtype=dtype)
    rotate = RotaryTable.rotate
    monkeypatch.setattr(RotaryTable, "rotate", lambda self, keys, deltas: rotate(self, keys, deltas + 1))
    report = run_selftest(lm)
    assert not report.ok
    failed = {check.name for check in report.failed}
    assert {"round trip", "reposition"} <= failed
    assert report.reposition_vs_prefill_max_err > 4 * NOISE_FACTOR * report.kv_noise_floor
    assert "FAILED" in report.summary() and "reposition" in report.summary()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("arch", ("llama", "phi"))
def test_selftest_fails_for_a_wrong_rotary_base(arch, dtype, monkeypatch):
    lm = tiny_model(arch, dtype=dtype)
    monkeypatch.setattr(rope, "_unscaled_tables", _wrong_base_tables)
    report = run_selftest(lm)
    assert not report.ok
    assert "reposition" in {check.name for check in report.failed}
    assert report.rope_roundtrip_max_err < NOISE_FACTOR * torch.finfo(dtype).eps, "a consistent wrong base still round-trips"


def test_selftest_fails_when_the_noise_floor_itself_is_not_rounding(monkeypatch):
    """A prefill whose values depend on where it starts (beyond rounding) must not widen every limit into a pass."""
    lm = tiny_model("llama")
    prefill = Notebook.prefill.__func__

    def drifting(cls, *args, start_position=0, **kwargs):
        notebook = prefill(cls, *args, start_position=start_position, **kwargs).materialized()
        if start_position:
            notebook = dataclasses.replace(notebook, computed_values=tuple(1.5 * v for v in notebook.computed_values))
        return notebook

    monkeypatch.setattr(Notebook, "prefill", classmethod(drifting))
    report = run_selftest(lm)
    assert not report.ok
    assert "noise floor (K/V)" in {check.name for check in report.failed}


@pytest.fixture
def rotation_off_by_one(monkeypatch):
    """Re-rotation one position off: what the self-test exists to catch."""
    move = rope.Rotary.move
    monkeypatch.setattr(rope.Rotary, "move", lambda self, keys, values, deltas, entries=None: move(self, keys, values, deltas + 1, entries))


def test_the_splice_gate_refuses_every_splice_once_the_selftest_fails(rotation_off_by_one):
    from kvscope.engine.cache.loaded import SpliceLocked

    lm = tiny_model("qwen2")
    prefix, block = Notebook.prefill(lm, [5, 6, 7], "prefix"), Notebook.prefill(lm, [8, 9], "block").block("block")
    with pytest.raises(
        SpliceLocked, match=r"splicing stays locked on tiny-qwen2: its cache self-test failed \(FAILED in float32.*reposition [0-9.e-]+ > "
    ):
        prefix.splice(block)
    report = lm.splice_gate.report(lm)
    assert not report.ok and {check.name for check in report.failed} >= {"reposition", "splice", "splice moved"}


def test_the_splice_gate_runs_the_selftest_once_for_concurrent_first_splices(monkeypatch):
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from kvscope.engine.cache import loaded

    calls = []

    def counted(lm):
        calls.append(1)
        time.sleep(0.2)
        return run_selftest(lm)

    lm = tiny_model("llama")
    lm.splice_gate = loaded.SpliceGate(counted)
    prefix, block = Notebook.prefill(lm, [5, 6, 7], "prefix"), Notebook.prefill(lm, [8, 9], "block").block("block")
    barrier = threading.Barrier(6)

    def splice_after_barrier(_):
        barrier.wait()
        return prefix.splice(block).keys[0]

    with ThreadPoolExecutor(6) as pool:
        logits = list(pool.map(splice_after_barrier, range(6)))
    assert len(calls) == 1 and all(torch.equal(logits[0], other) for other in logits[1:])


def test_a_model_built_without_a_selftest_keeps_splicing_locked():
    from kvscope.engine.cache.loaded import SpliceGate, SpliceLocked

    lm = tiny_model("llama")
    lm.splice_gate = SpliceGate()
    with pytest.raises(SpliceLocked, match="built without a cache self-test"):
        Notebook.prefill(lm, [5, 6], "prefix").splice(Notebook.prefill(lm, [8, 9], "block").block("block"))
