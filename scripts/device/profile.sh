#!/usr/bin/env bash
# Nsight Compute summary of the production attention kernel (Firecracker machines read counters).
set -u
B=${1:-build/dev}
export LD_LIBRARY_PATH=$PWD/$B/src:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
OUT=${OUT:-/tmp/out}
timeout 400 "$NCU" --clock-control none -k regex:expcast_attention --launch-skip 0 --launch-count 1 \
  --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section ComputeWorkloadAnalysis \
  "$B/openvc_bench_attention" 32768 7 1 1 4 > "$OUT/ncu.txt" 2>&1
grep -vE "^==PROF==|^\s*$" "$OUT/ncu.txt" | grep -vE "^\s+-{5,}" | head -150
