#!/usr/bin/env bash
# Device-side check of binaries built on the CPU machine (carried build dir): GPU tests, SASS summary
# and a kernel timing sweep. Usage (on the device): bash scripts/device/kernel_check.sh BUILD_DIR [filter]
set -u
B=${1:-build/dev}
FILTER=${2:-Sm90*:Prepare*}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/$B/src:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 300 "$B/tests/cpp/openvc_gpu_tests" --gtest_filter="$FILTER" 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\[ +(RUN|OK) +\]" | tail -40
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$B/src/libopenvc.so" > "$OUT/libopenvc.sass" 2>/dev/null
  echo "SASS of the attention kernel (instruction counts):"
  awk '/Function : .*expcast_attention/{f=1} /Function : /{if($0 !~ /expcast_attention/) f=0} f' "$OUT/libopenvc.sass" |
    grep -oE "(QGMMA|MUFU\.[A-Z0-9]+|F2FP\.[A-Z0-9.]+|LDL|STL|CALL[A-Z.]*|HMNMX2|PRMT|WARPGROUP\.[A-Z]+)" | sort | uniq -c
fi
for args in "73397 7" "73397 14" "73397 56" "32760 40" "4096 7"; do
  timeout 120 "$B/openvc_bench_attention" $args 1 7 4 2>&1 | tee -a "$OUT/bench.log"
done
