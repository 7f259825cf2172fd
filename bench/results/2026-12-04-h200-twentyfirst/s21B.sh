#!/bin/bash
# Twenty-first session, call B: the kSpareWarpsQuantize probe (the producer warpgroup's idle warps quantize BF16 K and
# V while the consumers run the plain kernel): what preparation work inside the attention kernel would cost it.
cd "$(dirname "$0")/.."
mkdir -p /tmp/B /tmp/bin
gunzip -c .carry/libopenvc_B.so.gz > /tmp/B/libopenvc.so
gunzip -c .carry/openvc_bench_probe.gz > /tmp/bin/openvc_bench_probe; chmod +x /tmp/bin/openvc_bench_probe
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.sm --format=csv > $OUT/gpu.txt
{
for a in "8192 40 1" "73397 7 1" "4096 7 1" "16384 24 1" "32760 40 1"; do
  echo "== $a $(date +%T)"; LD_LIBRARY_PATH=/tmp/B timeout 150 /tmp/bin/openvc_bench_probe $a 5 4 variants
done
} > $OUT/spare_probe.log 2>&1
grep -E "^==|^S=|idle producer|plain mode" $OUT/spare_probe.log
