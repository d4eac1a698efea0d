#!/usr/bin/env bash
# Install each real client library whose exports KVScope reads into its own virtual environment in the KVScope cache
# dir (they pin conflicting versions of openai, wrapt and OpenTelemetry), once, and print each environment's python,
# one line per client, in the order asked. Progress and errors go to stderr.
#
#   bash scripts/client_envs.sh [otel-2.3b0 otel-2.4b0 litellm langfuse langfuse-5 helicone]  # the default: every client
#
# A client's pins are benchmarks/interop/clients/<client>.txt; a marker (REQUIREMENTS) keys the environment to that
# file's content and the python version, so an edited pin rebuilds it. benchmarks/interop/client_exports.py runs the
# clients against llama-server and stores their exports.
set -euo pipefail
cd "$(dirname "$0")/.."
root="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/clients"
clients=("$@")
[ ${#clients[@]} -gt 0 ] || clients=(otel-2.3b0 otel-2.4b0 litellm langfuse langfuse-5 helicone)
for client in "${clients[@]}"; do
  pins="benchmarks/interop/clients/$client.txt"
  [ -f "$pins" ] || { echo "no client $client: $pins is missing" >&2; exit 2; }
  dest="$root/$client"
  marker="$(sha256sum "$pins" | cut -d' ' -f1) python$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [ ! -x "$dest/bin/python" ] || [ "$(cat "$dest/REQUIREMENTS" 2>/dev/null)" != "$marker" ]; then
    rm -rf "$dest"
    echo "installing $client into $dest (once)" >&2
    python -m venv "$dest"
    "$dest/bin/python" -m pip install -q --upgrade pip >&2
    "$dest/bin/python" -m pip install -q -r "$pins" >&2 || { echo "$client did not install (see above); removed" >&2; rm -rf "$dest"; exit 1; }
    echo "$marker" > "$dest/REQUIREMENTS"
  fi
  echo "$dest/bin/python"
done
