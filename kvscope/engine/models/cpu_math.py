"""How the CPU math libraries are driven: process-level settings applied before torch first runs a kernel, and a
model-level fix that keeps the output projection on its fast path."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

CPUINFO = Path("/proc/cpuinfo")


def tune_cpu_math(cpuinfo: Path = CPUINFO) -> str | None:
    """Pin MKL's AVX2 code branch on AMD CPUs with AVX2; returns the branch set, or None.

    MKL dispatches a generic GEMM path on non-Intel CPUs; with its AVX2 branch, a fused edit of the
    embedded model (206 tokens) ran 12–18% faster on this project's 2-core AMD EPYC machines. MKL reads
    ``MKL_CBWR`` before its first call and ignores a branch the CPU lacks; a value the user set is kept.
    """
    if "MKL_CBWR" in os.environ or not cpuinfo.exists():
        return None
    text = cpuinfo.read_text(errors="replace")
    if "AuthenticAMD" not in text or " avx2" not in text:
        return None
    os.environ["MKL_CBWR"] = "AVX2"
    return "AVX2"


def keep_output_rows_dense(model: PreTrainedModel) -> RemovableHandle | None:
    """Give the output projection its rows with fresh strides; returns the hook's handle (None: no output projection).

    A forward that keeps the logits of its last rows (``logits_to_keep``) hands the projection a slice of the hidden
    states, shape (1, k, hidden) with the full sequence's batch stride. Torch counts it contiguous, yet its bfloat16
    CPU linear then takes a batched-matmul path that copies the whole transposed weight first: on the embedded model
    (a 151,936 × 896 projection) 0.5–0.9 s a forward, where the same row viewed afresh takes 16–32 ms. A view copies
    nothing, and the logits are the same bit for bit (``benchmarks/studies/forward_paths.py``). The engine's own forwards
    keep rows by index (a copy already); this serves the model's other callers: attribution, ROME and the weight
    update, and whoever calls the model or ``generate`` directly.
    """
    projection = model.get_output_embeddings()
    if projection is None:
        return None
    return projection.register_forward_pre_hook(_fresh_strides)


def _fresh_strides(_module: torch.nn.Module, args: tuple) -> tuple:
    rows, *rest = args
    return (rows.view(rows.shape), *rest)
