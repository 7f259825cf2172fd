#!/usr/bin/env bash
# Stage-breakdown timing of the sm_90a kernel (built with -DOPENVC_BENCH_VARIANTS=ON), on the device.
set -u
B=${1:-build/dev}
export LD_LIBRARY_PATH=$PWD/$B/src:${LD_LIBRARY_PATH:-}
for args in "73397 7" "73397 56"; do
  timeout 200 "$B/openvc_bench_attention" $args 1 7 4 variants
done
