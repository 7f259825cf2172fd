#!/usr/bin/env bash
# Device-side end-of-change run: C++ GPU tests, compute-sanitizer on small shapes, kernel timing, the
# Python GPU tests, and the wan480 and sweep benchmark presets.
# Usage: bash scripts/device/final_check.sh BUILD_DIR GIT_COMMIT
# (carry BUILD_DIR/src/libopenvc.so, BUILD_DIR/tests/cpp/openvc_gpu_tests, BUILD_DIR/openvc_bench_attention,
# third_party/cutlass)
set -u
B=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/$B/src:${LD_LIBRARY_PATH:-}
T=$B/tests/cpp/openvc_gpu_tests
timeout 120 "$T" --gtest_filter='Sm90*:*Prepare*' > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for tool in memcheck racecheck; do
  timeout 75 "$SAN" --tool $tool --error-exitcode 9 "$T" \
    --gtest_filter='Sm90Attention.SmallShapes:Prepare/PrepareShapes.*B2_Sq1000*:PrepareVarlen*' \
    > "$OUT/sanitizer-$tool.log" 2>&1
  echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
done
for h in 56 7; do timeout 60 "$B/openvc_bench_attention" 73397 $h 1 7 4 2>&1 | tee -a "$OUT/kernel_bench.log"; done
# The Python package must load its own libopenvc.so (RUNPATH $ORIGIN), not the carried one: a library
# built on another machine's toolchain need not match the device's libstdc++.
unset LD_LIBRARY_PATH
export OPENVC_CUTLASS_INCLUDE=$PWD/third_party/cutlass/include CMAKE_BUILD_PARALLEL_LEVEL=16 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_gpu_api.py \
  tests/python/test_gpu_varlen_prepared.py 2>&1 | tail -6
timeout 80 open-vc-attn-bench --preset wan480 --backends open-vc,sdpa-cudnn --rounds 6 --out "$OUT/bench-wan480.json" \
  --git-commit "$2" --no-ceilings --time-budget-s 60 2>&1 | grep -E "TF|record" | tail -6
timeout 110 open-vc-attn-bench --preset sweep --backends open-vc,sdpa-cudnn --rounds 4 --out "$OUT/bench-sweep.json" \
  --git-commit "$2" --time-budget-s 80 2>&1 | grep -E "TF|ceilings|record" | tail -16
