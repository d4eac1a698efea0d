"""Plain transformers, the reference a CLI audit is timed against (``benchmarks.studies.audit_cli``): one process that
imports torch and transformers, loads a model and, for each prompt, runs a clean prefill and its greedy tokens.

    python -m benchmarks.studies.plain_generation JOB.json

JOB.json: ``{"model_dir", "dtype", "tokens", "stop_ids", "prompts": [[token ids], ...]}``. Each prompt is prefilled
from nothing (no cache shared between prompts) and ``tokens`` greedy tokens are generated (``generate``, greedy, SDPA,
``stop_ids`` ending it), as the audit reads a prompt. Prints one JSON line: the seconds of the imports, the load
and the prompts. Nothing of KVScope is imported here: this is what the same work costs without it.
"""

from __future__ import annotations

import json
import sys
import time

STARTED = time.perf_counter()

import torch  # noqa: E402  (the imports are part of what is timed)
from transformers import AutoModelForCausalLM  # noqa: E402


def main(path: str) -> dict:
    job = json.loads(open(path, encoding="utf-8").read())
    imported = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=getattr(torch, job["dtype"]), attn_implementation="sdpa")
    model.eval()
    stop = list(job["stop_ids"])
    loaded = time.perf_counter()
    generated = []
    with torch.no_grad():
        for ids in job["prompts"]:
            prompt = torch.tensor([ids])
            output = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=job["tokens"],
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=stop[0] if stop else None,
            )
            generated.append(output.shape[1] - prompt.shape[1])
    done = time.perf_counter()
    return {"import_s": imported - STARTED, "load_s": loaded - imported, "prompts_s": done - loaded, "generated": generated}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
