#!/usr/bin/env bash
# Build llama.cpp's C++ server (llama-server) for benchmarks/serving/serving.py and benchmarks/interop/cache_reuse.py, from the
# llama.cpp tree vendored in llama-cpp-python 0.3.36's source distribution (a pinned llama.cpp). The sdist comes
# from PyPI and is checked against its sha256; the build has no web UI and no network at run time.
# Portable: no -march=native. On x86-64 a fixed vector set (SSE4.2, AVX, AVX2, BMI2, FMA, F16C) with every AVX-512
# variant, AVX-VNNI and AMX off: the cached binary runs on every machine kind (AMD with AVX2 only, AMD with AVX-512
# and no AMX, Intel with AMX), and code for a vector set a CPU lacks dies with SIGILL. The Intel VMs do run AMX once
# a process asks for it (docs/serving.md, "SGLang on CPU"). Elsewhere (aarch64) GGML_NATIVE=OFF, defaults.
# The build flags are part of the cache key (SOURCE), and a binary is installed only after a smoke run on the
# embedded GGUF answered one token. Installs $KVSCOPE_CACHE_DIR/llama-server/bin/llama-server (about 10 min on
# 2 CPU cores) and prints its path; progress and errors go to stderr.
set -euo pipefail
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/llama-server"
flags=(-DGGML_NATIVE=OFF)
case "$(uname -m)" in
  x86_64 | amd64)
    flags+=(-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON
      -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
esac
source_line="llama-cpp-python $version $sha256 ${flags[*]}"
if [ -x "$dest/bin/llama-server" ] && [ "$(cat "$dest/SOURCE" 2>/dev/null)" = "$source_line" ]; then
  echo "$dest/bin/llama-server"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
echo "$sha256  $work/llama_cpp_python-$version.tar.gz" | sha256sum -c --quiet -
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
echo "building llama-server with ${flags[*]}" >&2
cmake -S "$work/llama_cpp_python-$version/vendor/llama.cpp" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${flags[@]}" >/dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)" >/dev/null

# Smoke run: the built server must load the embedded GGUF and complete one token over HTTP, or nothing is installed.
gguf=${KVSCOPE_SMOKE_GGUF:-$(cd "$repo" && python -c 'from kvscope.engine.models.gguf import embedded_gguf_path; print(embedded_gguf_path())' | tail -n 1)} ||
  { echo "smoke run failed: no embedded GGUF (see above; or set KVSCOPE_SMOKE_GGUF to a .gguf); the binary was not installed" >&2; exit 1; }
echo "smoke run: llama-server on $gguf" >&2
python - "$work/build/bin/llama-server" "$gguf" "$work/smoke.log" <<'PY'
import json, os, signal, socket, subprocess, sys, time, urllib.request

binary, gguf, log_path = sys.argv[1:4]
READY_S, ANSWER_S, STOP_S = 300, 180, 15  # every wait is bounded


def fail(what: str) -> None:
    try:
        with open(log_path, "rb") as log:
            tail = log.read().decode("utf-8", "replace").splitlines()[-25:]
    except OSError:
        tail = []
    sys.exit(f"smoke run failed: {what}; llama-server's last log lines:\n" + "\n".join("  " + line for line in tail)
             + "\nthe binary was not installed")


def status(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else "?"
        why = ", an illegal instruction: the CPU or its VM lacks one the build used" if -code == signal.SIGILL else ""
        return f"was killed by signal {-code} ({name}{why})"
    return f"exited with code {code}"


with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
base = f"http://127.0.0.1:{port}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never via a proxy
command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", "512", "-t", "2", "-tb", "2",
           "-np", "1", "--cache-ram", "0"]  # with its warm-up decode, which exercises the matmul kernels
with open(log_path, "wb") as log:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
try:
    deadline = time.monotonic() + READY_S
    while True:
        if process.poll() is not None:
            fail(f"llama-server {status(process.returncode)} before it was ready")
        try:
            with opener.open(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            fail(f"llama-server not ready on {base}/health within {READY_S} s")
        time.sleep(0.5)
    request = urllib.request.Request(f"{base}/completion", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "The capital of France is", "n_predict": 1,
                                                      "ignore_eos": True, "temperature": 0}).encode())
    try:
        with opener.open(request, timeout=ANSWER_S) as response:
            answer = json.load(response)
    except (OSError, ValueError) as error:
        process.poll()
        state = f"; llama-server {status(process.returncode)}" if process.returncode is not None else ""
        fail(f"no completion from {base}/completion within {ANSWER_S} s ({error}){state}")
    if answer.get("tokens_predicted") != 1:
        fail(f"the completion did not predict one token: {json.dumps(answer)[:300]}")
    print(f"smoke run passed: 1 token {answer.get('content')!r} on 127.0.0.1:{port}", file=sys.stderr)
finally:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_S)
PY

install -D "$work/build/bin/llama-server" "$dest/bin/llama-server"
echo "$source_line" > "$dest/SOURCE"
echo "$dest/bin/llama-server"
