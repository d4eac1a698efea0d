"""The MKL branch pin: only on AMD CPUs with AVX2, never over the user's own setting."""

import os

import pytest

from kvscope.engine.models.cpu_math import tune_cpu_math

AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
INTEL = "vendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx avx2 avx512f\n"
OLD_AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx\n"


@pytest.mark.parametrize(("cpuinfo", "expected"), [(AMD, "AVX2"), (INTEL, None), (OLD_AMD, None)])
def test_branch_is_pinned_only_on_amd_with_avx2(tmp_path, monkeypatch, cpuinfo, expected):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert tune_cpu_math(path) == expected
    assert (expected is None) == ("MKL_CBWR" not in os.environ)


def test_user_setting_and_missing_cpuinfo_are_left_alone(tmp_path, monkeypatch):
    path = tmp_path / "cpuinfo"
    path.write_text(AMD)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert tune_cpu_math(path) is None and os.environ["MKL_CBWR"] == "COMPATIBLE"
    monkeypatch.delenv("MKL_CBWR")
    assert tune_cpu_math(tmp_path / "absent") is None
