"""The CPU math settings: the MKL branch pin (only on AMD CPUs with AVX2, never over the user's own setting), and the
output projection given its rows with fresh strides."""

import os

import pytest
import torch
import torch.nn.functional as F

from kvscope.engine.models.cpu_math import keep_output_rows_dense, tune_cpu_math
from kvscope.engine.models.tiny import tiny_model

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


def test_the_output_projection_gets_its_rows_with_fresh_strides_and_the_same_logits():
    lm = tiny_model("qwen2", dtype=torch.bfloat16)  # loaded models carry the hook
    projection, seen = lm.model.get_output_embeddings(), []
    projection.register_forward_pre_hook(lambda module, args: seen.append(args[0].stride()))  # runs after the loader's
    ids = torch.arange(10, 30)[None]
    with torch.inference_mode():
        kept = lm.model(input_ids=ids, logits_to_keep=1).logits
        hidden = lm.model.model(input_ids=ids).last_hidden_state
    width = hidden.shape[-1]
    assert hidden[:, -1:].stride() == (20 * width, width, 1)  # the slice a kept row arrives as
    assert seen == [(width, width, 1)]
    assert torch.equal(kept, F.linear(hidden[:, -1:], projection.weight))  # the same numbers as the slice gives


def test_a_model_without_an_output_projection_is_left_alone():
    class Encoder(torch.nn.Module):
        def get_output_embeddings(self):
            return None

    assert keep_output_rows_dense(Encoder()) is None
