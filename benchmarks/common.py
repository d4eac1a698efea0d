"""Shared helpers of the benchmark scripts: each folder's results, the environment and the CPU a number was measured
on, neutral filler text, the one percentile definition, the min/median/max of repeated runs, and a loopback server's
port (timing: :mod:`kvscope.engine.timing`)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import socket
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import torch

from kvscope.engine.models import LoadedModel, load_model

ROOT = Path(__file__).resolve().parents[1]  # the repository
FILLER = (
    "The team met on Tuesday, reviewed the backlog, and agreed to revisit the schedule next week. "
    "Notes were shared in the usual channel and nobody raised further questions. "
)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
PERCENTILE = "linear interpolation between closest ranks (numpy's default 'linear')"  # what every p50/p90/p99 is


BUNDLED_LOGS = "coding_agent,support_agent,rag"  # the bundled request logs a benchmark runs by default (demos/logs/*.jsonl)


def results_dir(script: str) -> Path:
    """Where a benchmark script writes by default: the ``results`` folder beside it (pass its ``__file__``)."""
    return Path(script).resolve().parent / "results"


def filler_text(lm: LoadedModel, tokens: int) -> str:
    """Neutral meeting-log text of about ``tokens`` tokens (cut at a sentence boundary)."""
    sentences, text = FILLER.split(". "), ""
    while len(lm.tokenizer(text, add_special_tokens=False).input_ids) < tokens:
        text += ". ".join(sentences).strip() + " "
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    return lm.tokenizer.decode(ids).rsplit(".", 1)[0] + "."


def environment(lm: LoadedModel) -> dict:
    """What the numbers were measured on."""
    return {
        "model": lm.fingerprint.name,
        "dtype": lm.fingerprint.dtype,
        "device": str(lm.device),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The CPU's model name, its logical cores, and whether it has each of ``CPU_FLAGS`` (the instruction sets that
    decide float32 and bfloat16 speed); the flags are all False where /proc/cpuinfo is absent."""
    info = {"machine": platform.machine(), "model_name": platform.processor() or None, "cores": None, **dict.fromkeys(CPU_FLAGS, False)}
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return info
    fields = [(key.strip(), value.strip()) for key, _, value in (line.partition(":") for line in lines)]
    flags = set(next((value.split() for key, value in fields if key == "flags"), []))
    name = next((value for key, value in fields if key == "model name"), info["model_name"])
    return {**info, "model_name": name, "cores": sum(key == "processor" for key, _ in fields), **{f: f in flags for f in CPU_FLAGS}}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``: :data:`PERCENTILE`, as ``numpy.percentile`` computes it."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: Sequence[float], digits: int = 3, runs: bool = False) -> dict:
    """Min, median and max of repeated measurements, rounded to ``digits`` (with every run when ``runs``)."""
    if not values:
        raise ValueError("spread of no values")
    summary = {"min": round(min(values), digits), "median": round(statistics.median(values), digits), "max": round(max(values), digits)}
    return summary | ({"runs": list(values)} if runs else {})


def write_result(name: str, lm: LoadedModel, data: dict, folder: Path) -> Path:
    """Write <folder>/<name>-<model>-<device>.json with the environment and return its path (a hub id's ``/`` as ``_``)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = lm.fingerprint.name.split(":")[0].replace("/", "_")
    path = folder / f"{name}-{model}-{lm.device.type}.json"
    path.write_text(json.dumps({**environment(lm), **data}, indent=2))
    return path


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the model options every benchmark takes."""
    result = argparse.ArgumentParser(description=doc.splitlines()[0])
    result.add_argument("--model", default="embedded", help="model spec (alias, HF id or local dir)")
    result.add_argument("--device", default="auto")
    result.add_argument("--dtype", default="auto")
    return result


def load(args: argparse.Namespace) -> LoadedModel:
    """The model the options name, with load progress printed."""
    return load_model(args.model, device=args.device, dtype=args.dtype, progress=print)


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_serving(url: str, timeout: float) -> None:
    """Poll ``url`` until it answers HTTP 200; TimeoutError after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")
