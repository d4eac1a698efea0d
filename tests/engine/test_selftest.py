"""The self-test judges each error against the dtype's measured noise floor, and still catches wrong rotations."""
import dataclasses

import pytest
import torch

from engine.notebook import Notebook
from engine import rope
from engine.rope import RotaryTable
from engine.selftest import NOISE_FACTOR, run_selftest
from engine.tiny import tiny_model

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
