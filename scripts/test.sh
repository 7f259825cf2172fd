#!/usr/bin/env bash
# All tests: the C++ suites (GoogleTest through CTest: CPU reference tests, GPU tests that skip with a
# reason without an sm_90 GPU) and the Python suite (pytest; GPU tests marked and skipped likewise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD=${OPENVC_TEST_BUILD:-build/test}
JOBS=${JOBS:-$(nproc)}
cmake -S . -B "$BUILD" -DOPENVC_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"
bash scripts/install.sh
PY=${PYTHON:-python3}
"$PY" -m pytest -q -rs tests/python
