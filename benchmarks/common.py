"""Shared helpers of the benchmark scripts: neutral filler text, result files (timing: :mod:`engine.timing`)."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from engine.models import LoadedModel, load_model

RESULTS = Path(__file__).parent / "results"
FILLER = (
    "The team met on Tuesday, reviewed the backlog, and agreed to revisit the schedule next week. "
    "Notes were shared in the usual channel and nobody raised further questions. "
)


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


def write_result(name: str, lm: LoadedModel, data: dict, folder: Path = RESULTS) -> Path:
    """Write <folder>/<name>-<model>-<device>.json (default folder: benchmarks/results) and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{lm.fingerprint.name.split(':')[0]}-{lm.device.type}.json"
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
