#!/usr/bin/env bash
# Installs everything openvc needs on a fresh machine (Debian + CUDA toolkit + Python 3.9+):
# the pinned Python build dependencies (CUTLASS headers come from the nvidia-cutlass wheel) and
# GoogleTest. Idempotent; sourced by scripts/smoke.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
command -v nvcc >/dev/null || { echo "setup: nvcc not found (install the CUDA toolkit, 12.8 or newer)"; exit 1; }
command -v cmake >/dev/null || { echo "setup: cmake not found (apt-get install cmake)"; exit 1; }
if ! "$PY" -c "import cutlass_library, nanobind, scikit_build_core, numpy, pytest" 2>/dev/null; then
  "$PY" -m pip install -q -r requirements/build.txt -r requirements/test.txt
fi
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/src/googletest/CMakeLists.txt ] && [ ! -d third_party/googletest ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
  else
    echo "setup: GoogleTest missing: install libgtest-dev"; exit 1
  fi
fi
