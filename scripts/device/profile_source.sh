#!/usr/bin/env bash
# Nsight Compute profile of the production attention kernel (S = 32,768, H = 7): the summary sections
# (speed of light, scheduler, warp states, memory and compute workload) in ncu_details.txt and the
# per-instruction stall sampling as CSV (ncu_source.csv; read it with scripts/profile_summary.py).
# Carry BUILD_DIR/src/libopenvc.so and BUILD_DIR/openvc_bench_attention.
# Usage (on the device): bash scripts/device/profile_source.sh BUILD_DIR
set -u
B=${1:-build/dev}
export LD_LIBRARY_PATH=$PWD/$B/src:${LD_LIBRARY_PATH:-}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
OUT=${OUT:-/tmp/out}
timeout 300 "$NCU" --clock-control none -k regex:expcast_attention --launch-skip 0 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  -o "$OUT/prof" -f "$B/openvc_bench_attention" 32768 7 1 1 4 > "$OUT/ncu_run.txt" 2>&1
tail -3 "$OUT/ncu_run.txt"
"$NCU" --import "$OUT/prof.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
"$NCU" --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2>&1
wc -l "$OUT/ncu_source.csv"; head -c 600 "$OUT/ncu_source.csv"; echo
grep -E "Issue Slot|Eligible|Active Warps|No Eligible|SM Busy|Compute \(SM\)|Duration" "$OUT/ncu_details.txt" | head -12
