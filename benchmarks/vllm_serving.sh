#!/usr/bin/env bash
# Serving benchmark on a GPU machine: vLLM (or SGLang) with automatic prefix caching on 127.0.0.1, driven by
# the same client as the CPU run (benchmarks/serving.py). Not run in CI. Needs vLLM (or SGLang) installed
# with the CUDA build matching the machine, and the model in the local Hugging Face cache or a local path.
#
#   MODEL=Qwen/Qwen2.5-7B-Instruct bash benchmarks/vllm_serving.sh
#   ENGINE=sglang MODEL=Qwen/Qwen2.5-7B-Instruct bash benchmarks/vllm_serving.sh
#
# Knobs (environment): ENGINE=vllm|sglang, MODEL, PORT (8000), POLICY_TOKENS (8192),
# LOADS (0.5,1,1.5,2,4,8 requests/s), REQUESTS (64 per run), MAX_DURATION (120 s), MAX_TOKENS (16),
# MAX_MODEL_LEN (16384), EXTRA_SERVER_ARGS. The hit rate comes from the engine's /metrics:
# vllm:prefix_cache_hits/queries (counters, per run as a difference), else gpu_prefix_cache_hit_rate
# (older vLLM) or sglang:cache_hit_rate (running gauges, reported as is).
# Writes benchmarks/results/serving-<engine>.json; the server log goes to benchmarks/results/<engine>-server.log.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-vllm}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
PORT=${PORT:-8000}
POLICY_TOKENS=${POLICY_TOKENS:-8192}
LOADS=${LOADS:-0.5,1,1.5,2,4,8}
REQUESTS=${REQUESTS:-64}
MAX_DURATION=${MAX_DURATION:-120}
MAX_TOKENS=${MAX_TOKENS:-16}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-16384}
EXTRA_SERVER_ARGS=${EXTRA_SERVER_ARGS:-}
URL="http://127.0.0.1:${PORT}"
LOG="benchmarks/results/${ENGINE}-server.log"
mkdir -p benchmarks/results

case "$ENGINE" in
  vllm)
    # Prefix caching is on by default in vLLM V1; the flag keeps it on for older releases too.
    # shellcheck disable=SC2086
    python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$MODEL" \
      --host 127.0.0.1 --port "$PORT" --enable-prefix-caching --max-model-len "$MAX_MODEL_LEN" \
      $EXTRA_SERVER_ARGS >"$LOG" 2>&1 &
    ;;
  sglang)
    # RadixAttention prefix caching is on unless --disable-radix-cache; metrics need --enable-metrics.
    # shellcheck disable=SC2086
    python -m sglang.launch_server --model-path "$MODEL" --served-model-name "$MODEL" \
      --host 127.0.0.1 --port "$PORT" --enable-metrics --context-length "$MAX_MODEL_LEN" \
      $EXTRA_SERVER_ARGS >"$LOG" 2>&1 &
    ;;
  *)
    echo "ENGINE must be vllm or sglang, got $ENGINE" >&2
    exit 2
    ;;
esac
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true' EXIT

echo "waiting for $ENGINE on $URL (log: $LOG)" >&2
for _ in $(seq 1 180); do
  if curl -sf --noproxy '*' "$URL/v1/models" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then echo "$ENGINE exited; see $LOG" >&2; tail -20 "$LOG" >&2; exit 1; fi
  sleep 5
done
curl -sf --noproxy '*' "$URL/v1/models" >/dev/null || { echo "$ENGINE not ready after 15 min; see $LOG" >&2; exit 1; }

python -m benchmarks.serving --engine "$ENGINE" --url "$URL" --model "$MODEL" \
  --policy-tokens "$POLICY_TOKENS" --loads "$LOADS" --requests "$REQUESTS" \
  --max-duration "$MAX_DURATION" --max-tokens "$MAX_TOKENS"
