#!/usr/bin/env bash
# Device-side check of everything GPU in one call: the C++ GPU suites (binaries built on the CPU
# machine and carried), compute-sanitizer on a small shape of each kernel family, a wheel of the
# package built with the image's torch (kept under $OUT/wheel so that a later call can carry it instead
# of rebuilding), and the Python GPU tests. Carry BUILD_DIR/src/libopenvc.so,
# BUILD_DIR/tests/cpp/openvc_gpu_tests and third_party/cutlass.
# Usage (on the device): bash scripts/device/full_check.sh BUILD_DIR [PYTEST_PATHS...]
set -u
B=${1:-build/dev}
shift || true
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

# Wheel build in the background while the C++ tests run (16 cores).
( export OPENVC_CUTLASS_INCLUDE=$PWD/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=12
  time python3 -m pip wheel -q --no-build-isolation --no-deps . -w "$OUT/wheel" ) > "$OUT/wheel.log" 2>&1 &
WHEEL_PID=$!

T=$B/tests/cpp/openvc_gpu_tests
(export LD_LIBRARY_PATH=$PWD/$B/src
 timeout 420 "$T" 2>&1 | grep -vE "^\[ +(RUN|OK) +\]" > "$OUT/gpu_tests.log"
 grep -E "^\[  (PASSED|FAILED) |FAILED TEST|^\[==========\]" "$OUT/gpu_tests.log" | tail -12
 for f in 'Sm90Attention.ZeroResidual*' 'GeneralAttention.PackedThreeSequences' 'RepairGiven.*' \
          'VcPrepare.ByteIdenticalToReference'; do
   for tool in memcheck racecheck; do
     r=$(timeout 120 compute-sanitizer --tool $tool "$T" --gtest_filter="$f" 2>&1 | grep -E "ERROR SUMMARY|RACECHECK SUMMARY" | tail -1)
     echo "sanitizer $tool $f: $r" | tee -a "$OUT/sanitizer.log"
   done
 done)

wait $WHEEL_PID || { echo "wheel build FAILED"; tail -30 "$OUT/wheel.log"; exit 1; }
tail -3 "$OUT/wheel.log"
python3 -m pip install -q --no-deps --force-reinstall "$OUT"/wheel/*.whl > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
REPO=$PWD
PATHS=()
for a in "$@"; do PATHS+=("$REPO/$a"); done
[ ${#PATHS[@]} -gt 0 ] || PATHS=("$REPO/tests/python")
cd /tmp   # import the installed package, not the source tree
timeout 400 python3 -m pytest -q -rs -p no:cacheprovider "${PATHS[@]}" > "$OUT/pytest.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -25
