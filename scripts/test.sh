#!/usr/bin/env bash
# All tests: the C++ suites (GoogleTest through CTest: CPU reference tests, GPU tests that skip with a
# reason without an sm_90 GPU) and the Python suite (pytest; GPU tests marked and skipped likewise).
# Installs the test requirements that are missing (requirements/test.txt: pytest, torch, which the
# torch tests need even without a GPU, and build for the packaging tests; offline, as on the GPU
# machine, what cannot be installed is reported and its tests skip, except under CI) and GoogleTest
# (apt-get, as root, when it is missing). OPENVC_TEST_BUILD (build/test) is the C++ build folder,
# JOBS (nproc) the parallelism.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
openvc_python
openvc_check_tools
openvc_require requirements/build.txt
openvc_require --tolerant requirements/test.txt

if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/src/googletest/CMakeLists.txt ] &&
   [ ! -d third_party/googletest ]; then   # the places tests/cpp/CMakeLists.txt looks
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "test: installing GoogleTest (apt-get install libgtest-dev)"
    apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
  else
    echo "test: GoogleTest missing: apt-get install libgtest-dev (or its sources in third_party/googletest)" >&2
    exit 1
  fi
fi

BUILD=${OPENVC_TEST_BUILD:-build/test}
JOBS=${JOBS:-$(nproc)}
# Python3_EXECUTABLE: the chosen environment (cmake/cutlass.cmake's last place to look for the CUTLASS
# headers; openvc_require above put them in third_party/cutlass/include, which it looks at first).
cmake -S . -B "$BUILD" -DOPENVC_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" >/dev/null
cmake --build "$BUILD" -j "$JOBS"
ctest --test-dir "$BUILD" --output-on-failure -j "$JOBS"

bash scripts/install.sh
"$PY" -m pytest -q -rs tests/python
