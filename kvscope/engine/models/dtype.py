"""Choosing the dtype when the caller says "auto".

On a GPU: bfloat16 where it computes it natively, else float16 (`accelerator_dtype`). On a CPU, bfloat16 only
where it is measured faster than float32, its logits agree with float32's and the cache self-test passes in it
(`load_with_cpu_dtype_choice`); the choice and its reason are remembered per model, torch version and CPU in
`<cache>/dtype-choices.json`. The self-test lives above the notebook, which only needs `kvscope.engine.cache.loaded`,
so importing it here makes no cycle.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from kvscope.engine.cache import selftest
from kvscope.engine.cache.loaded import DTYPES, LoadedModel, config_hash
from kvscope.engine.models.store import cache_dir, read_json, write_json
from kvscope.engine.progress import MessageProgress

_PROBE_TOKENS = 64
_PROBE_REPS = 3
_GIVE_UP_FACTOR = 2.0
_BF16_MIN_SPEEDUP = 1.2
_BF16_MIN_COSINE = 0.999


def accelerator_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the GPU supports it, else float16."""
    with torch.cuda.device(device):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_with_cpu_dtype_choice(
    load: Callable[[torch.dtype], PreTrainedModel],
    loaded: Callable[[PreTrainedModel, str], LoadedModel],
    name: str,
    config: PretrainedConfig,
    report: MessageProgress,
) -> LoadedModel:
    """On CPU use bfloat16 only where it is measured faster, its logits agree with float32 and the cache
    self-test passes in it; the choice and its reason are cached per model + CPU + torch version."""
    store = cache_dir() / "dtype-choices.json"
    key = f"{name}|{config_hash(config)}|torch {torch.__version__}|{_cpu_model()}"
    choices = read_json(store)
    if key in choices and "reason" in choices[key]:
        return loaded(load(DTYPES[choices[key]["dtype"]]), choices[key]["reason"])
    report("measuring float32 vs bfloat16 prefill speed on this CPU (one time)")
    fp32, bf16 = load(torch.float32), load(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.get_text_config().vocab_size, (1, _PROBE_TOKENS), generator=generator)
    (fp32_s, fp32_logits), (bf16_s, bf16_logits) = _time_prefills(fp32, bf16, ids)
    cosine = torch.nn.functional.cosine_similarity(fp32_logits, bf16_logits, dim=0).item()
    speedup = fp32_s / bf16_s
    selftest_ok = None
    if speedup >= _BF16_MIN_SPEEDUP and cosine >= _BF16_MIN_COSINE:
        report("running the cache self-test in bfloat16 (one time)")
        selftest_ok = selftest.run_selftest(loaded(bf16, "candidate")).ok
    use_bf16 = bool(selftest_ok)
    measured = f"one-thread prefill of {_PROBE_TOKENS} tokens: bfloat16 {speedup:.2f}× the speed of float32, logits cosine {cosine:.5f}"
    if use_bf16:
        reason = f"auto: bfloat16 ({measured}; cache self-test ok in bfloat16)"
    elif selftest_ok is False:
        reason = f"auto: float32 (bfloat16 is faster here but failed the cache self-test; {measured})"
    else:
        reason = f"auto: float32 (bfloat16 needs ≥ {_BF16_MIN_SPEEDUP}× speed and cosine ≥ {_BF16_MIN_COSINE}; {measured})"
    choices[key] = {
        "dtype": "bfloat16" if use_bf16 else "float32",
        "float32_s": round(fp32_s, 4),
        "bfloat16_s": round(bf16_s, 4),
        "cosine": round(cosine, 6),
        "selftest_ok": selftest_ok,
        "tokens": _PROBE_TOKENS,
        "reason": reason,
    }
    write_json(store, choices)
    report(reason)
    return loaded(bf16 if use_bf16 else fp32, reason)


def _time_prefills(
    fp32: PreTrainedModel, bf16: PreTrainedModel, ids: torch.Tensor
) -> tuple[tuple[float, torch.Tensor], tuple[float, torch.Tensor]]:
    """Best-of-N seconds of one prefill per model, and each one's last-token logits (as fp32).

    One thread, passes interleaved: other load on the machine then hits both dtypes alike instead
    of skewing the ratio. Stops early once bfloat16 is clearly slower (common without native bf16).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in (fp32, bf16):
            _timed_prefill(model, ids[:, :4])  # one-time kernel setup stays out of the timings
        (fp32_s, fp32_logits), (bf16_s, bf16_logits) = _timed_prefill(fp32, ids), _timed_prefill(bf16, ids)
        times: tuple[list[float], list[float]] = ([fp32_s], [bf16_s])
        for _ in range(_PROBE_REPS - 1):
            if times[1][-1] > _GIVE_UP_FACTOR * min(times[0]):
                break
            times[0].append(_timed_prefill(fp32, ids)[0])
            times[1].append(_timed_prefill(bf16, ids)[0])
    finally:
        torch.set_num_threads(threads)
    return (min(times[0]), fp32_logits), (min(times[1]), bf16_logits)


def _timed_prefill(model: PreTrainedModel, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds for one prefill of `ids`, and the last-token logits as fp32."""
    with torch.inference_mode():
        started = time.perf_counter()
        logits = model(ids, use_cache=False).logits[0, -1].float()
        return time.perf_counter() - started, logits


def _cpu_model() -> str:
    """The CPU's model name, for keying measurements."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()
