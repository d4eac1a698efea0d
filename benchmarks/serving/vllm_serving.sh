#!/usr/bin/env bash
# Serving benchmark on a GPU machine, driven by the same client as the CPU run (benchmarks/serving/serving.py); every
# server listens on 127.0.0.1 only. Not run in CI. Needs vLLM >= 0.11.1 (or SGLang) with the CUDA build that
# matches the machine, LMCache for ENGINE=lmcache, and the model in the local Hugging Face cache or a local path.
#
#   MODEL=Qwen/Qwen2.5-7B-Instruct bash benchmarks/serving/vllm_serving.sh                  # vLLM, automatic prefix caching
#   MODEL=Qwen/Qwen2.5-7B-Instruct ENGINE=lmcache bash benchmarks/serving/vllm_serving.sh   # then LMCache CacheBlend
#   ENGINE=sglang MODEL=Qwen/Qwen2.5-7B-Instruct bash benchmarks/serving/vllm_serving.sh    # SGLang RadixAttention
#
# ENGINE=vllm and sglang run both workloads: the field edit (erratum vs in-prefix; serving-<engine>.json) and the
# composed prompts (skill blocks in a rotating order; serving-<engine>-composed.json, whose answers are exact and
# serve as the clean reference). ENGINE=lmcache starts vLLM with LMCache's CacheBlend connector (prefix caching
# off, blending on, the settings of LMCache's examples/blend_kv_v1) and runs the composed workload against the
# clean answers in serving-vllm-composed.json (run ENGINE=vllm first), writing serving-lmcache-composed.json.
#
# Knobs (environment): ENGINE=vllm|sglang|lmcache, MODEL, SCENARIO (loan_approval: a bundled scenario name or a
# scenario file; a run stops if its clean-prefill answer does not follow the field on MODEL), PORT (8000),
# POLICY_TOKENS (8192), LOADS (0.5,1,1.5,2,4,8 requests/s), REQUESTS (64 per run), MAX_DURATION (120 s),
# MAX_TOKENS (8), MAX_MODEL_LEN (16384), SEPARATOR (text between composed blocks; LMCache splits chunks at its
# tokens: " # #" and a newline), BLEND_RATIO (0.15, CacheBlend's recompute ratio), EXTRA_SERVER_ARGS.
# The hit rate is each answer's usage.prompt_tokens_details.cached_tokens (vLLM: --enable-prompt-tokens-details;
# it counts connector-loaded tokens too), else the engine's /metrics counters or gauges.
# Server logs go to benchmarks/serving/results/<engine>-server.log.
set -euo pipefail
cd "$(dirname "$0")/../.."

ENGINE=${ENGINE:-vllm}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
SCENARIO=${SCENARIO:-loan_approval}
PORT=${PORT:-8000}
POLICY_TOKENS=${POLICY_TOKENS:-8192}
LOADS=${LOADS:-0.5,1,1.5,2,4,8}
REQUESTS=${REQUESTS:-64}
MAX_DURATION=${MAX_DURATION:-120}
MAX_TOKENS=${MAX_TOKENS:-8}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-16384}
SEPARATOR=${SEPARATOR:-$' # #\n'}
BLEND_RATIO=${BLEND_RATIO:-0.15}
EXTRA_SERVER_ARGS=${EXTRA_SERVER_ARGS:-}
URL="http://127.0.0.1:${PORT}"
RESULTS=benchmarks/serving/results
LOG="$RESULTS/${ENGINE}-server.log"
mkdir -p "$RESULTS"

export VLLM_SERVER_DEV_MODE=1   # vLLM's /reset_prefix_cache: the client empties the cache before every run
case "$ENGINE" in
  vllm)
    # shellcheck disable=SC2086
    python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$MODEL" \
      --host 127.0.0.1 --port "$PORT" --enable-prefix-caching --enable-prompt-tokens-details \
      --max-model-len "$MAX_MODEL_LEN" $EXTRA_SERVER_ARGS >"$LOG" 2>&1 &
    ;;
  sglang)
    # RadixAttention prefix caching is on unless --disable-radix-cache; metrics need --enable-metrics.
    # shellcheck disable=SC2086
    python -m sglang.launch_server --model-path "$MODEL" --served-model-name "$MODEL" \
      --host 127.0.0.1 --port "$PORT" --enable-metrics --context-length "$MAX_MODEL_LEN" \
      $EXTRA_SERVER_ARGS >"$LOG" 2>&1 &
    ;;
  lmcache)
    [ -f "$RESULTS/serving-vllm-composed.json" ] || { echo "run ENGINE=vllm first: its composed answers are the clean reference" >&2; exit 2; }
    python -m pip install -q --no-build-isolation --no-deps ./benchmarks/serving/lmcache_blend   # registers the model for CacheBlend (LMCache #4131)
    config="$RESULTS/lmcache-blend.yaml"
    # LMCache reads these from the file (environment variables would strip the separator's spaces).
    python - "$config" "$SEPARATOR" "$BLEND_RATIO" <<'PY'
import json, sys
path, separator, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
settings = {"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 20, "enable_blending": True, "use_layerwise": True,
            "blend_special_str": separator, "blend_check_layers": [1], "blend_recompute_ratios": [ratio]}
with open(path, "w") as out:
    out.writelines(f"{key}: {json.dumps(value)}\n" for key, value in settings.items())  # JSON values are YAML
PY
    # shellcheck disable=SC2086
    LMCACHE_CONFIG_FILE="$config" python -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name "$MODEL" \
      --host 127.0.0.1 --port "$PORT" --no-enable-prefix-caching --enforce-eager --enable-prompt-tokens-details \
      --kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}' \
      --max-model-len "$MAX_MODEL_LEN" $EXTRA_SERVER_ARGS >"$LOG" 2>&1 &
    ;;
  *)
    echo "ENGINE must be vllm, sglang or lmcache, got $ENGINE" >&2
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

run() {
  python -m benchmarks.serving.serving --engine "$ENGINE" --url "$URL" --model "$MODEL" --scenario "$SCENARIO" \
    --policy-tokens "$POLICY_TOKENS" --loads "$LOADS" --requests "$REQUESTS" \
    --max-duration "$MAX_DURATION" --max-tokens "$MAX_TOKENS" --separator "$SEPARATOR" "$@"
}
if [ "$ENGINE" = lmcache ]; then
  run --workload composed --clean-from "$RESULTS/serving-vllm-composed.json"
else
  run --workload edit
  run --workload composed
fi
