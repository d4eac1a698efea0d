#!/usr/bin/env bash
# The LiteLLM proxy in front of a vLLM server, with KVScope's policy hook.
#
#   bash scripts/litellm_proxy.sh                 # install once; prints the environment's python as the last line
#   bash scripts/litellm_proxy.sh serve --upstream http://127.0.0.1:8000/v1 --model embedded --policy policy.json
#        [--port 4000] [--dir DIR] [--no-hook]
#
# Install: `litellm[proxy]` (pinned) goes into its own virtual environment in the KVScope cache dir, as
# scripts/vllm_cpu.sh does for vLLM, so its many pins never meet the project's environment. The hook imports no torch:
# the proxy finds kvscope through PYTHONPATH (this repository), not through an install. A marker (VERSION) keys the
# environment to the pin, so an older one is rebuilt; it is kept only after `import litellm.proxy.proxy_server` worked.
#
# serve: writes DIR/config.yaml (default: a fresh temporary folder), one model routed to the upstream vLLM's
# OpenAI-compatible API (`hosted_vllm/<model>`) and `litellm_settings: callbacks:` naming KVScope's hook
# (deploy/litellm/kvscope_hook.py, found through PYTHONPATH), which loads the policy file KVSCOPE_POLICY names (set
# for the proxy, and written in the config's `environment_variables`); `--no-hook` leaves the callbacks out (the
# baseline). A malformed policy stops the proxy at start, with the field and the reason. The proxy listens on 127.0.0.1 only and runs in the foreground (exec): stop it with Ctrl-C or
# a signal. It asks for a master key (LITELLM_MASTER_KEY, else a random one), written to DIR/master_key for clients.
# Progress goes to stderr.
set -euo pipefail
version=1.108.7  # the newest whose proxy extras (litellm-proxy-extras, litellm-enterprise) this machine's index holds
repo="$(cd "$(dirname "$0")/.." && pwd)"
dest="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/litellm-proxy"
marker="litellm[proxy]==$version python$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
hook="kvscope_hook.proxy_handler_instance"  # deploy/litellm/kvscope_hook.py: the CustomLogger instance the proxy loads

install() {
  # shellcheck source=scripts/cache_env.sh
  source "$repo/scripts/cache_env.sh"
  cache_env "$dest" "$marker" "import litellm.proxy.proxy_server" "litellm[proxy]==$version"
}

serve() {
  local upstream="" model="" policy="" port=4000 dir="" with_hook=1
  while [ $# -gt 0 ]; do
    case "$1" in
      --upstream) upstream="$2"; shift 2 ;;
      --model) model="$2"; shift 2 ;;
      --policy) policy="$2"; shift 2 ;;
      --port) port="$2"; shift 2 ;;
      --dir) dir="$2"; shift 2 ;;
      --no-hook) with_hook=0; shift ;;
      *) echo "litellm_proxy.sh serve: unknown argument $1" >&2; exit 2 ;;
    esac
  done
  [ -n "$upstream" ] || { echo "litellm_proxy.sh serve: --upstream URL (vLLM's http://127.0.0.1:PORT/v1) is required" >&2; exit 2; }
  [ -n "$model" ] || { echo "litellm_proxy.sh serve: --model NAME (vLLM's --served-model-name) is required" >&2; exit 2; }
  case "$upstream" in
    http://127.0.0.1:*|http://localhost:*) ;;
    *) echo "litellm_proxy.sh serve: --upstream must be on loopback (http://127.0.0.1:PORT/v1), got $upstream" >&2; exit 2 ;;
  esac
  if [ "$with_hook" = 1 ]; then
    [ -f "$policy" ] || { echo "litellm_proxy.sh serve: --policy FILE (kvscope audit LOG --policy-out FILE) is required; got '$policy'" >&2; exit 2; }
    policy="$(cd "$(dirname "$policy")" && pwd)/$(basename "$policy")"
  fi
  dir="${dir:-$(mktemp -d)}"
  mkdir -p "$dir"
  {
    echo "model_list:"
    echo "  - model_name: $model"
    echo "    litellm_params:"
    echo "      model: hosted_vllm/$model"
    echo "      api_base: $upstream"
    echo "      api_key: none"
    if [ "$with_hook" = 1 ]; then
      echo "environment_variables:"
      echo "  KVSCOPE_POLICY: $policy"
      echo "litellm_settings:"
      echo "  callbacks: $hook"
    fi
  } > "$dir/config.yaml"
  # The proxy refuses to start without a master key; a client sends it as `Authorization: Bearer KEY`.
  local key="${LITELLM_MASTER_KEY:-sk-$(python -c 'import secrets; print(secrets.token_hex(24))')}"
  (umask 077 && printf '%s\n' "$key" > "$dir/master_key")
  echo "LiteLLM proxy on http://127.0.0.1:$port -> $upstream (config $dir/config.yaml, key in $dir/master_key)" >&2
  cd "$dir"
  LITELLM_MASTER_KEY="$key" KVSCOPE_POLICY="$policy" PYTHONPATH="$repo:$repo/deploy/litellm${PYTHONPATH:+:$PYTHONPATH}" LITELLM_TELEMETRY=False LITELLM_LOCAL_MODEL_COST_MAP=True DISABLE_SCHEMA_UPDATE=True \
    exec "$dest/bin/litellm" --config "$dir/config.yaml" --host 127.0.0.1 --port "$port" --num_workers 1
}

install
if [ "${1:-}" = serve ]; then
  shift
  serve "$@"
fi
echo "$dest/bin/python"
