"""KVScope's explorer entry point: ``kvscope-app`` (installed), ``python -m kvscope.app`` or ``python app.py`` (also the
Hugging Face Spaces entry point, a shim that calls :func:`main`).

The default model loads before the page is served (the first start converts the embedded GGUF once). On a ZeroGPU
Space (SPACES_ZERO_GPU set) it is staged instead, and every model-bound handler runs as a GPU task (kvscope/app/gpu.py,
docs/hosting-spaces.md). ``--public`` (automatic on a Space) serves the public hosting profile (kvscope/app/hosting.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Load the default model and serve the explorer."""
    parser = argparse.ArgumentParser(prog="kvscope-app", description="KVScope explorer")
    parser.add_argument("--model", default=os.environ.get("KVSCOPE_MODEL", "embedded"))
    parser.add_argument("--device", default=os.environ.get("KVSCOPE_DEVICE", "auto"))
    parser.add_argument("--dtype", default=os.environ.get("KVSCOPE_DTYPE", "auto"))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument(
        "--public",
        action="store_true",
        default=os.environ.get("KVSCOPE_PUBLIC", "") == "1",
        help="public hosting profile: allowlisted models, bounded context, work and memory (default on a Space)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported (--help imports none of it)
    from kvscope.app import gpu

    zero_gpu = gpu.on_zero_gpu()
    if zero_gpu:
        gpu.import_spaces()  # before anything touches CUDA: it patches torch
        gpu.check_cuda_build()

    from kvscope.app.hosting import from_env, limit_malloc_arenas, return_freed_memory_every
    from kvscope.app.state import ModelRegistry
    from kvscope.app.ui import build_app, theme
    from kvscope.engine import resolve_device

    limit_malloc_arenas()
    return_freed_memory_every()
    profile = from_env(args.public)
    print(f"KVScope hosting profile: {profile.name}", flush=True)
    registry = ModelRegistry(args.model, profile=profile, device=args.device, dtype=args.dtype)
    announce = lambda message: print(message, flush=True)  # noqa: E731
    if zero_gpu:
        registry.stage(resolve_device(args.device), progress=announce)  # dtype and self-test: in the first GPU task
    else:
        registry.get(progress=announce)  # the self-test runs on first page load
    blocks = build_app(registry)
    gpu.gpu_tasks(blocks, registry)  # off ZeroGPU: nothing changes
    blocks.queue(default_concurrency_limit=1).launch(
        server_name=args.host,
        server_port=args.port,
        theme=theme(),
        show_error=False,
        max_file_size=f"{profile.export_max_bytes // 2**20} mb" if profile.allowed_models is not None else None,
    )
