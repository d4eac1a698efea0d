#!/usr/bin/env bash
# Build llama.cpp's C++ server (llama-server) for benchmarks/serving.py and benchmarks/cache_reuse.py, from the
# llama.cpp tree vendored in llama-cpp-python 0.3.36's source distribution (a pinned llama.cpp). The sdist comes
# from PyPI and is checked against its sha256; the build has no web UI and no network at run time.
# Installs $KVSCOPE_CACHE_DIR/llama-server/bin/llama-server (about 10 min on 2 CPU cores) and prints its path.
set -euo pipefail
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
dest="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/llama-server"
if [ -x "$dest/bin/llama-server" ] && [ "$(cat "$dest/SOURCE" 2>/dev/null)" = "llama-cpp-python $version $sha256" ]; then
  echo "$dest/bin/llama-server"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$work"
echo "$sha256  $work/llama_cpp_python-$version.tar.gz" | sha256sum -c --quiet -
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
cmake -S "$work/llama_cpp_python-$version/vendor/llama.cpp" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$work/build" --target llama-server -j "$(nproc)" >/dev/null
install -D "$work/build/bin/llama-server" "$dest/bin/llama-server"
echo "llama-cpp-python $version $sha256" > "$dest/SOURCE"
echo "$dest/bin/llama-server"
