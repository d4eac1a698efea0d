# Sourced by the scripts that install a tool into its own virtual environment in the KVScope cache dir
# (scripts/vllm_cpu.sh, scripts/litellm_proxy.sh), so that its pins never meet the project's environment.
#
# cache_env DEST MARKER CHECK REQUIREMENT...: DEST is kept if its VERSION file holds MARKER; else it is rebuilt: a fresh
# venv, pip upgraded, the requirements installed, `cache_env_after DEST` run where the caller defines it, and the
# python code CHECK run in it. The environment is kept (VERSION written) only if CHECK succeeds; else it is removed
# and cache_env returns 1. Progress and errors go to stderr.
cache_env() {
  local dest="$1" marker="$2" check="$3"
  shift 3
  if [ -x "$dest/bin/python" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$marker" ]; then
    return 0
  fi
  rm -rf "$dest"
  echo "installing $* into $dest (once)" >&2
  python -m venv "$dest"
  "$dest/bin/python" -m pip install -q --upgrade pip >&2
  "$dest/bin/python" -m pip install -q "$@" >&2
  if declare -F cache_env_after >/dev/null; then
    cache_env_after "$dest"
  fi
  "$dest/bin/python" -c "$check" >&2 || { echo "$* installed but its check fails (see above); removed" >&2; rm -rf "$dest"; return 1; }
  echo "$marker" > "$dest/VERSION"
}
